"""A step's small host tables (positions, slots, block tables, tokens, uniforms) to the device in one copy
that leaves the host free: packed into one byte buffer, pinned where CUDA is (torch's caching host allocator
keeps a pinned block until the copy that reads it is done, so a buffer is never written under a copy), and
copied non_blocking. From pageable memory, or without non_blocking, CUDA waits for the stream before the
copy: a host sync per upload. On a CPU the same code runs, the copy a no-op."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

NUMPY = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32, torch.float64: np.float64,
         torch.bool: np.bool_}
ALIGN = 16  # every part starts at a multiple of the widest element (a byte slice views as its dtype) and of
# the 16 bytes inductor assumes of a graph's inputs


def upload(parts: Sequence[tuple[object, torch.dtype]], device: torch.device) -> list[torch.Tensor]:
    """Each (values: a list, nested lists or a numpy array; dtype) -> a tensor of its shape and dtype on
    `device`, all in one copy."""
    arrays = [np.ascontiguousarray(values, dtype=NUMPY[dtype]) for values, dtype in parts]
    offsets, size = [], 0
    for a in arrays:
        offsets.append(size)
        size += -(-a.nbytes // ALIGN) * ALIGN
    buffer = np.empty(max(size, ALIGN), dtype=np.uint8)
    for a, at in zip(arrays, offsets, strict=True):
        buffer[at : at + a.nbytes] = a.reshape(-1).view(np.uint8)
    host = torch.from_numpy(buffer)
    if device.type == "cuda":
        host = host.pin_memory()
    moved = host.to(device, non_blocking=True)
    return [moved[at : at + a.nbytes].view(dtype).view(a.shape)
            for a, at, (_, dtype) in zip(arrays, offsets, parts, strict=True)]
