"""Typed errors -> gRPC status codes, in one table, applied by one server interceptor.

Servicer methods raise; they never map. Bad input is INVALID_ARGUMENT, a request past the context
OUT_OF_RANGE, an unknown session NOT_FOUND, overload RESOURCE_EXHAUSTED, loading or draining
UNAVAILABLE (`Abort`, from Admission). Anything unmapped is a bug: INTERNAL, and logged.
No torch here: the coordinator uses it too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import grpc
from pydantic import ValidationError

from tandem.sessions import InvalidRequest, ResourceExhausted, SessionNotFound
from tandem.transports.contract import NoChannel, TransportError
from tandem.transports.negotiate import TransportMismatch
from tandem.wire import WireError

log = logging.getLogger("tandem")

ErrorMap = Sequence[tuple[type[BaseException], grpc.StatusCode]]


class OutOfRange(ValueError):
    """A request that does not fit the model's context."""


class Abort(Exception):
    """Raised inside a handler to end the RPC with this status (kept apart from grpc's own abort)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


# Most specific first.
ERRORS: ErrorMap = (
    (OutOfRange, grpc.StatusCode.OUT_OF_RANGE),
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (WireError, grpc.StatusCode.INVALID_ARGUMENT),
    (SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    # a descriptor for a channel this draft has not opened (it restarted): the coordinator takes the
    # draft down and runs the handshake again
    (NoChannel, grpc.StatusCode.FAILED_PRECONDITION),
    (TransportMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    # a fast path that lost a step is broken: the same, through UNAVAILABLE
    (TransportError, grpc.StatusCode.UNAVAILABLE),
)
# A fast path that cannot be set up is a precondition the coordinator's handshake falls back from.
METHOD_ERRORS: dict[str, ErrorMap] = {
    "OpenTransport": ((TransportError, grpc.StatusCode.FAILED_PRECONDITION),),
    "StartTransport": ((TransportError, grpc.StatusCode.FAILED_PRECONDITION),),
}


def describe_validation(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        parts.append(f"{where + ': ' if where else ''}{err['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


def code_of(value: int) -> grpc.StatusCode:
    """The status code of its wire number (a StepError's, a step socket's error frame)."""
    return next((code for code in grpc.StatusCode if code.value[0] == value), grpc.StatusCode.UNKNOWN)


def status_of(exc: BaseException, errors: ErrorMap = ERRORS) -> tuple[grpc.StatusCode, str] | None:
    """The status a typed error maps to, with its message; None for an unmapped (internal) error."""
    if isinstance(exc, Abort):
        return exc.code, exc.message
    if isinstance(exc, ValidationError):
        return grpc.StatusCode.INVALID_ARGUMENT, describe_validation(exc)
    for kind, code in errors:
        if isinstance(exc, kind):
            return code, str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return None


@contextmanager
def errors_to_status(context: grpc.ServicerContext, errors: ErrorMap = ERRORS) -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        if _is_grpc_abort(exc):
            raise
        if not context.is_active():  # the client went away (cancel, deadline): nobody to tell, nothing to answer
            # (a unary handler that returned None here made grpc log "Exception serializing message!")
            log.debug("request ended after the client left: %s", exc)
            context.abort(grpc.StatusCode.CANCELLED, "the client left")
        status = status_of(exc, errors)
        if status is None:
            log.exception("internal error")
            status = grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
        context.abort(*status)


def _is_grpc_abort(exc: BaseException) -> bool:
    # context.abort() records the status, then raises a bare Exception() to unwind the handler
    return type(exc) is Exception and not exc.args


class StatusInterceptor(grpc.ServerInterceptor):
    """Runs every handler of a server under `errors_to_status`, with the method's own table first."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not hasattr(handler, "_replace"):
            return handler
        errors = (*METHOD_ERRORS.get(handler_call_details.method.rsplit("/", 1)[-1], ()), *ERRORS)
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_unary(handler.unary_unary, errors))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=_unary(handler.stream_unary, errors))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=_streaming(handler.unary_stream, errors))
        return handler._replace(stream_stream=_streaming(handler.stream_stream, errors))


def _unary(behavior, errors: ErrorMap):
    def mapped(request, context):
        with errors_to_status(context, errors):
            return behavior(request, context)

    return mapped


def _streaming(behavior, errors: ErrorMap):
    def mapped(request, context):
        with errors_to_status(context, errors):
            yield from behavior(request, context)

    return mapped
