"""Per-step timing inside a service: how long a step computed, and spent on the feature codec.

    clock = StepClock(engine.device)     # when the step's batch arrived
    with clock.compute():                # the engine's batch (every step of a batch shares its time)
        results = engine.run(steps)
    with clock.codec():
        chunk = encode_features(result.features)
    clock.to_pb()                        # StepTiming, stamped "sent" now

Timestamps are time.monotonic_ns(): CLOCK_MONOTONIC, one clock for every process of a host, so the
coordinator can put the steps of three processes on one timeline. On a CPU, compute is the batch's wall
time. On a GPU it is measured with CUDA events recorded on the engine's device (named: the current device
is per thread) as the batch starts and ends, read once the batch has returned its tokens (synchronised by
then). queue_ns stays 0: a step runs in the batch it came in.

No torch at import: the coordinator imports the clock helpers too.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from tandem.v1 import profile_pb2


class StepClock:
    __slots__ = ("_cuda", "_device", "_end_event", "_start_event", "codec_ns", "compute_ns", "queue_ns",
                 "received_ns")

    def __init__(self, device=None):
        self.received_ns = time.monotonic_ns()
        self.queue_ns = 0
        self.compute_ns = 0
        self.codec_ns = 0
        self._cuda = getattr(device, "type", str(device or "")).startswith("cuda")
        self._device = device
        self._start_event = self._end_event = None

    @contextmanager
    def compute(self) -> Iterator[None]:
        queued = self.queue_ns
        start = time.monotonic_ns()
        if self._cuda:
            self._start_event = self._record()
        try:
            yield
        finally:
            if self._start_event is not None:
                self._end_event = self._record()
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
