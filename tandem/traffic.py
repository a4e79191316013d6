"""What crosses each process boundary: messages and bytes per link, split by kind.

Links are directed and named after the two processes:

    client->coordinator   coordinator->client
    coordinator->target   target->coordinator
    coordinator->draft    draft->coordinator
    target->draft         the feature fast paths (CUDA IPC, NCCL, shared memory): their transport
                          counts here with Traffic.add; over gRPC features are relayed instead

Kinds split a message's serialized size; they add up to it exactly:

    features     tensor payload bytes: rows x 3H x dtype size (the framing around them is control)
    token_ids    the varint-encoded token id values (packed repeated fields: no tag, no length)
    draft_probs  q of sampled drafts: the DraftProbs messages (support ids as varints, float32
                 probabilities, and their own few bytes of framing); greedy drafts carry none
    tree         a draft tree's shape: the parent of each node (a varint byte each), draft -> coordinator
                 -> target; chains carry none
    text         UTF-8 bytes of the prompt and of the output text
    control      the rest: tags, lengths, shapes, sampling parameters, session ids, step timing

Counting happens where the bytes are serialized, so the sizes are the real ones and cost no
extra serialization: each service's gRPC server wraps every method's serializer and deserializer
(TrafficInterceptor), and the coordinator wraps its channels to the target and the draft
(MeteredChannel). Each process counts what it sends and what it receives.

No torch here: the coordinator counts too.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc

from tandem.dtypes import ITEMSIZE
from tandem.v1 import common_pb2, coordinator_pb2, draft_pb2, target_pb2

LINKS = (
    "client->coordinator",
    "coordinator->client",
    "coordinator->target",
    "target->coordinator",
    "coordinator->draft",
    "draft->coordinator",
    "target->draft",
)
KINDS = ("features", "token_ids", "draft_probs", "tree", "text", "control")
GRPC = "grpc"

# The links each service's gRPC server sends and receives on.
SERVER_LINKS = {
    "target": ("target->coordinator", "coordinator->target"),
    "draft": ("draft->coordinator", "coordinator->draft"),
    "coordinator": ("coordinator->client", "client->coordinator"),
}


# -- sizes by kind --------------------------------------------------------------------------------


def varint_size(value: int) -> int:
    """Bytes of a protobuf varint (int32/int64; a negative value takes 10)."""
    if value < 0:
        return 10
    return max(1, (value.bit_length() + 6) // 7)


def ids_size(ids: Iterable[int]) -> int:
    """The payload of a packed repeated int32 field: the sum of its varints."""
    return sum(varint_size(i) for i in ids)


def _scalar_id_size(value: int) -> int:
    return varint_size(value) if value else 0  # proto3 leaves a zero out of the message


@dataclass
class Parts:
    """A message's payload by kind (control is the rest of its size), and what it carries."""

    features: int = 0
    token_ids: int = 0
    draft_probs: int = 0
    tree: int = 0
    text: int = 0
    num_token_ids: int = 0
    feature_rows: int = 0

    def kinds(self, size: int) -> dict[str, int]:
        payload = self.features + self.token_ids + self.draft_probs + self.tree + self.text
        return {"features": self.features, "token_ids": self.token_ids, "draft_probs": self.draft_probs,
                "tree": self.tree, "text": self.text, "control": size - payload}


def _draft_probs(parts: Parts, q) -> None:
    # the messages' own sizes (computed in C): walking hundreds of ids in Python at each of the four
    # places q is counted slowed a sampled round on a CPU
    parts.draft_probs += sum(dist.ByteSize() for dist in q)


def _features(parts: Parts, chunk: common_pb2.Features) -> None:
    # From the shape, not len(data): reading a bytes field copies it (2 MiB for a full chunk).
    if chunk.WhichOneof("payload") == "tensor":
        t = chunk.tensor
        parts.features += math.prod(t.shape) * ITEMSIZE.get(t.dtype, 0)
        parts.feature_rows += chunk.num_rows


def _ids(parts: Parts, ids) -> None:
    parts.token_ids += ids_size(ids)
    parts.num_token_ids += len(ids)


def _scalar_id(parts: Parts, value: int) -> None:
    parts.token_ids += _scalar_id_size(value)
    parts.num_token_ids += 1


def _target_request(msg: target_pb2.TargetRequest, parts: Parts) -> None:
    step = msg.WhichOneof("step")
    if step == "prefill":
        _ids(parts, msg.prefill.prompt_ids)
    elif step == "verify":
        _scalar_id(parts, msg.verify.token)
        _ids(parts, msg.verify.drafts)
        _draft_probs(parts, msg.verify.q)
        parts.tree += ids_size(msg.verify.parents)


def _target_response(msg: target_pb2.TargetResponse, parts: Parts) -> None:
    result = msg.WhichOneof("result")
    if result == "prefilled":
        _scalar_id(parts, msg.prefilled.token)
    elif result == "verified":
        _ids(parts, msg.verified.accepted)
        _scalar_id(parts, msg.verified.bonus)
    if msg.HasField("features"):
        _features(parts, msg.features)


def _draft_request(msg: draft_pb2.DraftRequest, parts: Parts) -> None:
    _ids(parts, msg.next_tokens)
    if msg.HasField("features"):
        _features(parts, msg.features)


def _draft_response(msg: draft_pb2.DraftResponse, parts: Parts) -> None:
    _ids(parts, msg.drafts)
    _draft_probs(parts, msg.q)
    parts.tree += ids_size(msg.parents)
    for branch in msg.branches:
        _draft_probs(parts, branch.q)


def _generate_request(msg: coordinator_pb2.GenerateRequest, parts: Parts) -> None:
    _ids(parts, msg.prompt_ids)
    parts.text += len(msg.prompt.encode())


def _generate_response(msg: coordinator_pb2.GenerateResponse, parts: Parts) -> None:
    _ids(parts, msg.token_ids)
    parts.text += len(msg.text.encode())


def _each_step(classify: Callable) -> Callable:
    """A scheduler's batch of steps: each step's payload (session ids and framing are control)."""

    def count(msg, parts: Parts) -> None:
        for step in msg.steps:
            classify(step.request, parts)

    return count


def _each_result(classify: Callable) -> Callable:
    """A batch's answer: each answered step's payload."""

    def count(msg, parts: Parts) -> None:
        for result in msg.results:
            if result.HasField("response"):
                classify(result.response, parts)

    return count


_CLASSIFIERS: dict[type, Callable] = {
    target_pb2.TargetRequest: _target_request,
    target_pb2.TargetResponse: _target_response,
    draft_pb2.DraftRequest: _draft_request,
    draft_pb2.DraftResponse: _draft_response,
    coordinator_pb2.GenerateRequest: _generate_request,
    coordinator_pb2.GenerateResponse: _generate_response,
    target_pb2.TargetBatch: _each_step(_target_request),
    target_pb2.TargetBatchResult: _each_result(_target_response),
    draft_pb2.DraftBatch: _each_step(_draft_request),
    draft_pb2.DraftBatchResult: _each_result(_draft_response),
}


def parts_of(msg) -> Parts:
    """The payload of `msg` by kind; messages without payload (info, health, tokenizer) are all control."""
    parts = Parts()
    classify = _CLASSIFIERS.get(type(msg))
    if classify is not None:
        classify(msg, parts)
    return parts


# -- counters ---------------------------------------------------------------------------------------


@dataclass
class LinkCount:
    """One link's (or one link's share of a round's) messages and bytes by kind."""

    messages: int = 0
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    token_ids: int = 0
    feature_rows: int = 0

    def add(self, size: int, parts: Parts, messages: int = 1) -> None:
        self.messages += messages
        for kind, n in parts.kinds(size).items():
            self.bytes[kind] += n
        self.token_ids += parts.num_token_ids
        self.feature_rows += parts.feature_rows

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


class Traffic:
    """A process's counters: (direction, link, transport) -> LinkCount, direction "sent" or "received".

    Thread-safe; a count is a few dictionary updates, cheap enough to leave on.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str, str], LinkCount] = defaultdict(LinkCount)

    def count(self, direction: str, link: str, size: int, msg, transport: str = GRPC) -> None:
        """One message of `size` serialized bytes."""
        parts = parts_of(msg)
        with self._lock:
            self._counts[direction, link, transport].add(size, parts)

    def add(self, direction: str, link: str, transport: str, messages: int = 1, **payload: int) -> None:
        """Bytes that did not travel as a protobuf message (a fast path's feature copy): payload by kind."""
        parts = Parts(**{k: v for k, v in payload.items() if k in Parts.__dataclass_fields__})
        size = sum(v for k, v in payload.items() if k in KINDS)
        with self._lock:
            self._counts[direction, link, transport].add(size, parts, messages)

    def snapshot(self) -> dict[tuple[str, str, str], LinkCount]:
        with self._lock:
            return {
                key: LinkCount(c.messages, dict(c.bytes), c.token_ids, c.feature_rows)
                for key, c in self._counts.items()
            }


# -- where counting happens: gRPC serializers -------------------------------------------------------


def _counting_serializer(serialize: Callable | None, traffic: Traffic, link: str) -> Callable:
    def wrapped(msg) -> bytes:
        data = serialize(msg) if serialize is not None else msg
        traffic.count("sent", link, len(data), msg)
        return data

    return wrapped


def _counting_deserializer(deserialize: Callable | None, traffic: Traffic, link: str) -> Callable:
    def wrapped(data: bytes):
        msg = deserialize(data) if deserialize is not None else data
        traffic.count("received", link, len(data), msg)
        return msg

    return wrapped


class TrafficInterceptor(grpc.ServerInterceptor):
    """Counts every message a gRPC server sends and receives, at its (de)serializer."""

    def __init__(self, traffic: Traffic, sent_link: str, received_link: str):
        self.traffic = traffic
        self.sent_link = sent_link
        self.received_link = received_link
        self._handlers: dict[str, tuple[object, object]] = {}  # method -> (handler, counting handler)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not hasattr(handler, "_replace") or method.startswith("/grpc."):
            return handler  # health checks and reflection are not traffic (the checkers do not count them either)
        cached = self._handlers.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        counting = handler._replace(
            request_deserializer=_counting_deserializer(handler.request_deserializer, self.traffic, self.received_link),
            response_serializer=_counting_serializer(handler.response_serializer, self.traffic, self.sent_link),
        )
        self._handlers[method] = (handler, counting)
        return counting


class MeteredChannel(grpc.Channel):
    """A client channel whose calls count what they send and receive (the coordinator's channels to
    the target and the draft)."""

    def __init__(self, channel: grpc.Channel, traffic: Traffic, sent_link: str, received_link: str):
        self._channel = channel
        self._traffic = traffic
        self._sent = sent_link
        self._received = received_link

    def _wrap(self, factory, method, request_serializer=None, response_deserializer=None, **kwargs):
        return factory(
            method,
            request_serializer=_counting_serializer(request_serializer, self._traffic, self._sent),
            response_deserializer=_counting_deserializer(response_deserializer, self._traffic, self._received),
            **kwargs,
        )

    def unary_unary(self, method, *args, **kwargs):
        return self._wrap(self._channel.unary_unary, method, *args, **kwargs)

    def unary_stream(self, method, *args, **kwargs):
        return self._wrap(self._channel.unary_stream, method, *args, **kwargs)

    def stream_unary(self, method, *args, **kwargs):
        return self._wrap(self._channel.stream_unary, method, *args, **kwargs)

    def stream_stream(self, method, *args, **kwargs):
        return self._wrap(self._channel.stream_stream, method, *args, **kwargs)

    def subscribe(self, callback, try_to_connect=False):
        self._channel.subscribe(callback, try_to_connect)

    def unsubscribe(self, callback):
        self._channel.unsubscribe(callback)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._channel.close()
        return False
