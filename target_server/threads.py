"""A CPU target's forwards borrowing the draft's CPUs where that measures faster.

`tandem serve` on a CPU splits the cores: the target on half, the draft and the coordinator on the rest,
as two devices would hold them (tandem_tools/serve.py:split_cpus). The target's model then runs on one
thread per CPU of its own. A forward heavy enough to be bound by its matmuls (SmolLM2-135M's, decodes
included: memory-bound, two cores draw more bandwidth) runs faster over every CPU, while the demo target's
small ones hardly do, and a thread woken for each of its ~60 matmuls costs a drafting round more than it
gives (two threads for every forward slowed target-only at one request too). So each width class of
forward (its tokens to a power of two) is timed both ways, alternately, and borrows the CPUs only where that
was faster by GAIN (deciding after EARLY forwards each way where the two ways did not overlap); the choice is
measured again every REVISIT forwards of the class, since what the draft's CPU is doing meanwhile changes
with the load.

OpenMP's workers are started by the thread that runs the forward (a batch runs on whichever handler thread
leads it) and inherit its affinity: that thread's first borrowing forward runs on every
CPU, so that its workers may run on the borrowed ones; then it is back on its own, and its workers, on every
CPU, at the lowest priority (WORKER_NICE), so that they take only the time the draft and the coordinator leave.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from target_server.steps import Step

log = logging.getLogger("tandem.target")

T = TypeVar("T")

EXPLORE = 6  # forwards timed each way before a class chooses...
EARLY = 3  # ...or this many, where every one of either way was faster than all of the other (5% by chance):
# a class of big prefills meets a forward in each wave of requests, and explores for 12 waves otherwise
GAIN = 0.95  # borrow only where the median forward is at least 5% faster
REVISIT = 2000  # forwards of a class between measurements
WORKER_NICE = 19  # a borrowing worker runs where the CPU's owners leave it time


class _WidthClass:
    """One width class's timings and choice."""

    def __init__(self):
        self.samples: dict[bool, list[float]] = {False: [], True: []}
        self.wide: bool | None = None  # None: measuring
        self.chosen: bool | None = None  # the last choice made
        self.since = 0  # forwards since the choice

    def next_wide(self) -> bool:
        if self.wide is not None:
            self.since += 1
            if self.since < REVISIT:
                return self.wide
            self.samples = {False: [], True: []}
            self.wide, self.since = None, 0
        return len(self.samples[True]) < len(self.samples[False])  # alternate, own CPUs first

    def record(self, wide: bool, seconds: float) -> tuple[float, float] | None:
        """Count a timed forward; the two medians once the class chose (EXPLORE each way, or EARLY) and the
        choice changed."""
        if self.wide is not None:
            return None
        self.samples[wide].append(seconds)
        own, borrowed = self.samples[False], self.samples[True]
        counted = min(len(own), len(borrowed))
        apart = counted >= EARLY and (max(borrowed) < GAIN * min(own) or min(borrowed) > max(own))
        if counted < EXPLORE and not apart:
            return None
        medians = statistics.median(own), statistics.median(borrowed)
        self.wide = medians[1] < GAIN * medians[0]
        changed, self.chosen = self.wide != self.chosen, self.wide
        return medians if changed else None


def thread_invariant(model: torch.nn.Module) -> str | None:
    """Why `model`'s forward could change with its thread count, or None: every product of its runs over
    oneDNN's packed weights (tandem/packed.py), whose results were the same bit for bit at 1 and 2 threads
    (110 shapes of 1-200 rows), as were SmolLM2-135M's logits through prefills and verifies; aten's GEMM
    over 6 rows (a K=5 verify) differs in the last bit with 2 threads, enough to turn a near tie."""
    plain = sum(type(module) is torch.nn.Linear for module in model.modules())
    return f"{plain} of its linear layers are not packed" if plain else None


def _tasks() -> set[int]:
    return {int(task) for task in os.listdir("/proc/self/task")}


class ThreadBurst:
    """Runs a forward on `cpus` with a thread each where that measures faster than on the caller's own CPUs;
    with no `cpus`, on the caller's own as it is."""

    def __init__(self, cpus: frozenset[int] | None = None):
        self.cpus = frozenset(cpus) | frozenset(os.sched_getaffinity(0)) if cpus else None
        if self.cpus is not None:
            own = os.sched_getaffinity(0)
            try:  # the CPUs this process was pinned away from (tandem serve splits them) it may still widen to
                os.sched_setaffinity(0, self.cpus)
            except OSError as exc:
                log.warning("the target's forwards keep to CPUs %s: it may not run on %s (%s)", sorted(own),
                            sorted(self.cpus), exc)
                self.cpus = None
            finally:
                os.sched_setaffinity(0, own)
        self.threads = len(self.cpus) if self.cpus else 0
        self._classes: dict[int, _WidthClass] = {}
        self._lock = threading.Lock()
        self._masters: set[int] = set()  # threads whose OpenMP workers were started on every CPU
        self._workers: set[int] = set()  # those workers, yielding to the CPUs' owners

    def _yield_workers(self, started: set[int]) -> None:
        """The threads `started` on every CPU, OpenMP's workers, get the lowest priority: the draft and the
        coordinator own the CPUs they borrow and come first there (with workers at full priority beside them,
        a busy SmolLM2 target's health checks went unanswered long enough for the coordinator to take it
        down)."""
        for tid in started:
            try:
                if os.sched_getaffinity(tid) == self.cpus:
                    os.setpriority(os.PRIO_PROCESS, tid, WORKER_NICE)
                    self._workers.add(tid)
            except OSError:  # a thread that ended meanwhile
                pass

    def wide_classes(self) -> list[int]:
        """The width classes (tokens up to 2^k) now borrowing the CPUs."""
        return sorted(1 << (k - 1) for k, c in self._classes.items() if c.wide)

    def run(self, steps: Sequence[Step], forward: Callable[..., T], *args) -> T:
        """`forward(steps, *args)`, timed by the steps' new tokens' width class."""
        if self.cpus is None or self.threads <= torch.get_num_threads():
            return forward(steps, *args)
        key = max(1, sum(len(step.ids) for step in steps)).bit_length()
        with self._lock:
            width = self._classes.setdefault(key, _WidthClass())
            wide = width.next_wide()
        master = threading.get_native_id()
        first = wide and master not in self._masters
        if wide:
            threads = torch.get_num_threads()
            if first:  # the workers OpenMP starts for this thread now inherit the wider affinity
                own, before = os.sched_getaffinity(0), _tasks()
                os.sched_setaffinity(0, self.cpus)
            torch.set_num_threads(self.threads)
        start = time.perf_counter()
        try:
            return forward(steps, *args)
        finally:
            seconds = time.perf_counter() - start
            if wide:
                torch.set_num_threads(threads)
            if first:
                os.sched_setaffinity(0, own)
                self._masters.add(master)
                self._yield_workers(_tasks() - before)
            with self._lock:
                medians = width.record(wide, seconds)
            if medians is not None:
                log.info("forwards of up to %d tokens: %.2f ms on the target's CPUs, %.2f ms on %d CPUs: %s",
                         1 << (key - 1), medians[0] * 1e3, medians[1] * 1e3, self.threads,
                         "borrowing the draft's" if width.wide else "keeping to its own")
