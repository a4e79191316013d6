"""Static inputs per bucket, and CUDA graphs of the compiled target forward over them, one per bucket (TANDEM_CUDA_GRAPHS=1, on CUDA, with a compiled
forward): a bucket's first forward runs the compiled code and then captures it over the bucket's static
inputs (StaticInputs: the same device tensors every forward, written with one copy); every
later forward of the bucket replays the graph, one launch for its ~450 kernels. With TANDEM_COMPILE=background
that first forward is the warm-up thread's (warmup.py), before the bucket serves a request. The KV pool, preallocated
on a GPU, is written in place by the replay as by the compiled code; its size is part of the bucket.

The graphs share one memory pool, so a replay may write over the last one's outputs: the features leave
as a copy (the engine hands them to a transport that reads them later); the hidden states are read at once
(the logits' rows) before the next forward."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from tandem.compiling import capture, cuda_graphs_on
from tandem.staging import Staged

log = logging.getLogger("tandem.target")


class StaticInputs:
    """Per compiled bucket (tokens, pool rows) its inputs' device buffer; those of a smaller pool go once
    the pool grows (a CPU's: a GPU's is preallocated)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buckets: dict[tuple[int, int], Staged] = {}

    def of(self, width: int, pool) -> Staged:
        key = (width, pool.owner.shape[0])
        if key not in self.buckets:
            self.buckets = {k: v for k, v in self.buckets.items() if k[1] == key[1]}
            self.buckets[key] = Staged(self.device)
        return self.buckets[key]


def graphs_enabled(device: torch.device, compiled: bool) -> bool:
    """TANDEM_CUDA_GRAPHS=1 where the forward is compiled on CUDA (off by default until measured)."""
    return compiled and cuda_graphs_on(device)


class CudaGraphs:
    def __init__(self, forward: Callable, device: torch.device):
        self.forward, self.device = forward, device
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, key: tuple[int, int], tokens: torch.Tensor, positions: torch.Tensor, batch
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward of the bucket `key` over its static inputs -> hidden [T, H], features [T, 3H]."""
        if key in self.graphs:
            graph, (hidden, features) = self.graphs[key]
            graph.replay()
            return hidden, features.clone()
        hidden, features = self.forward(tokens, positions, batch)  # compiles the bucket where it is new
        started = time.monotonic()
        self.graphs[key] = capture(lambda: self.forward(tokens, positions, batch), self.device, self.pool)
        log.info("captured the target's forward for %d tokens over a pool of %d rows as a CUDA graph in %.1f s",
                 *key, time.monotonic() - started)
        return hidden, features
