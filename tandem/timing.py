"""Per-step timing inside a service: how long a step waited for the engine, computed, and spent on
the feature codec.

    clock = StepClock(engine.device)     # when the step's request arrived
    with clock.compute():                # the engine call; its batcher charges the wait to the clock
        result = engine.verify(...)
    with clock.codec():
        chunks = encode_features(result.features)
    clock.to_pb()                        # StepTiming, stamped "sent" now

Timestamps are time.monotonic_ns(): CLOCK_MONOTONIC, one clock for every process of a host, so the
coordinator can put the steps of three processes on one timeline. On a CPU, compute is the engine
call's wall time less its wait for its batch. On a GPU it is the step's batch, measured with CUDA events
the batcher records on the engine's device as the batch starts and ends (on the thread that runs it;
the current device is per thread, so the device is named): a late kernel is not missed, the next batch
(queued before this step's thread stops its clock) is neither counted nor waited for, and no extra
synchronisation is added (the engine has synchronised by the end of its batch: it returns token ids).

The clock also carries the step's place among batches both ways between the service and the engine's
batcher: `cohort` (id, size), the cohort the step came with, and `batch` (id, size), the batch that
computed it (tandem.batching says what cohorts are for).

No torch at import: the coordinator imports the clock helpers too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tandem.v1 import profile_pb2

_current = threading.local()  # the StepClock of the step this thread is computing, if any


class StepClock:
    __slots__ = ("_cuda", "_device", "_end_event", "_start_event", "batch", "codec_ns", "cohort", "compute_ns",
                 "queue_ns", "received_ns")

    def __init__(self, device=None, request=None):
        """`request`: the step's first message; the cohort it came with, if any, goes to the batcher."""
        self.received_ns = time.monotonic_ns()
        self.queue_ns = 0
        self.compute_ns = 0
        self.codec_ns = 0
        self._cuda = getattr(device, "type", str(device or "")).startswith("cuda")
        self._device = device
        self._start_event = self._end_event = None
        self.cohort: tuple[int, int] | None = None
        if request is not None and request.HasField("cohort"):
            self.cohort = (request.cohort.id, request.cohort.size)
        self.batch: tuple[int, int] | None = None

    @contextmanager
    def compute(self) -> Iterator[None]:
        _current.clock = self
        queued = self.queue_ns
        start = time.monotonic_ns()
        try:
            yield
        finally:
            _current.clock = None
            wall = time.monotonic_ns() - start - (self.queue_ns - queued)
            if self._start_event is not None and self._end_event is not None:
                self._end_event.synchronize()  # done already: the batch ended synchronised
                self.compute_ns += int(self._start_event.elapsed_time(self._end_event) * 1e6)
            else:
                self.compute_ns += wall
            self._start_event = self._end_event = None

    @contextmanager
    def codec(self) -> Iterator[None]:
        start = time.monotonic_ns()
        try:
            yield
        finally:
            self.codec_ns += time.monotonic_ns() - start

    def batch_started(self) -> None:
        if self._cuda and self._start_event is None:
            self._start_event = self._record()

    def batch_ended(self) -> None:
        if self._start_event is not None:
            self._end_event = self._record()

    def _record(self):
        """A timing event on the engine's device's stream (not the current device of this thread)."""
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(torch.device(self._device)))
        return event

    def to_pb(self) -> profile_pb2.StepTiming:
        return profile_pb2.StepTiming(
            received_ns=self.received_ns,
            sent_ns=time.monotonic_ns(),
            queue_ns=self.queue_ns,
            compute_ns=self.compute_ns,
            codec_ns=self.codec_ns,
        )


def current_clock() -> StepClock | None:
    """The StepClock of the step this thread is computing, if any (the engines' batchers charge
    a step's wait for its batch to it as queueing)."""
    return getattr(_current, "clock", None)
