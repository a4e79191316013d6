"""The cohort relay: the verifies of every generation go to the target on one stream, one message each
way per batch (TargetService.Cohort), instead of one message each way per session on its own stream.

At 16 requests a round of 16 verifies cost the target 16 messages in and 16 out, each waking a handler
thread on the target's core; the handlers took the core from the forward (demo target, compiled, 2-core
CPU: a round of 17 ms of which the batch's forward was about 7). Here the coordinator gathers the steps,
as a service's batcher would (tandem.batching.Batcher: the sessions due back soon, the rest of a cohort
queued in part), sends them as one CohortSteps and hands each generation its StepResult; the target runs
the message as one batch (Batcher.submit_many) and answers it in one CohortResults.

Each session keeps its Session stream: its prefill goes there, and the stream's end releases it. A step
that fails fails alone (its StepError); a broken relay stream fails the steps in flight (UNAVAILABLE, as a
broken session stream would) and the next batch opens a new one. Profiled requests keep their verifies on
their own streams, so that their traffic is theirs alone.
"""

from __future__ import annotations

import threading

import grpc

from coordinator.backends import BackendError, _Stream
from tandem.batching import Batcher
from tandem.dtypes import ITEMSIZE
from tandem.v1 import target_pb2, target_pb2_grpc

MAX_BATCH = 32  # the target's default --max-batch-size: a larger message runs as several batches there


class CohortRelay:
    """`verify(session_id, request)` -> the target's answer to that verify, sent with whatever other
    generations' verifies were queued meanwhile."""

    def __init__(self, stub: target_pb2_grpc.TargetServiceStub, info: target_pb2.TargetInfo, max_message_mib: int):
        row_bytes = 3 * info.hidden_size * ITEMSIZE.get(info.dtype, 4)
        # inline features come in the answer: keep a message's rows within half the message limit
        tokens = max(1, (max_message_mib << 19) // max(row_bytes, 1))
        self._stub = stub
        self._batcher: Batcher[tuple[str, target_pb2.TargetRequest]] = Batcher(self._run, MAX_BATCH, tokens)
        self._stream: _Stream | None = None
        self._lock = threading.Lock()  # the stream is opened and closed by one batch at a time

    def verify(self, session_id: str, request: target_pb2.TargetRequest,
               cohort: tuple[int, int] | None) -> target_pb2.TargetResponse:
        tokens = 1 + len(request.verify.drafts)
        result = self._batcher.submit((session_id, request), tokens, key=session_id, group="verify", cohort=cohort)
        if result.HasField("error"):
            raise BackendError("target", _code(result.error.code), result.error.message)
        return result.response

    def forget(self, session_id: str) -> None:
        """The generation ended: no batch waits for it."""
        self._batcher.forget(session_id)

    def _run(self, steps: list[tuple[str, target_pb2.TargetRequest]]) -> list:
        message = target_pb2.CohortSteps(
            steps=[target_pb2.SessionStep(session_id=sid, request=request) for sid, request in steps])
        with self._lock:
            if self._stream is None:
                self._stream = _Stream("target", self._stub.Cohort, None)
            stream = self._stream
            try:
                stream.send(message)
                answer = stream.recv()
            except BackendError as exc:  # the stream is broken: the next batch opens another
                stream.cancel()
                self._stream = None
                return [exc] * len(steps)
        if len(answer.results) != len(steps):
            return [BackendError("target", grpc.StatusCode.INTERNAL,
                                 f"the cohort relay answered {len(answer.results)} of {len(steps)} steps")] * len(steps)
        return list(answer.results)

    def close(self) -> None:
        with self._lock:
            if self._stream is not None:
                self._stream.close()
                self._stream = None


def _code(value: int) -> grpc.StatusCode:
    return next((code for code in grpc.StatusCode if code.value[0] == value), grpc.StatusCode.UNKNOWN)
