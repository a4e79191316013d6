"""torch.compile with room for a function's many graphs (the target's buckets, the draft's Ks), and CUDA graph
capture (the target's compiled buckets, the draft's rollouts)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def compile_graphs(fn: Callable, recompile_limit: int, **kwargs) -> Callable:
    """torch.compile(fn, **kwargs) allowed `recompile_limit` graphs, past dynamo's default of 8 a function. The
    limit is the compile's own where torch takes it (dynamo's config is per thread, and the thread that calls
    the graphs may not be this one); older torch (2.11, the CUDA images') takes no such argument, and gets
    dynamo's global setting raised."""
    try:
        return torch.compile(fn, recompile_limit=recompile_limit, **kwargs)
    except TypeError:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, recompile_limit)
        return torch.compile(fn, **kwargs)


def cuda_graphs_on(device: torch.device) -> bool:
    """TANDEM_CUDA_GRAPHS=1 on a CUDA device (off by default until measured on one)."""
    return device.type == "cuda" and os.environ.get("TANDEM_CUDA_GRAPHS", "0") == "1"


def capture(call: Callable[[], T], device: torch.device, pool) -> tuple[torch.cuda.CUDAGraph, T]:
    """`call`, whose inputs are static (the same device memory at every replay), run once on a side stream (capture
    wants a warm run off the capturing stream) and captured as a CUDA graph in the memory pool `pool` -> the
    graph and the outputs its replays write. Capture runs nothing: the first results come from a replay."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        call()
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: a background compile thread may launch on the device meanwhile
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        outputs = call()
    return graph, outputs
