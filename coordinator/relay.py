"""The cohort relay: the verifies of every generation go to the target on one stream, and their proposes to
the draft on another, one message each way per batch (TargetService.Cohort, DraftService.Cohort), instead
of one message each way per session on its own stream.

At 16 requests a round of 16 verifies cost the target 16 messages in and 16 out, each waking a handler
thread on the target's core; the handlers took the core from the forward (demo target, compiled, 2-core
CPU: a round of 17 ms of which the batch's forward was about 7). Here the coordinator gathers the steps,
as a service's batcher would (tandem.batching.Batcher: the sessions due back soon, the rest of a cohort
queued in part), sends them as one message and hands each generation its result; the service runs the
message as one batch (Batcher.submit_many) and answers it in one message.

Each session keeps its Session streams: its prefill and its first propose (the prompt's features, in
chunks) go there, and so do trees, ahead steps and a profiled request's steps; the streams' end releases
the sessions. A message of target-only decodes waits on the target until they answer (50 ms, or the Verify's
answer_within_ms; target_server/decode.py), so it does not hold back the next message: that one goes beside it
on a stream of its own (a generation just prefilled had waited up to 50 ms to start decoding), and its decodes
join the target's steps already running (DecodeLoop.cohort). Traced in the target under 16 closed-loop
target-only clients (demo pair, compiled): batches of all 16 went from 67% of its forwards to 80% (the rest
had alternated 11 and 5, or 1s and 2s); throughput, old and new serves alternated twice in one window,
1456-1941 against 1634-1709 tokens/s: within this machine's noise, with less spread.

A step that fails fails alone (its StepError); a broken relay stream fails the steps in
flight (as a broken session stream would) and the next batch opens a new one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc

from coordinator.backends import BackendError, _Stream
from tandem.batching import Batcher
from tandem.dtypes import ITEMSIZE
from tandem.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

MAX_BATCH = 32  # the services' default --max-batch-size: a larger message runs as several batches there


class CohortRelay:
    """`step(session_id, request, tokens, cohort)` -> the service's answer to that step, sent with whatever
    other generations' steps were queued meanwhile."""

    def __init__(self, service: str, method: Callable, pack: Callable[[list], object], row_bytes: int,
                 max_message_mib: int, step_timeout: float | None = None,
                 long: Callable[[object], bool] | None = None):
        # inline features come in the messages: keep a message's rows within half the message limit
        tokens = max(1, (max_message_mib << 19) // max(row_bytes, 1))
        self.service = service
        self._method = method
        self._pack = pack  # [(session id, request)] -> the message
        self._step_timeout = step_timeout
        beside = None
        if long is not None:  # a message with a long step in it lets the next one go meanwhile
            beside = lambda steps: any(long(request) for _, request in steps)
        self._batcher: Batcher[tuple[str, object]] = Batcher(self._run, MAX_BATCH, tokens, beside=beside)
        self._idle: list[_Stream] = []  # open streams no message is on: one per message in flight at most
        self._lock = threading.Lock()
        self._closed = False

    def step(self, session_id: str, request, tokens: int, cohort: tuple[int, int] | None):
        result = self._batcher.submit((session_id, request), tokens, key=session_id, group="step", cohort=cohort)
        if result.HasField("error"):
            raise BackendError(self.service, _code(result.error.code), result.error.message)
        return result.response

    def forget(self, session_id: str) -> None:
        """The generation ended: no batch waits for it."""
        self._batcher.forget(session_id)

    def _run(self, steps: list[tuple[str, object]]) -> list:
        message = self._pack(steps)
        with self._lock:
            stream = self._idle.pop() if self._idle else None
        if stream is None:
            stream = _Stream(self.service, self._method, None)
        try:
            stream.send(message)
            answer = stream.recv(self._step_timeout)
        except BackendError as exc:  # the stream is broken: the next batch opens another
            stream.cancel()
            return [exc] * len(steps)
        with self._lock:
            closed = self._closed
            if not closed:
                self._idle.append(stream)
        if closed:
            stream.close()
        if len(answer.results) != len(steps):
            return [BackendError(self.service, grpc.StatusCode.INTERNAL,
                                 f"the cohort relay answered {len(answer.results)} of {len(steps)} steps")] * len(steps)
        return list(answer.results)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            streams, self._idle = self._idle, []
        for stream in streams:
            stream.close()


def target_relay(stub: target_pb2_grpc.TargetServiceStub, info: target_pb2.TargetInfo,
                 max_message_mib: int) -> CohortRelay:
    def pack(steps: list) -> target_pb2.CohortSteps:
        return target_pb2.CohortSteps(steps=[target_pb2.SessionStep(session_id=sid, request=r) for sid, r in steps])

    row_bytes = 3 * info.hidden_size * ITEMSIZE.get(info.dtype, 4)
    return CohortRelay("target", stub.Cohort, pack, row_bytes, max_message_mib,
                       long=lambda request: request.verify.decode > 1)


def draft_relay(stub: draft_pb2_grpc.DraftServiceStub, info: draft_pb2.DraftInfo, max_message_mib: int,
                step_timeout: float | None) -> CohortRelay:
    def pack(steps: list) -> draft_pb2.DraftCohortSteps:
        return draft_pb2.DraftCohortSteps(steps=[draft_pb2.DraftSessionStep(session_id=sid, request=r)
                                                 for sid, r in steps])

    row_bytes = 3 * info.target_hidden_size * ITEMSIZE.get(info.dtype, 4)
    return CohortRelay("draft", stub.Cohort, pack, row_bytes, max_message_mib, step_timeout)


def _code(value: int) -> grpc.StatusCode:
    return next((code for code in grpc.StatusCode if code.value[0] == value), grpc.StatusCode.UNKNOWN)
