from tandem.v1 import common_pb2 as _common_pb2
from tandem.v1 import profile_pb2 as _profile_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "draft_vocab_size", "target_hidden_size", "max_target_id", "aux_layer_ids", "dtype", "device", "num_sessions", "max_context", "target_max_context", "transport", "compiling", "local_steps")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TARGET_ID_FIELD_NUMBER: _ClassVar[int]
    AUX_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TARGET_MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    COMPILING_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    max_target_id: int
    aux_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    device: str
    num_sessions: int
    max_context: int
    target_max_context: int
    transport: _common_pb2.TransportCaps
    compiling: bool
    local_steps: _common_pb2.LocalSteps
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., draft_vocab_size: _Optional[int] = ..., target_hidden_size: _Optional[int] = ..., max_target_id: _Optional[int] = ..., aux_layer_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., num_sessions: _Optional[int] = ..., max_context: _Optional[int] = ..., target_max_context: _Optional[int] = ..., transport: _Optional[_Union[_common_pb2.TransportCaps, _Mapping]] = ..., compiling: _Optional[bool] = ..., local_steps: _Optional[_Union[_common_pb2.LocalSteps, _Mapping]] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("next_tokens", "num_draft_tokens", "features", "want_timing", "ahead", "sampling", "tree", "constraint")
    NEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    WANT_TIMING_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    next_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: int
    features: _common_pb2.Features
    want_timing: bool
    ahead: Ahead
    sampling: _common_pb2.SamplingParams
    tree: _common_pb2.TreeParams
    constraint: DraftConstraint
    def __init__(self, next_tokens: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[int] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ..., want_timing: _Optional[bool] = ..., ahead: _Optional[_Union[Ahead, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., tree: _Optional[_Union[_common_pb2.TreeParams, _Mapping]] = ..., constraint: _Optional[_Union[DraftConstraint, _Mapping]] = ...) -> None: ...

class DraftConstraint(_message.Message):
    __slots__ = ("grammar", "min_tokens", "stop_ids", "output_tokens")
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    grammar: _common_pb2.Grammar
    min_tokens: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    output_tokens: int
    def __init__(self, grammar: _Optional[_Union[_common_pb2.Grammar, _Mapping]] = ..., min_tokens: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ..., output_tokens: _Optional[int] = ...) -> None: ...

class Ahead(_message.Message):
    __slots__ = ("assumed", "branches")
    ASSUMED_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    assumed: _containers.RepeatedScalarFieldContainer[int]
    branches: int
    def __init__(self, assumed: _Optional[_Iterable[int]] = ..., branches: _Optional[int] = ...) -> None: ...

class Branch(_message.Message):
    __slots__ = ("accepted", "bonus", "drafts", "q")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    bonus: int
    drafts: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[_common_pb2.DraftProbs]
    def __init__(self, accepted: _Optional[int] = ..., bonus: _Optional[int] = ..., drafts: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[_common_pb2.DraftProbs, _Mapping]]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("drafts", "timing", "branches", "q", "parents")
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    drafts: _containers.RepeatedScalarFieldContainer[int]
    timing: _profile_pb2.StepTiming
    branches: _containers.RepeatedCompositeFieldContainer[Branch]
    q: _containers.RepeatedCompositeFieldContainer[_common_pb2.DraftProbs]
    parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, drafts: _Optional[_Iterable[int]] = ..., timing: _Optional[_Union[_profile_pb2.StepTiming, _Mapping]] = ..., branches: _Optional[_Iterable[_Union[Branch, _Mapping]]] = ..., q: _Optional[_Iterable[_Union[_common_pb2.DraftProbs, _Mapping]]] = ..., parents: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftBatch(_message.Message):
    __slots__ = ("steps", "release")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[DraftSessionStep]
    release: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, steps: _Optional[_Iterable[_Union[DraftSessionStep, _Mapping]]] = ..., release: _Optional[_Iterable[str]] = ...) -> None: ...

class DraftSessionStep(_message.Message):
    __slots__ = ("session_id", "request", "open")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    request: DraftRequest
    open: bool
    def __init__(self, session_id: _Optional[str] = ..., request: _Optional[_Union[DraftRequest, _Mapping]] = ..., open: _Optional[bool] = ...) -> None: ...

class DraftBatchResult(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[DraftStepResult]
    def __init__(self, results: _Optional[_Iterable[_Union[DraftStepResult, _Mapping]]] = ...) -> None: ...

class DraftStepResult(_message.Message):
    __slots__ = ("response", "error")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    response: DraftResponse
    error: _common_pb2.StepError
    def __init__(self, response: _Optional[_Union[DraftResponse, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.StepError, _Mapping]] = ...) -> None: ...
