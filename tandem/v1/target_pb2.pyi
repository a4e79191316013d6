from tandem.v1 import common_pb2 as _common_pb2
from tandem.v1 import profile_pb2 as _profile_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TargetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "hidden_size", "num_layers", "layer_ids", "eos_token_ids", "max_context", "dtype", "device", "tokenizer_size", "num_sessions", "transport", "chat_template", "special_tokens", "buckets_compiling", "generation_config", "kv_cache_tokens", "local_steps")
    class SpecialTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_COMPILING_FIELD_NUMBER: _ClassVar[int]
    GENERATION_CONFIG_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_ids: _containers.RepeatedScalarFieldContainer[int]
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_context: int
    dtype: str
    device: str
    tokenizer_size: int
    num_sessions: int
    transport: _common_pb2.TransportCaps
    chat_template: str
    special_tokens: _containers.ScalarMap[str, str]
    buckets_compiling: int
    generation_config: str
    kv_cache_tokens: int
    local_steps: _common_pb2.LocalSteps
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., layer_ids: _Optional[_Iterable[int]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_context: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., tokenizer_size: _Optional[int] = ..., num_sessions: _Optional[int] = ..., transport: _Optional[_Union[_common_pb2.TransportCaps, _Mapping]] = ..., chat_template: _Optional[str] = ..., special_tokens: _Optional[_Mapping[str, str]] = ..., buckets_compiling: _Optional[int] = ..., generation_config: _Optional[str] = ..., kv_cache_tokens: _Optional[int] = ..., local_steps: _Optional[_Union[_common_pb2.LocalSteps, _Mapping]] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class TargetRequest(_message.Message):
    __slots__ = ("prefill", "verify")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    prefill: Prefill
    verify: Verify
    def __init__(self, prefill: _Optional[_Union[Prefill, _Mapping]] = ..., verify: _Optional[_Union[Verify, _Mapping]] = ...) -> None: ...

class Prefill(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "sampling", "want_features", "want_timing", "max_new_tokens", "verify_tokens", "allowed", "output_start")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    WANT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    WANT_TIMING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_START_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    want_features: bool
    want_timing: bool
    max_new_tokens: int
    verify_tokens: int
    allowed: bytes
    output_start: int
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., want_features: _Optional[bool] = ..., want_timing: _Optional[bool] = ..., max_new_tokens: _Optional[int] = ..., verify_tokens: _Optional[int] = ..., allowed: _Optional[bytes] = ..., output_start: _Optional[int] = ...) -> None: ...

class Verify(_message.Message):
    __slots__ = ("token", "drafts", "want_features", "q", "parents", "decode", "stop_ids", "allowed")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    WANT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    token: int
    drafts: _containers.RepeatedScalarFieldContainer[int]
    want_features: bool
    q: _containers.RepeatedCompositeFieldContainer[_common_pb2.DraftProbs]
    parents: _containers.RepeatedScalarFieldContainer[int]
    decode: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    allowed: bytes
    def __init__(self, token: _Optional[int] = ..., drafts: _Optional[_Iterable[int]] = ..., want_features: _Optional[bool] = ..., q: _Optional[_Iterable[_Union[_common_pb2.DraftProbs, _Mapping]]] = ..., parents: _Optional[_Iterable[int]] = ..., decode: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ..., allowed: _Optional[bytes] = ...) -> None: ...

class TargetBatch(_message.Message):
    __slots__ = ("steps", "release")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[SessionStep]
    release: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, steps: _Optional[_Iterable[_Union[SessionStep, _Mapping]]] = ..., release: _Optional[_Iterable[str]] = ...) -> None: ...

class SessionStep(_message.Message):
    __slots__ = ("session_id", "request")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    request: TargetRequest
    def __init__(self, session_id: _Optional[str] = ..., request: _Optional[_Union[TargetRequest, _Mapping]] = ...) -> None: ...

class TargetBatchResult(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StepResult]
    def __init__(self, results: _Optional[_Iterable[_Union[StepResult, _Mapping]]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("response", "error")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    response: TargetResponse
    error: _common_pb2.StepError
    def __init__(self, response: _Optional[_Union[TargetResponse, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.StepError, _Mapping]] = ...) -> None: ...

class TargetResponse(_message.Message):
    __slots__ = ("prefilled", "verified", "features", "timing")
    PREFILLED_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    prefilled: Prefilled
    verified: Verified
    features: _common_pb2.Features
    timing: _profile_pb2.StepTiming
    def __init__(self, prefilled: _Optional[_Union[Prefilled, _Mapping]] = ..., verified: _Optional[_Union[Verified, _Mapping]] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ..., timing: _Optional[_Union[_profile_pb2.StepTiming, _Mapping]] = ...) -> None: ...

class Prefilled(_message.Message):
    __slots__ = ("token", "logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Verified(_message.Message):
    __slots__ = ("accepted", "bonus", "warming", "logprobs")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    WARMING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    accepted: _containers.RepeatedScalarFieldContainer[int]
    bonus: int
    warming: bool
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, accepted: _Optional[_Iterable[int]] = ..., bonus: _Optional[int] = ..., warming: _Optional[bool] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "top_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...
