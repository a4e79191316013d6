"""Continuous batching inside an engine: the steps of concurrent sessions share one forward pass.

Every session stream has its own service thread, which calls the engine and waits for its answer.
The Batcher turns those calls into batches: a caller queues its step; if no batch is running it
becomes the runner and takes every queued step (in arrival order, up to `max_batch` steps and
`max_tokens` new tokens) into one batch, runs it, hands each step its result and goes on while steps
are queued; the others sleep until their result is in. So sessions join and leave between forward
passes: whatever arrived while a batch ran goes into the next one (vLLM's continuous batching),
and a lone request runs at once, with no waiting window.

A step that fails (bad input) fails alone: the batch function returns an exception for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from tandem.timing import StepClock, current_clock

Item = TypeVar("Item")


@dataclass
class _Job(Generic[Item]):
    item: Item
    tokens: int
    clock: StepClock | None
    queued_at: int = field(default_factory=time.monotonic_ns)
    result: Any = None
    done: bool = False


class Batcher(Generic[Item]):
    """`submit(item, tokens)` -> that item's result, computed in a batch with whatever else is queued.

    `run(items)` returns one result per item, or an exception instance for an item that failed.
    """

    def __init__(self, run: Callable[[list[Item]], Sequence[Any]], max_batch: int, max_tokens: int):
        if max_batch < 1 or max_tokens < 1:
            raise ValueError(f"max_batch and max_tokens must be >= 1, got {max_batch}, {max_tokens}")
        self._run = run
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        self._queue: list[_Job] = []
        self._changed = threading.Condition()
        self._running = False
        self.batches = 0  # forward passes run, and steps in them: the mean batch size is their ratio
        self.steps = 0

    def submit(self, item: Item, tokens: int) -> Any:
        job = _Job(item, tokens, current_clock())
        with self._changed:
            self._queue.append(job)
            while not job.done:
                if not self._running and self._queue:
                    batch = self._take()
                    self._running = True
                    self._changed.release()
                    try:
                        self._run_batch(batch)
                    finally:
                        self._changed.acquire()
                        self._running = False
                        self._changed.notify_all()
                else:
                    self._changed.wait()
        if isinstance(job.result, BaseException):
            raise job.result
        return job.result

    def _take(self) -> list[_Job]:
        """The next batch, in arrival order; a step larger than `max_tokens` still runs, alone."""
        batch, tokens = [], 0
        while self._queue and len(batch) < self.max_batch:
            if batch and tokens + self._queue[0].tokens > self.max_tokens:
                break
            job = self._queue.pop(0)
            batch.append(job)
            tokens += job.tokens
        return batch

    def _run_batch(self, batch: list[_Job]) -> None:
        start = time.monotonic_ns()
        for job in batch:  # a step's wait for its batch is queueing in its timing
            if job.clock is not None:
                job.clock.queue_ns += start - job.queued_at
                job.clock.batch_started()
        try:
            results = self._run([job.item for job in batch])
        except Exception as exc:  # noqa: BLE001 - the whole batch failed: every step gets the error
            results = [exc] * len(batch)
        self.batches += 1
        self.steps += len(batch)
        for job, result in zip(batch, results, strict=True):
            job.result, job.done = result, True
