"""A step's small host tables (positions, slots, block tables, tokens, uniforms) to the device in one copy
that leaves the host free: packed into one byte buffer, pinned where CUDA is (torch's caching host allocator
keeps a pinned block until the copy that reads it is done, so a buffer is never written under a copy), and
copied non_blocking. From pageable memory, or without non_blocking, CUDA waits for the stream before the
copy: a host sync per upload. On a CPU the same code runs, the copy a no-op.

`upload` makes new device tensors each time; a `Staged` copies into the same device buffer each time, for
inputs whose shapes are fixed (a compiled bucket's): a CUDA graph captured over them replays on new data."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import numpy as np
import torch

NUMPY = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32, torch.float64: np.float64,
         torch.bool: np.bool_}
ALIGN = 16  # every part starts at a multiple of the widest element (a byte slice views as its dtype) and of
# the 16 bytes inductor assumes of a graph's inputs


def _pack(parts: Sequence[tuple[object, torch.dtype]], device: torch.device
          ) -> tuple[torch.Tensor, list[np.ndarray], list[int]]:
    """The parts in one host byte buffer (pinned where CUDA is) -> it, the parts as arrays, their offsets."""
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
    return host, arrays, offsets


def _views(buffer: torch.Tensor, arrays: list[np.ndarray], offsets: list[int],
           parts: Sequence[tuple[object, torch.dtype]]) -> list[torch.Tensor]:
    return [buffer[at : at + a.nbytes].view(dtype).view(a.shape)
            for a, at, (_, dtype) in zip(arrays, offsets, parts, strict=True)]


def upload(parts: Sequence[tuple[object, torch.dtype]], device: torch.device) -> list[torch.Tensor]:
    """Each (values: a list, nested lists or a numpy array; dtype) -> a tensor of its shape and dtype on
    `device`, all in one copy."""
    host, arrays, offsets = _pack(parts, device)
    return _views(host.to(device, non_blocking=True), arrays, offsets, parts)


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host tensor (features that came inline) on `device`, in `dtype`, without a host sync: pinned where
    CUDA is and copied non_blocking, converted on the device. A tensor already there is only converted."""
    if t.device != device:
        if device.type == "cuda" and not t.is_pinned():
            t = t.pin_memory()
        t = t.to(device, non_blocking=True)
    return t if dtype is None else t.to(dtype)


@cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def to_host(tensors: Sequence[torch.Tensor], ready: Sequence[torch.cuda.Event | None] = ()) -> list[torch.Tensor]:
    """Device tensors (a batch's features going inline) on the host: copied into pinned memory on a side stream
    once the GPU is past `ready` (the end of the batch that computed them), so the copies do not queue behind
    the engine's next forward on its stream; this thread waits once, for these copies only. Host tensors as
    they are."""
    if not any(t.is_cuda for t in tensors):
        return list(tensors)
    device = next(t.device for t in tensors if t.is_cuda)
    stream = _side_stream(device)
    events = {id(e): e for e in ready if e is not None}.values()
    for event in events:
        stream.wait_event(event)
    if not events:
        stream.wait_stream(torch.cuda.current_stream(device))
    out = []
    with torch.cuda.stream(stream):
        for t in tensors:
            if t.is_cuda:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                t.record_stream(stream)  # the engine's buffer stays until the copy has read it
                t = host
            out.append(t)
        copied = torch.cuda.Event()
        copied.record(stream)
    copied.synchronize()
    return out


class Staged:
    """Inputs of fixed shapes in one device buffer of their own: `write` copies new values in (one copy, as
    upload's) and answers the same tensors every time."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer: torch.Tensor | None = None  # [bytes] uint8, laid out by the first write
        self.layout: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.tensors: list[torch.Tensor] = []

    def write(self, parts: Sequence[tuple[object, torch.dtype]]) -> list[torch.Tensor]:
        host, arrays, offsets = _pack(parts, self.device)
        layout = [(a.shape, dtype) for a, (_, dtype) in zip(arrays, parts, strict=True)]
        if self.buffer is None:
            self.buffer = torch.empty(host.shape, dtype=torch.uint8, device=self.device)
            self.layout, self.tensors = layout, _views(self.buffer, arrays, offsets, parts)
        elif layout != self.layout:
            raise ValueError(f"staged inputs of shapes {layout}, where this buffer holds {self.layout}")
        self.buffer.copy_(host, non_blocking=True)
        return self.tensors
