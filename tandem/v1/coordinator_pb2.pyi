from tandem.v1 import common_pb2 as _common_pb2
from tandem.v1 import profile_pb2 as _profile_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_ids", "max_new_tokens", "num_draft_tokens", "sampling", "stop_token_ids", "stop", "ignore_eos", "speculate", "profile", "messages", "tree", "grammar", "min_tokens")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    num_draft_tokens: int
    sampling: _common_pb2.SamplingParams
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    speculate: bool
    profile: bool
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tree: _common_pb2.TreeParams
    grammar: _common_pb2.Grammar
    min_tokens: int
    def __init__(self, prompt: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., speculate: _Optional[bool] = ..., profile: _Optional[bool] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tree: _Optional[_Union[_common_pb2.TreeParams, _Mapping]] = ..., grammar: _Optional[_Union[_common_pb2.Grammar, _Mapping]] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("num_rounds", "num_draft_tokens", "num_accepted_tokens", "mean_acceptance_length", "accepted_per_position", "num_rounds_without_draft", "num_rounds_load_shed", "num_overlap_rounds", "num_overlap_hits", "overlap_hit_rate", "num_tree_rounds", "num_constrained_cuts", "constraint_seconds", "num_forced_drafts")
    NUM_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    NUM_ROUNDS_WITHOUT_DRAFT_FIELD_NUMBER: _ClassVar[int]
    NUM_ROUNDS_LOAD_SHED_FIELD_NUMBER: _ClassVar[int]
    NUM_OVERLAP_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    NUM_OVERLAP_HITS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    NUM_TREE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CONSTRAINED_CUTS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_FORCED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    num_rounds: int
    num_draft_tokens: int
    num_accepted_tokens: int
    mean_acceptance_length: float
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    num_rounds_without_draft: int
    num_rounds_load_shed: int
    num_overlap_rounds: int
    num_overlap_hits: int
    overlap_hit_rate: float
    num_tree_rounds: int
    num_constrained_cuts: int
    constraint_seconds: float
    num_forced_drafts: int
    def __init__(self, num_rounds: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., mean_acceptance_length: _Optional[float] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., num_rounds_without_draft: _Optional[int] = ..., num_rounds_load_shed: _Optional[int] = ..., num_overlap_rounds: _Optional[int] = ..., num_overlap_hits: _Optional[int] = ..., overlap_hit_rate: _Optional[float] = ..., num_tree_rounds: _Optional[int] = ..., num_constrained_cuts: _Optional[int] = ..., constraint_seconds: _Optional[float] = ..., num_forced_drafts: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "stats", "profile")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    stats: GenerationStats
    profile: _profile_pb2.RequestProfile
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., profile: _Optional[_Union[_profile_pb2.RequestProfile, _Mapping]] = ...) -> None: ...

class ServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfoResponse(_message.Message):
    __slots__ = ("target_model", "draft_model", "vocab_size", "max_context", "has_tokenizer", "draft_attached", "target_buckets_compiling", "draft_compiling")
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ATTACHED_FIELD_NUMBER: _ClassVar[int]
    TARGET_BUCKETS_COMPILING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPILING_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    draft_model: str
    vocab_size: int
    max_context: int
    has_tokenizer: bool
    draft_attached: bool
    target_buckets_compiling: int
    draft_compiling: bool
    def __init__(self, target_model: _Optional[str] = ..., draft_model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., has_tokenizer: _Optional[bool] = ..., draft_attached: _Optional[bool] = ..., target_buckets_compiling: _Optional[int] = ..., draft_compiling: _Optional[bool] = ...) -> None: ...
