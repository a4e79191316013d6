from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StepTiming(_message.Message):
    __slots__ = ("received_ns", "sent_ns", "queue_ns", "compute_ns", "codec_ns")
    RECEIVED_NS_FIELD_NUMBER: _ClassVar[int]
    SENT_NS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    CODEC_NS_FIELD_NUMBER: _ClassVar[int]
    received_ns: int
    sent_ns: int
    queue_ns: int
    compute_ns: int
    codec_ns: int
    def __init__(self, received_ns: _Optional[int] = ..., sent_ns: _Optional[int] = ..., queue_ns: _Optional[int] = ..., compute_ns: _Optional[int] = ..., codec_ns: _Optional[int] = ...) -> None: ...

class LinkTraffic(_message.Message):
    __slots__ = ("link", "transport", "messages", "bytes", "token_ids", "feature_rows")
    class BytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    LINK_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_ROWS_FIELD_NUMBER: _ClassVar[int]
    link: str
    transport: str
    messages: int
    bytes: _containers.ScalarMap[str, int]
    token_ids: int
    feature_rows: int
    def __init__(self, link: _Optional[str] = ..., transport: _Optional[str] = ..., messages: _Optional[int] = ..., bytes: _Optional[_Mapping[str, int]] = ..., token_ids: _Optional[int] = ..., feature_rows: _Optional[int] = ...) -> None: ...

class RoundProfile(_message.Message):
    __slots__ = ("index", "start_ns", "end_ns", "draft_sent_ns", "draft_received_ns", "target_sent_ns", "target_received_ns", "draft", "target", "num_drafts", "num_accepted", "num_tokens", "traffic", "ahead_sent_ns", "ahead_received_ns", "ahead", "overlap_hit")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    END_NS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SENT_NS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_RECEIVED_NS_FIELD_NUMBER: _ClassVar[int]
    TARGET_SENT_NS_FIELD_NUMBER: _ClassVar[int]
    TARGET_RECEIVED_NS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_FIELD_NUMBER: _ClassVar[int]
    AHEAD_SENT_NS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_RECEIVED_NS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_HIT_FIELD_NUMBER: _ClassVar[int]
    index: int
    start_ns: int
    end_ns: int
    draft_sent_ns: int
    draft_received_ns: int
    target_sent_ns: int
    target_received_ns: int
    draft: StepTiming
    target: StepTiming
    num_drafts: int
    num_accepted: int
    num_tokens: int
    traffic: _containers.RepeatedCompositeFieldContainer[LinkTraffic]
    ahead_sent_ns: int
    ahead_received_ns: int
    ahead: StepTiming
    overlap_hit: bool
    def __init__(self, index: _Optional[int] = ..., start_ns: _Optional[int] = ..., end_ns: _Optional[int] = ..., draft_sent_ns: _Optional[int] = ..., draft_received_ns: _Optional[int] = ..., target_sent_ns: _Optional[int] = ..., target_received_ns: _Optional[int] = ..., draft: _Optional[_Union[StepTiming, _Mapping]] = ..., target: _Optional[_Union[StepTiming, _Mapping]] = ..., num_drafts: _Optional[int] = ..., num_accepted: _Optional[int] = ..., num_tokens: _Optional[int] = ..., traffic: _Optional[_Iterable[_Union[LinkTraffic, _Mapping]]] = ..., ahead_sent_ns: _Optional[int] = ..., ahead_received_ns: _Optional[int] = ..., ahead: _Optional[_Union[StepTiming, _Mapping]] = ..., overlap_hit: _Optional[bool] = ...) -> None: ...

class RequestProfile(_message.Message):
    __slots__ = ("start_ns", "end_ns", "rounds", "transport", "target_hidden_size", "target_dtype", "target_device", "draft_device")
    START_NS_FIELD_NUMBER: _ClassVar[int]
    END_NS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TARGET_HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TARGET_DEVICE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DEVICE_FIELD_NUMBER: _ClassVar[int]
    start_ns: int
    end_ns: int
    rounds: _containers.RepeatedCompositeFieldContainer[RoundProfile]
    transport: str
    target_hidden_size: int
    target_dtype: str
    target_device: str
    draft_device: str
    def __init__(self, start_ns: _Optional[int] = ..., end_ns: _Optional[int] = ..., rounds: _Optional[_Iterable[_Union[RoundProfile, _Mapping]]] = ..., transport: _Optional[str] = ..., target_hidden_size: _Optional[int] = ..., target_dtype: _Optional[str] = ..., target_device: _Optional[str] = ..., draft_device: _Optional[str] = ...) -> None: ...
