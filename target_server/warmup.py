"""Compiling the native target's forward off the requests' path (TANDEM_COMPILE=background; see
runners.compile_default for what it is worth on a CPU)."""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from target_server.paged import PagedKVPool, plan

if TYPE_CHECKING:
    from target_server.steps import Step

log = logging.getLogger("tandem.target")

# While a bucket compiles (Python, holding the GIL for seconds), the serving thread gets the GIL back after each
# op it ran without it within this many seconds rather than the default 5 ms: with the default, generations
# running beside a compile were several times slower.
SWITCH_S = 2e-4


class Compiled(Protocol):
    """What WarmUp needs of the runner whose buckets it compiles (runners.NativeRunner)."""

    device: torch.device
    buckets: set[tuple[int, int]]  # (tokens, pool rows) compiled or queued, shared with the runner
    _forward: Callable  # the compiled forward: ids, positions, batch -> hidden, features
    graphs: Callable | None  # CudaGraphs (target_server/graphs.py): per bucket, captured at its first call
    static_inputs: Callable  # a bucket's inputs in its static buffers, which a captured graph reads


class WarmUp:
    """A service's compiled buckets, compiled off the requests' path: a verify batch whose bucket (tokens, pool
    rows) has no graph yet runs eagerly (unpadded, SDPA over the pool, packed weights) and queues the bucket;
    one thread compiles the queued buckets in turn, each with a forward of padding only (the scratch block: no
    session's KV is touched), and the bucket runs compiled from its next batch. A prefill batch runs compiled
    where its bucket already is (faster than eager), and never queues one: wide, of any length, each would be a
    bucket of its own. The FIRST buckets are queued with the pool, before any request. With CUDA graphs on
    (graphs.py) the thread captures each bucket's graph too, over the bucket's static inputs, so no request
    compiles or captures."""

    # a lone request's verifies and 16 decodes, then 16 sessions' verifies of up to K=5 in cohorts of any size:
    # a bucket first met under load compiled during it, taking a core, and each compile reset the gates' speeds
    # (with the first four only, the gate shed drafting at 16 greedy requests that paid with these)
    FIRST = (2, 4, 8, 16, 32, 48, 64, 80, 96)

    def __init__(self, runner: Compiled):
        self.runner = runner
        self.compiled: set[tuple[int, int]] = set()  # (tokens, pool rows) ready to run compiled
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pending = 0  # buckets queued and not yet compiled (or failed)
        self._idle = threading.Condition()

    def ready(self, steps: list[Step], width: int, pool: PagedKVPool) -> bool:
        if (width, pool.owner.shape[0]) in self.compiled:
            return True
        if not any(step.kind == "prefill" for step in steps):
            self.queue(width, pool)
        return False

    def queue(self, width: int, pool: PagedKVPool) -> None:
        """Compile the bucket of `width` tokens over `pool` as it is now, unless it is or was queued."""
        key = (width, pool.owner.shape[0])
        if key in self.runner.buckets:
            return
        self.runner.buckets.add(key)
        with self._idle:
            self._pending += 1
        self._queue.put((key, pool))
        if self._thread is None:
            self._thread = threading.Thread(target=self._compile, name="tandem-compile", daemon=True)
            self._thread.start()

    @property
    def pending(self) -> int:
        return self._pending

    def wait(self, timeout: float | None = None) -> bool:
        """Until every bucket queued so far is compiled or failed (tests, benchmarks); False on the timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    @torch.inference_mode()
    def _compile(self) -> None:
        runner = self.runner
        while True:
            (width, rows), pool = self._queue.get()
            if pool.owner.shape[0] != rows:  # the pool grew since: that bucket is gone
                self._done()
                continue
            start, switch = time.monotonic(), sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_S)
            try:
                if runner.graphs is None:
                    positions, batch = plan([], width, pool, dense=False)
                    runner._forward(torch.zeros(width, dtype=torch.long, device=runner.device), positions, batch)
                else:  # compiled and captured here, over the bucket's static inputs: its first request replays
                    positions, batch, ids, _ = runner.static_inputs([], [], width, pool, [])
                    runner.graphs((width, rows), ids, positions, batch)
                self.compiled.add((width, rows))
                log.info("compiled the target's forward for %d tokens over a pool of %d rows in %.0f s (eager until "
                         "now)", width, rows, time.monotonic() - start)
            except Exception:  # the bucket stays eager; the service carries on
                log.exception("compiling the target's forward for %d tokens failed: that bucket runs eagerly", width)
            finally:
                sys.setswitchinterval(switch)
                self._done()

    def _done(self) -> None:
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()
