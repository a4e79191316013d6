"""Shared memory on one host: the target creates one POSIX segment (a ring of step buffers) per
handshake, the draft maps it once; a step costs one copy in and one copy out, and no wait at all
(the rows are written before the descriptor leaves the target).

Each step's range starts with a stamp, its sequence number; the target overwrites it when it frees
the range, and the draft checks it before and after copying, so a reader that comes too late (its
session already moved on) gets an error instead of another step's rows.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from multiprocessing import resource_tracker, shared_memory

import torch

from tandem.dtypes import TORCH_DTYPES
from tandem.staging import to_host
from tandem.transports.contract import TransportError, check_ref, count
from tandem.transports.ring import RingSender
from tandem.v1 import common_pb2

log = logging.getLogger("tandem.transports")

STAMP = 256  # one Ring.ALIGN: the rows after it stay aligned


class ShmSender(RingSender):
    name = "shm"
    STAMP = STAMP

    def __init__(self, plan: common_pb2.TransportPlan, traffic=None):
        super().__init__(plan, traffic)
        free = os.statvfs("/dev/shm")
        if free.f_bavail * free.f_frsize < plan.ring_bytes:
            # tmpfs allocates lazily: a segment larger than what is left would SIGBUS on a write, not fail here
            raise TransportError(f"/dev/shm has {free.f_bavail * free.f_frsize} bytes free, the ring needs "
                                 f"{plan.ring_bytes} (enlarge /dev/shm)")
        self.segment = shared_memory.SharedMemory(create=True, size=plan.ring_bytes, name=f"tandem-{uuid.uuid4().hex[:16]}")
        plan.channel = self.channel = self.segment.name
        self._bytes = torch.frombuffer(self.segment.buf, dtype=torch.uint8)  # [ring_bytes]
        self._stamps = self._bytes.view(torch.int64)  # a stamp at offset o is _stamps[o // 8]
        self._stamps.fill_(-1)

    def _write(self, offset: int, slot: int, sequence: int, features: torch.Tensor, ready=None) -> None:
        start = offset + STAMP
        dest = self._bytes[start : start + features.numel() * features.element_size()]
        if features.is_cuda:  # a GPU engine asked for shm: read its rows on a side stream after `ready`
            (features,) = to_host([features], [ready])
        dest.view(features.dtype).view(features.shape).copy_(features)
        self._stamps[offset // 8] = sequence  # after the rows: a reader that sees the stamp sees them

    def _unstamp(self, offset: int) -> None:
        self._stamps[offset // 8] = -1

    def _release_ring(self) -> None:
        del self._bytes, self._stamps
        try:
            self.segment.close()
        except BufferError:  # a view still alive somewhere: unlink anyway, the mapping goes with the process
            pass
        self.segment.unlink()


def _attach(name: str) -> shared_memory.SharedMemory:
    """Map the target's segment without handing it to this process's resource tracker: before Python
    3.13 (track=False) an attached segment is registered too, and unlinked when the draft exits."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register


class ShmReceiver:
    name = "shm"

    def __init__(self, plan: common_pb2.TransportPlan, traffic=None):
        try:
            self.segment = _attach(plan.channel)
        except FileNotFoundError:
            raise TransportError(f"no shared memory segment {plan.channel!r} here: is the target on another host "
                                 f"or IPC namespace?") from None
        if self.segment.size < plan.ring_bytes:
            raise TransportError(f"segment {plan.channel!r} has {self.segment.size} bytes, the plan says {plan.ring_bytes}")
        self.channel = plan.channel
        self.size = plan.ring_bytes
        self.traffic = traffic
        self._bytes = torch.frombuffer(self.segment.buf, dtype=torch.uint8)
        self._stamps = self._bytes.view(torch.int64)

    def recv(self, ref: common_pb2.FeatureRef, consumer=None) -> torch.Tensor:  # host memory: no stream
        check_ref(ref, self.channel)
        dtype = TORCH_DTYPES[ref.dtype]
        nbytes = ref.rows * ref.width * dtype.itemsize
        start = ref.offset + STAMP
        if ref.offset < 0 or ref.offset % 8 or start + nbytes > self.size:
            raise TransportError(f"feature descriptor [{ref.offset}, +{nbytes}) is outside the ring")
        out = torch.empty((ref.rows, ref.width), dtype=dtype)  # [n, 3H]
        if self._stamps[ref.offset // 8] != ref.sequence:
            raise TransportError(f"shm step {ref.sequence} is gone (its session moved on)")
        out.copy_(self._bytes[start : start + nbytes].view(dtype).view(ref.rows, ref.width))
        if self._stamps[ref.offset // 8] != ref.sequence:
            raise TransportError(f"shm step {ref.sequence} was overwritten while it was read")
        count(self.traffic, "received", self.name, out)
        return out

    def close(self) -> None:
        del self._bytes, self._stamps
        try:
            self.segment.close()
        except BufferError:
            pass
