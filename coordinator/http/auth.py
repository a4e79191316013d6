"""The door of the HTTP front: what reaches its routes.

With API keys (tandem/auth.py) every request wants `Authorization: Bearer <key>` unless the app's own
router matches it, in full, to one of the open routes (OPEN_ROUTES; /metrics too with open_metrics).
The decision is the router's own match on the same scope the router then routes, so no spelling of a
path (`//v1/x`, `/v1/../`, `%2F`, a trailing slash) reaches a closed route, and a path no route knows
is closed too. A wrong or missing key is 401 and nothing else is done; a key past its requests in
flight is 429 with Retry-After. Bodies are bounded (413) with or without keys.
"""

from __future__ import annotations

import json
import sys

from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Match
from starlette.types import Message, Receive, Scope, Send

from coordinator.http.protocol import error_body
from tandem.auth import RETRY_AFTER_S, KeyRing, bearer

OPEN_ROUTES = ("/health",)  # the probes' and the load balancers' health check
# A request's body: a 128k-token prompt as ids in JSON is about 1 MiB; 8 MiB leaves room for messages.
MAX_BODY_BYTES = 8 << 20
# Python's JSON parser recurses once per nesting level: a body of 100k '[' was a RecursionError (500).
# Bodies nesting fewer brackets than the recursion limit cannot hit it, and are not parsed here.
DEEP_JSON = sys.getrecursionlimit() // 2


class Door:
    """ASGI middleware over the front's Starlette app."""

    def __init__(self, app: Starlette, keys: KeyRing, open_metrics: bool = False):
        self.app = app
        self.keys = keys
        paths = {*OPEN_ROUTES, *(["/metrics"] if open_metrics else [])}
        self.open = [route for route in app.routes if getattr(route, "path", None) in paths]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # the front has no websocket routes
            await send({"type": "websocket.close", "code": 1008})
            return
        key = None
        if self.keys and not self._is_open(scope):
            key = self.keys.match(bearer(_header(scope, b"authorization")))
            if key is None:
                await _error(send, 401, "AuthenticationError", "a valid API key is required: Authorization: Bearer "
                             "<key>", (b"www-authenticate", b"Bearer"))
                return
            if not self.keys.acquire(key):
                await _error(send, 429, "RateLimitError", f"this API key has {self.keys.per_key} requests in "
                             "flight (max_requests_per_key)", (b"retry-after", str(RETRY_AFTER_S).encode()))
                return
        try:
            body = await _bounded_body(scope, receive)
            if body is None:
                await _error(send, 413, "BadRequestError", f"the request body is over {MAX_BODY_BYTES} bytes")
                return
            if _too_deep(b"".join(m.get("body", b"") for m in body)):
                await _error(send, 400, "BadRequestError", "the request body nests deeper than JSON is parsed here")
                return
            await self.app(scope, _replay(body, receive), send)
        finally:
            if key is not None:
                self.keys.release(key)

    def _is_open(self, scope: Scope) -> bool:
        return any(route.matches(scope)[0] == Match.FULL for route in self.open)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _bounded_body(scope: Scope, receive: Receive) -> list[Message] | None:
    """The body's messages, read before the app runs; None once they pass MAX_BODY_BYTES."""
    length = _header(scope, b"content-length")
    if length is not None and length.strip().isdigit() and int(length) > MAX_BODY_BYTES:
        return None
    messages, size = [], 0
    while True:
        message = await receive()
        messages.append(message)
        size += len(message.get("body", b""))
        if size > MAX_BODY_BYTES:
            return None
        if message["type"] != "http.request" or not message.get("more_body", False):
            return messages


def _too_deep(body: bytes) -> bool:
    if body.count(b"[") + body.count(b"{") < DEEP_JSON:
        return False
    try:
        json.loads(body)
    except RecursionError:
        return True
    except ValueError:  # not JSON: the route says so
        return False
    return False


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """The body read already, then the connection's own messages (a disconnect while streaming)."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed


async def _error(send: Send, status: int, kind: str, message: str, *headers: tuple[bytes, bytes]) -> None:
    body = JSONResponse(error_body(status, kind, message)).body
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})
