"""Continuous batching inside an engine: the steps of concurrent sessions share one forward pass.

Every session stream has its own service thread, which calls the engine and waits for its answer.
The Batcher turns those calls into batches: a caller queues its step; if no batch is running it
becomes the runner and takes every queued step (in arrival order, up to `max_batch` steps and
`max_tokens` new tokens) into one batch, runs it, hands each step its result and goes on while steps
are queued; the others sleep until their result is in. So sessions join and leave between forward
passes: whatever arrived while a batch ran goes into the next one (vLLM's continuous batching).

Unlike vLLM's scheduler, the engine does not make a session's next step itself: it comes back
after a round trip (coordinator, draft). Taking only what is queued the moment a batch ends would
split N sessions into ragged waves of a few steps each (measured: a mean batch of 6.8 for 16
sessions). So the runner waits for the sessions due back soon: each session's time away between
two of its steps is tracked (a moving average), and the runner waits for those of the last two
batches whose return falls within a window of `window` times the previous batch's time (at most
`max_wait`); a lone request runs at once. Sessions due later are not waited for: with drafting,
sessions split into two waves, one verifying while the other drafts, and waiting for the wave that
is away left the engine idle for a whole window per batch (measured at 4 concurrent: 10 ms waits
between 11 ms batches; EAGLE-3 went from 200-237 to 264-298 tok/s on the demo pair). The engines
`forget` a session when it is released, so that no batch waits for one that has ended.

Steps of different groups never share a batch (`submit(..., group=...)`): an engine that pads every
sequence of a batch to its longest (the draft's, transformers' target) would make a 48-token prefill among
one-token verifies 48 times wider than the verifies need (measured on the demo target at 16 sessions:
prefills took 28% of its time while they were 3% of its steps); the native target pads nothing, and puts
its prefills in the verifies' group. The batch takes the oldest step's group; the
steps it leaves run in the next batch, so neither group waits longer than one batch.

Cohorts: the steps of one batch leave together, but reach the next service one by one, spread over
milliseconds by the relays (their answers, the coordinator's threads, the next requests). Taken as
they came, a batch of ten verifies became draft batches of 2.8 on average (demo pair, 16 clients),
each paying a forward's fixed cost. So each step's answer names its batch (`clock.batch`: id, size),
the coordinator counts how many of that batch go on to the next service and tells it (`clock.cohort`:
id, size), and the runner waits for a cohort queued in part until the rest is in, or `max_wait` after
its first step came.

A step that fails (bad input) fails alone: the batch function returns an exception for it.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from tandem.sessions import InvalidRequest, SessionNotFound
from tandem.timing import StepClock, current_clock

Item = TypeVar("Item")


@dataclass
class _Job(Generic[Item]):
    item: Item
    tokens: int
    key: object  # the session: whose step comes back after its round trip
    group: object  # steps of one group may share a batch
    clock: StepClock | None
    cohort: tuple[int, int] | None  # (id, size): it came with size-1 others, worth waiting for
    gathered: bool = False  # queued with others by submit_many: nobody else is waited for
    queued_at: int = field(default_factory=time.monotonic_ns)
    result: Any = None
    done: bool = False


class Batcher(Generic[Item]):
    """`submit(item, tokens)` -> that item's result, computed in a batch with whatever else is queued.

    `run(items)` returns one result per item, or an exception instance for an item that failed.
    `beside(items)`: whether the next batch may start while this one runs (a relay's message that waits
    on a long call); default never.
    """

    def __init__(
        self, run: Callable[[list[Item]], Sequence[Any]], max_batch: int, max_tokens: int, max_wait: float = 0.01,
        window: float = 0.5, beside: Callable[[list[Item]], bool] | None = None,
    ):
        if max_batch < 1 or max_tokens < 1:
            raise ValueError(f"max_batch and max_tokens must be >= 1, got {max_batch}, {max_tokens}")
        self._run = run
        self._beside = beside
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        self.max_wait = max_wait
        self.window = window
        self._queue: list[_Job] = []
        lock = threading.Lock()
        self._changed = threading.Condition(lock)  # a batch finished: the waiting callers look
        self._arrived = threading.Condition(lock)  # a step was queued: the runner looks
        self._running = False
        self._served: dict[object, tuple[int, float]] = {}  # session -> the batch that last served it, its end
        self._away: dict[object, float] = {}  # session -> its time away between batches (moving average)
        self._away_any = 0.0  # the same over all sessions: a new session's guess
        self._last_seconds = 0.0
        self._batch_ids = itertools.count(random.getrandbits(48) << 15)  # ids for `clock.batch`
        self.batches = 0  # forward passes run, and steps in them: the mean batch size is their ratio
        self.steps = 0

    def submit(self, item: Item, tokens: int, key: object = None, group: object = None,
               cohort: tuple[int, int] | None = None) -> Any:
        """`cohort` (id, size): the step came with size-1 others (else the step's clock says, if any)."""
        clock = current_clock()
        if cohort is None and clock is not None:
            cohort = clock.cohort
        job = _Job(item, tokens, key, group, clock, cohort)
        self._wait([job])
        if isinstance(job.result, BaseException):
            raise job.result
        return job.result

    def submit_many(self, calls: Sequence[tuple[tuple, StepClock | None]], build: Callable[..., tuple[Item, int]],
                    group: object = None) -> list[Any]:
        """Steps the caller gathered (one message of the coordinator's cohort relay), `(arguments, clock)` each:
        `build(*arguments)` makes each step and its tokens, and the steps are queued at once and run without
        waiting for anyone else. A result or an exception each: a step `build` refuses (InvalidRequest,
        SessionNotFound), or a second step of one session (`arguments[0]`), fails alone."""
        results: list[Any] = []
        jobs: list[_Job] = []
        for arguments, clock in calls:
            try:
                if any(job.key == arguments[0] for job in jobs):
                    raise InvalidRequest(f"two steps of session {arguments[0]!r} in one cohort")
                item, tokens = build(*arguments)
            except (InvalidRequest, SessionNotFound) as exc:
                results.append(exc)
                continue
            jobs.append(_Job(item, tokens, arguments[0], group, clock, None, gathered=True))
            results.append(jobs[-1])
        self._wait(jobs)
        return [result.result if isinstance(result, _Job) else result for result in results]

    def _wait(self, jobs: list[_Job]) -> None:
        with self._changed:
            for job in jobs:
                if job.key in self._served and not job.gathered:
                    away = time.monotonic() - self._served[job.key][1]
                    self._away[job.key] = (self._away.get(job.key, away) + away) / 2
                    self._away_any = (self._away_any + away) / 2
                self._queue.append(job)
            self._arrived.notify()
            while not all(job.done for job in jobs):
                if not self._running and self._queue:
                    self._running = True
                    if not all(job.gathered for job in self._queue):
                        self._refill()
                    batch = self._take()
                    blocking = self._beside is None or not self._beside([job.item for job in batch])
                    if not blocking:  # the next batch need not wait for this one
                        self._running = False
                        self._changed.notify_all()
                    self._changed.release()
                    try:
                        self._run_batch(batch, timed=blocking)
                    finally:
                        self._changed.acquire()
                        if blocking:
                            self._running = False
                        self._changed.notify_all()
                else:
                    self._changed.wait()

    def _refill(self) -> None:
        """Wait (lock held) for the sessions due back within the window, and for the rest of the
        cohorts queued in part."""
        recent = self.batches - 2
        for key in [k for k, (b, _) in self._served.items() if b < recent]:
            del self._served[key]
            self._away.pop(key, None)
        window = min(self.max_wait, self.window * self._last_seconds)
        if self._beside is not None and self._beside([job.item for job in self._queue]):
            window = self.max_wait  # a long batch: worth the wait, whatever the last one took
        deadline = time.monotonic() + window
        while len(self._queue) < self.max_batch:
            queued = {job.key for job in self._queue}
            due = any(end + self._away.get(k, self._away_any) <= deadline
                      for k, (_, end) in self._served.items() if k not in queued)
            left = max(deadline - time.monotonic() if due else 0.0, self._cohort_wait())
            if left <= 0:
                return
            self._arrived.wait(left)

    def _cohort_wait(self) -> float:
        """Seconds until the last cohort queued in part stops being waited for (0: none is)."""
        seen: dict[int, list] = {}  # cohort id -> [steps queued, size, first queued_at]
        for job in self._queue:
            if job.cohort is not None:
                entry = seen.setdefault(job.cohort[0], [0, job.cohort[1], job.queued_at])
                entry[0] += 1
        ends = [first / 1e9 + self.max_wait for n, size, first in seen.values() if n < size]
        return max(ends) - time.monotonic() if ends else 0.0

    def forget(self, key: object) -> None:
        """The session ended: no batch waits for it to come back."""
        with self._arrived:
            self._away.pop(key, None)
            if self._served.pop(key, None) is not None:
                self._arrived.notify()

    def _take(self) -> list[_Job]:
        """The next batch: the oldest step's group in arrival order; a step larger than `max_tokens`
        still runs, alone."""
        group = self._queue[0].group
        batch, left, tokens = [], [], 0
        for job in self._queue:
            if job.group != group or len(batch) == self.max_batch or (batch and tokens + job.tokens > self.max_tokens):
                left.append(job)
            else:
                batch.append(job)
                tokens += job.tokens
        self._queue = left
        return batch

    def _run_batch(self, batch: list[_Job], timed: bool = True) -> None:
        """`timed`: its time sets the next wait's window (a batch run beside others does not)."""
        start = time.monotonic_ns()
        batch_id = next(self._batch_ids)
        for job in batch:  # a step's wait for its batch is queueing in its timing
            if job.clock is not None:
                job.clock.queue_ns += start - job.queued_at
                job.clock.batch = (batch_id, len(batch))
                job.clock.batch_started()
        try:
            results = self._run([job.item for job in batch])
        except Exception as exc:  # noqa: BLE001 - the whole batch failed: every step gets the error
            results = [exc] * len(batch)
        for job in batch:  # here, before the next batch: a step's compute time is its batch's
            if job.clock is not None:
                job.clock.batch_ended()
        if timed:
            self._last_seconds = (time.monotonic_ns() - start) / 1e9
        with self._changed:
            self.steps += len(batch)
            self.batches += 1
            for job in batch:
                if job.key is not None and not job.gathered:
                    self._served[job.key] = (self.batches, time.monotonic())
        for job, result in zip(batch, results, strict=True):
            job.result, job.done = result, True
