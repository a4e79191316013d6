"""What the target and draft servicers share: the engine they wrap (attached once it has loaded), its step
metrics, its feature transport, and the scheduler's stream (TargetService.Step, DraftService.Step).

A servicer method unpacks the request (tandem/convert.py), calls the engine, packs the answer; it
raises typed errors and never maps them (tandem/errors.py does, for every method).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from typing import Any, Generic, TypeVar

import grpc

from tandem.errors import Abort, status_of
from tandem.metrics import StepMetrics
from tandem.service import Service
from tandem.step_socket import TRANSPORT, StepSocket
from tandem.timing import StepClock
from tandem.traffic import SERVER_LINKS

log = logging.getLogger("tandem")

E = TypeVar("E")


class EngineServicer(Generic[E]):
    """The base of the target's and the draft's servicers: `loaded()` is the loaded engine or UNAVAILABLE."""

    WHAT = "engine"  # "target", "draft": for messages
    BATCH: Any = None  # the Step stream's request message (TargetBatch, DraftBatch)

    def __init__(self, service: Service):
        self.service = service
        self.metrics = StepMetrics(service.registry)
        self._engine: E | None = None
        self.transport = None  # the feature path between target and draft; None: inline only
        self._stepper: str | None = None  # who steps this service (one coordinator per pair), and on how many
        self._streams = 0  # streams: its next one may open while its last is ending
        self._stepper_lock = threading.Lock()
        self.local_steps: StepSocket | None = None  # the scheduler's stream over a Unix socket (tandem/step_socket.py)

    def attach(self, engine: E, transport=None) -> None:
        self._engine, self.transport = engine, transport
        if transport is not None and transport.caps.requested != "grpc" and self.local_steps is None:
            try:  # a coordinator on this host steps there
                self.local_steps = StepSocket(self.WHAT, self._serve_local)
            except OSError as exc:
                log.warning("the %s offers no step socket (%s): the coordinator's steps go over gRPC", self.WHAT, exc)
        self.metrics.count_sessions(lambda: engine.num_sessions)
        budget = getattr(engine, "kv_budget", None)
        if budget is not None:  # what the sessions hold of the KV budget (target and draft), as vLLM reports it
            self.metrics.count_kv(lambda: budget.used / budget.tokens if budget.tokens else 0.0, lambda: budget.used)

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

    def steps(self, batches: Iterator, context: grpc.ServicerContext, parse: Callable[[Any], tuple[Any, bool]],
              answer: Callable[[Sequence[tuple[Any, StepClock, Any]]], Any]) -> Iterator:
        """The scheduler's stream: each batch message runs at once, as one engine batch, answered by one
        message. `parse(step)` -> (the engine's step, whether it opens its session), or a typed error (that
        step fails alone); `answer([(step message, clock, result or error)])` -> the answer. Sessions opened
        on the stream end when a batch releases them or the stream ends (the coordinator is gone)."""
        peer = dict(context.invocation_metadata()).get("tandem-coordinator") or context.peer()
        yield from self._steps(batches, peer, parse, answer)

    def _serve_local(self, frames: Iterator[bytes], owner: str) -> Iterator[bytes]:
        """The step socket's stream: the same batches, serialized, counted as the gRPC server counts them."""
        sent, received = SERVER_LINKS[self.WHAT]
        traffic = self.service.traffic

        def batches():
            for data in frames:
                batch = self.BATCH.FromString(data)
                traffic.count("received", received, len(data), batch, TRANSPORT)
                yield batch

        for answer in self._steps(batches(), owner, self._parse, self._answer):
            data = answer.SerializeToString()
            traffic.count("sent", sent, len(data), answer, TRANSPORT)
            yield data

    def _steps(self, batches: Iterator, peer: str, parse, answer) -> Iterator:
        engine = self.loaded()
        if self.service.admission.draining:  # the sessions in flight finish on the stream already open
            raise Abort(grpc.StatusCode.UNAVAILABLE, f"the {self.WHAT} service is draining (shutting down)")
        with self._stepper_lock:
            if self._stepper is not None and self._stepper != peer:  # the same one's new stream: its last is ending
                raise Abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"this {self.WHAT} is stepped by another coordinator ({self._stepper}); one coordinator "
                            "per target/draft pair")
            self._stepper = peer
            self._streams += 1
        owned: set[str] = set()
        try:
            for batch in batches:
                for session_id in batch.release:
                    if session_id in owned:
                        owned.discard(session_id)
                        self._end(session_id)
                yield answer(self._run(engine, batch.steps, owned, parse))
        finally:
            for session_id in owned:
                self._end(session_id)
            with self._stepper_lock:
                self._streams -= 1
                if not self._streams:
                    self._stepper = None

    def _run(self, engine, messages: Sequence, owned: set[str], parse) -> list[tuple[Any, StepClock, Any]]:
        device = getattr(engine, "device", None)
        clocks = [StepClock(device) for _ in messages]
        parsed: list[tuple[int, Any]] = []
        results: list[Any] = [None] * len(messages)
        for i, message in enumerate(messages):
            try:
                step, opens = parse(message)
                if opens:  # counted while open: a drain waits for it, and max_sessions bounds them
                    self.service.admission.enter()
                    owned.add(step.session_id)
                parsed.append((i, step))
            except Exception as exc:  # noqa: BLE001 - this step fails alone, with its status
                results[i] = exc
        with ExitStack() as stack:
            for clock in clocks:
                stack.enter_context(clock.compute())
            try:
                outs = engine.run([step for _, step in parsed]) if parsed else []
            except Exception as exc:  # noqa: BLE001 - the whole batch failed: every step gets the error
                outs = [exc] * len(parsed)
        for (i, _), out in zip(parsed, outs, strict=True):
            results[i] = out
        return list(zip(messages, clocks, results, strict=True))

    def _end(self, session_id: str) -> None:
        self.loaded().release(session_id)
        if self.transport is not None and hasattr(self.transport, "release"):
            self.transport.release(session_id)
        self.service.admission.leave()

    def step_error(self, error, exc: BaseException) -> None:
        """A failed step's StepError: its status, as a stream of its own would have ended with it."""
        code, message = status_of(exc) or (grpc.StatusCode.INTERNAL, f"the {self.WHAT} failed this step")
        if code == grpc.StatusCode.INTERNAL:
            log.error("a step on the %s failed", self.WHAT, exc_info=exc)
        error.code, error.message = code.value[0], message
