"""API keys on the coordinator's fronts: which key a request carries, compared in constant time, and how
many requests each key has in flight.

Every gRPC method wants `authorization: Bearer <key>` metadata except those of OPEN_SERVICES (the health
checks the kubelet and the load balancers ask without a key); the HTTP front's door is
coordinator/http/auth.py. A missing or wrong key is UNAUTHENTICATED before the handler runs; a key past
its share of requests is RESOURCE_EXHAUSTED with a `retry-after`. No torch here.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health

OPEN_SERVICES = frozenset({health.SERVICE_NAME})
RETRY_AFTER_S = 1  # what a client told "too many requests of this key" waits before it tries again


def bearer(header: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` value; None for anything else."""
    if header is None:
        return None
    scheme, _, key = header.strip().partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


class KeyRing:
    """The keys a front accepts and each one's requests in flight (at most `per_key` at once)."""

    def __init__(self, keys: Iterable[str], per_key: int):
        # digests of equal length: compare_digest then leaks neither a key's length nor where it differs
        self._digests = {hashlib.sha256(k.encode()).digest(): k for k in keys}
        self.per_key = per_key
        self._in_flight: dict[str, int] = {}
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._digests)

    def match(self, presented: str | None) -> str | None:
        """The key `presented` is, or None; every key is compared, so the time says nothing of which."""
        digest = hashlib.sha256((presented or "").encode()).digest()
        found = None
        for known, key in self._digests.items():
            if hmac.compare_digest(known, digest) and presented is not None:
                found = key
        return found

    def acquire(self, key: str) -> bool:
        with self._lock:
            if self._in_flight.get(key, 0) >= self.per_key:
                return False
            self._in_flight[key] = self._in_flight.get(key, 0) + 1
            return True

    def release(self, key: str) -> None:
        with self._lock:
            self._in_flight[key] -= 1


def key_ring(settings) -> KeyRing:
    """The coordinator's keys (CoordinatorSettings); an empty ring for a service that takes none."""
    return KeyRing(getattr(settings, "api_keys", ()), getattr(settings, "max_requests_per_key", 1))


class KeyInterceptor(grpc.ServerInterceptor):
    """Refuses every method outside OPEN_SERVICES without a known key; counts each key's calls in flight."""

    def __init__(self, keys: KeyRing):
        self.keys = keys

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        service = handler_call_details.method.lstrip("/").split("/", 1)[0]
        if handler is None or service in OPEN_SERVICES:
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        key = self.keys.match(bearer(metadata.get("authorization")))
        kind = next(k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k))
        streaming = kind.endswith("_stream")
        if key is None:
            return handler._replace(**{kind: _refused_stream if streaming else _refused})
        wrap = _held_stream if streaming else _held
        return handler._replace(**{kind: wrap(getattr(handler, kind), self.keys, key)})


def _refused(request, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required: authorization: Bearer <key>")


def _refused_stream(request, context):
    _refused(request, context)
    yield  # never reached: a generator, as grpc expects of a streaming handler


def _admit(keys: KeyRing, key: str, context) -> None:
    if not keys.acquire(key):
        context.set_trailing_metadata((("retry-after", str(RETRY_AFTER_S)),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"this API key has {keys.per_key} requests in flight (max_requests_per_key)")


def _held(behavior, keys: KeyRing, key: str):
    def held(request, context):
        _admit(keys, key, context)
        try:
            return behavior(request, context)
        finally:
            keys.release(key)

    return held


def _held_stream(behavior, keys: KeyRing, key: str):
    def held(request, context):
        _admit(keys, key, context)
        try:
            yield from behavior(request, context)  # held until the last message or the client's cancel
        finally:
            keys.release(key)

    return held
