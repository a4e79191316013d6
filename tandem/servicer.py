"""What the target and draft servicers share: the engine they wrap (attached once it has loaded),
its step metrics, its feature transport, and the reaper of sessions whose client hangs.

A servicer method unpacks the request (tandem/convert.py), calls the engine, packs the answer; it
raises typed errors and never maps them (tandem/errors.py does, for every method).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any, Generic, TypeVar

import grpc

from tandem.errors import Abort, status_of
from tandem.metrics import StepMetrics
from tandem.service import Service
from tandem.timing import StepClock

log = logging.getLogger("tandem")

E = TypeVar("E")


class EngineServicer(Generic[E]):
    """The base of the target's and the draft's servicers: `engine()` is the loaded engine or UNAVAILABLE."""

    WHAT = "engine"  # "target", "draft": for messages

    def __init__(self, service: Service):
        self.service = service
        self.metrics = StepMetrics(service.registry)
        self._engine: E | None = None
        self.reaper: SessionReaper | None = None
        self.transport = None  # the feature path between target and draft; None: inline only

    def attach(self, engine: E, session_ttl: float | None = None, transport=None) -> None:
        self._engine, self.transport = engine, transport
        self.metrics.count_sessions(lambda: engine.num_sessions)
        if session_ttl is not None:
            self.reaper = SessionReaper(self.WHAT, session_ttl, engine.evict_idle)
            self.reaper.start()

    @property
    def engine(self) -> E | None:
        return self._engine

    @engine.setter
    def engine(self, engine: E) -> None:  # tests plug a fake engine in without the rest
        self._engine = engine

    def loaded(self) -> E:
        if self._engine is None:
            raise Abort(grpc.StatusCode.UNAVAILABLE, f"the {self.WHAT} service is still loading")
        return self._engine

    def session(self, session_id: str, context: grpc.ServicerContext) -> None:
        """A session now belongs to this stream: the reaper may end it when it idles too long."""
        if self.reaper is not None:
            self.reaper.register(session_id, context)

    def cohort(self, steps: Sequence, parse: Callable[[Any], tuple], run_many: Callable[[list], list]) -> list[tuple]:
        """The steps of one cohort relay message (TargetService.Cohort, DraftService.Cohort) in one engine call:
        `parse(step)` gives the engine's arguments for a step, `run_many` runs them all. A (result or error,
        clock) per step: a step that fails, in parse or in the engine, fails alone."""
        device = getattr(self.loaded(), "device", None)
        calls, placed, answers = [], [], [None] * len(steps)
        for i, step in enumerate(steps):
            clock = StepClock(device)
            try:
                calls.append((parse(step), clock))
                placed.append(i)
            except Exception as exc:  # noqa: BLE001 - this step fails alone, with its status
                answers[i] = (exc, clock)
        with ExitStack() as stack:
            for _, clock in calls:
                stack.enter_context(clock.compute())
            results = run_many(calls)
        for i, result, (_, clock) in zip(placed, results, calls, strict=True):
            answers[i] = (result, clock)
        return answers

    def step_error(self, error, exc: BaseException) -> None:
        """A failed step's StepError: its status, as the step's own stream would have ended with it."""
        code, message = status_of(exc) or (grpc.StatusCode.INTERNAL, f"the {self.WHAT} failed this step")
        if code == grpc.StatusCode.INTERNAL:
            log.error("a step of the %s's cohort relay failed", self.WHAT, exc_info=exc)
        error.code, error.message = code.value[0], message

    def session_ended(self, session_id: str) -> None:
        self.loaded().release(session_id)
        if self.reaper is not None:
            self.reaper.unregister(session_id)


def end_call(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """End an RPC with this status from outside its handler's thread (abort() only works inside it).

    grpc's Python API can only cancel a call from another thread (the client then sees CANCELLED);
    its core call can cancel with a status, which the client receives as is. Fall back to the plain
    cancel where that is not there.
    """
    try:
        context._rpc_event.call.cancel(code.value[0], message)
    except (AttributeError, TypeError, ValueError):
        context.cancel()


class SessionReaper:
    """Evicts sessions idle for longer than `ttl` seconds, and ends their streams with NOT_FOUND.

    A session lives as long as its stream, and a client that closes, cancels or loses its connection
    frees it at once; this catches the rest: a client that hangs with the stream open. The engine
    frees the KV (`evict(ttl)` returns the ids it dropped), the reaper ends the streams.
    """

    def __init__(self, what: str, ttl: float, evict: Callable[[float], list[str]]):
        self.what = what
        self.ttl = ttl
        self._evict = evict
        self._streams: dict[str, grpc.ServicerContext] = {}
        self._stop = threading.Event()

    def register(self, session_id: str, context: grpc.ServicerContext) -> None:
        self._streams[session_id] = context

    def unregister(self, session_id: str) -> None:
        self._streams.pop(session_id, None)

    def start(self) -> None:
        threading.Thread(target=self._run, name=f"tandem-{self.what}-reaper", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(min(max(self.ttl / 4, 0.05), 10.0)):
            self.sweep()

    def sweep(self) -> list[str]:
        evicted = self._evict(self.ttl)
        for session_id in evicted:
            log.warning("%s session %s idle for over %gs: evicted (--session-ttl)", self.what, session_id, self.ttl)
            context = self._streams.pop(session_id, None)
            if context is not None:
                end_call(context, grpc.StatusCode.NOT_FOUND,
                         f"{self.what} session {session_id!r} was evicted after {self.ttl:g}s idle (--session-ttl)")
        return evicted


