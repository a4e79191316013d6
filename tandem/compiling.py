"""torch.compile with room for a function's many graphs (the target's buckets, the draft's Ks)."""

from __future__ import annotations

from collections.abc import Callable

import torch


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
