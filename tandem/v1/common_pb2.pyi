from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Features(_message.Message):
    __slots__ = ("tensor", "ref", "row_offset", "num_rows", "total_rows")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    ROW_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    tensor: Tensor
    ref: FeatureRef
    row_offset: int
    num_rows: int
    total_rows: int
    def __init__(self, tensor: _Optional[_Union[Tensor, _Mapping]] = ..., ref: _Optional[_Union[FeatureRef, _Mapping]] = ..., row_offset: _Optional[int] = ..., num_rows: _Optional[int] = ..., total_rows: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ...) -> None: ...

class DraftProbs(_message.Message):
    __slots__ = ("ids", "probs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class TreeParams(_message.Message):
    __slots__ = ("nodes", "depth", "top_k")
    NODES_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    nodes: int
    depth: int
    top_k: int
    def __init__(self, nodes: _Optional[int] = ..., depth: _Optional[int] = ..., top_k: _Optional[int] = ...) -> None: ...

class FeatureRef(_message.Message):
    __slots__ = ("transport", "channel", "sequence", "offset", "rows", "width", "dtype", "event")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    transport: str
    channel: str
    sequence: int
    offset: int
    rows: int
    width: int
    dtype: str
    event: int
    def __init__(self, transport: _Optional[str] = ..., channel: _Optional[str] = ..., sequence: _Optional[int] = ..., offset: _Optional[int] = ..., rows: _Optional[int] = ..., width: _Optional[int] = ..., dtype: _Optional[str] = ..., event: _Optional[int] = ...) -> None: ...

class TransportCaps(_message.Message):
    __slots__ = ("requested", "available", "host_id", "device", "device_uuid", "dtype", "feature_width", "visible_uuids")
    REQUESTED_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    FEATURE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    VISIBLE_UUIDS_FIELD_NUMBER: _ClassVar[int]
    requested: str
    available: _containers.RepeatedScalarFieldContainer[str]
    host_id: str
    device: str
    device_uuid: str
    dtype: str
    feature_width: int
    visible_uuids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, requested: _Optional[str] = ..., available: _Optional[_Iterable[str]] = ..., host_id: _Optional[str] = ..., device: _Optional[str] = ..., device_uuid: _Optional[str] = ..., dtype: _Optional[str] = ..., feature_width: _Optional[int] = ..., visible_uuids: _Optional[_Iterable[str]] = ...) -> None: ...

class LocalSteps(_message.Message):
    __slots__ = ("path", "token")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    path: str
    token: str
    def __init__(self, path: _Optional[str] = ..., token: _Optional[str] = ...) -> None: ...

class TransportPlan(_message.Message):
    __slots__ = ("transport", "reason", "dtype", "feature_width", "ring_bytes", "max_inflight", "timeout", "channel", "address", "handle", "device_uuid")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    FEATURE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    RING_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    transport: str
    reason: str
    dtype: str
    feature_width: int
    ring_bytes: int
    max_inflight: int
    timeout: float
    channel: str
    address: str
    handle: bytes
    device_uuid: str
    def __init__(self, transport: _Optional[str] = ..., reason: _Optional[str] = ..., dtype: _Optional[str] = ..., feature_width: _Optional[int] = ..., ring_bytes: _Optional[int] = ..., max_inflight: _Optional[int] = ..., timeout: _Optional[float] = ..., channel: _Optional[str] = ..., address: _Optional[str] = ..., handle: _Optional[bytes] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "grammar", "choice")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    choice: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., choice: _Optional[_Iterable[str]] = ...) -> None: ...
