"""The memory the target and the draft size their KV budgets from: a GPU the two share, split between them
by a named rule rather than raced for, and the host's memory for a service on the CPU.

Each process of a pair on one GPU reads `torch.cuda.mem_get_info` once it has loaded. Without a split the
first to read it counted the other's memory as free (its weights not loaded yet, its KV not grown yet):
the target's pool took it, and the draft ran out later. With one, each counts only its part of the GPU's
total, less what it holds itself, whichever starts first. No torch here: the figures are passed in.
"""

from __future__ import annotations

import re
from typing import Literal

# The draft's part of a GPU it shares with the target. An 8B Llama pair on an 80 GiB GPU: the head with the
# target's embeddings (~2 GiB in bf16), the 5% margin each process keeps back, and draft KV (one layer
# against the target's 32) for about as many tokens as the target's pool then holds.
DRAFT_GPU_SHARE = 0.125

GPU_MARGIN = 0.05  # of a GPU's total, kept back by each service: the CUDA context, NCCL's buffers, fragmentation
GIB = 1 << 30

Service = Literal["target", "draft"]
OTHER = {"target": "draft", "draft": "target"}


def shares_gpu(target_device: str, draft_device: str) -> bool:
    """Whether two device names are one GPU ("cuda" is the first GPU both processes see: `tandem serve`'s
    children see the same ones)."""
    def index(device: str) -> int | None:
        match = re.fullmatch(r"cuda(?::(\d+))?", device)
        return None if match is None else int(match[1] or 0)

    target, draft = index(target_device), index(draft_device)
    return target is not None and target == draft


def gpu_part(service: Service, shared: bool) -> float:
    """The fraction of its GPU's total memory a service may take: all of it alone; DRAFT_GPU_SHARE for the
    draft and the rest for the target on a GPU they share."""
    if not shared:
        return 1.0
    return DRAFT_GPU_SHARE if service == "draft" else 1.0 - DRAFT_GPU_SHARE


def gpu_headroom(free: int, total: int, own: int, part: float = 1.0) -> int:
    """The bytes a service may still take on its GPU: its `part` of `total` less what it holds already
    (`own`: its weights and buffers), and never more than is `free` now. Alone (part 1) that is what is free."""
    if part >= 1.0:
        return max(free, 0)
    return max(min(free, int(part * total) - own), 0)


def asked_tokens(kv_cache_gib: float | None, bytes_per_token: int) -> int | None:
    """A --kv-cache-gib setting in KV tokens (None: unset)."""
    return None if kv_cache_gib is None else int(kv_cache_gib * GIB) // bytes_per_token


def room(service: Service, free: int, total: int, own: int, shared: bool) -> str:
    """Where a service's KV had to fit, for a start-up refusal: its part of a GPU it shares, or what was free."""
    if not shared:
        return f"{free / GIB:.2f} GiB free after loading"
    part = gpu_part(service, True)
    return (f"its {part:.1%} of the GPU it shares with the {OTHER[service]}, {part * total / GIB:.2f} GiB, less the "
            f"{own / GIB:.2f} GiB it holds")


def half_the_host(bytes_per_token: int) -> int | None:
    """The KV tokens of a service on the CPU: half the host's available memory (MemAvailable), None where
    /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            available = next(line for line in meminfo if line.startswith("MemAvailable:"))
        return int(available.split()[1]) * 1024 // 2 // bytes_per_token
    except (OSError, StopIteration):
        return None
