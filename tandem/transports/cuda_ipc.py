"""CUDA IPC on one node: the target allocates one CUDA ring and a pool of interprocess events at the
handshake and exports them once; the draft maps them once (opening a handle costs ~1 ms, far too
much per step) and keeps them.

Per step the target copies the rows into its range on its current stream and records the range's
event; the draft's stream waits on that event (a GPU-side wait: no CPU core spins) and copies the
rows out, so the range can be reused once the session moves on.

CUDA_VISIBLE_DEVICES may number the GPUs differently in the two processes, so the ring's device
travels as its UUID and the draft finds its own index for it.
"""

from __future__ import annotations

import pickle
import uuid as uuidlib

import torch
from torch.multiprocessing.reductions import reduce_tensor

from tandem.dtypes import TORCH_DTYPES
from tandem.transports.contract import TransportError, check_ref, count
from tandem.transports.ring import RingSender
from tandem.v1 import common_pb2

STORAGE_DEVICE_ARG = 6  # rebuild_cuda_tensor(tensor_cls, size, stride, offset, storage_cls, dtype, storage_device, ...)


def _index_of(device_uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == device_uuid:
            return i
    raise TransportError(f"GPU {device_uuid} (the target's feature ring) is not visible to this process")


class CudaIpcSender(RingSender):
    name = "cuda-ipc"

    def __init__(self, plan: common_pb2.TransportPlan, device: str, traffic=None):
        plan.channel = plan.channel or uuidlib.uuid4().hex
        super().__init__(plan, traffic)
        self.device = torch.device(device)
        with torch.cuda.device(self.device):
            self._bytes = torch.empty(plan.ring_bytes, dtype=torch.uint8, device=self.device)  # [ring_bytes]
            self._events = [torch.cuda.Event(interprocess=True) for _ in range(plan.max_inflight)]
            for event in self._events:
                event.record()  # an event gets its CUDA handle on first use
            rebuild, args = reduce_tensor(self._bytes)
            plan.handle = pickle.dumps((rebuild, args, [e.ipc_handle() for e in self._events]))
        plan.device_uuid = str(torch.cuda.get_device_properties(self.device).uuid)

    def _write(self, offset: int, slot: int, sequence: int, features: torch.Tensor) -> None:
        nbytes = features.numel() * features.element_size()
        dest = self._bytes[offset : offset + nbytes].view(features.dtype).view(features.shape)
        dest.copy_(features, non_blocking=True)
        self._events[slot].record()  # on the current stream, after the copy

    def _release_ring(self) -> None:
        torch.cuda.synchronize(self.device)
        del self._bytes


class CudaIpcReceiver:
    name = "cuda-ipc"

    def __init__(self, plan: common_pb2.TransportPlan, device: str, traffic=None):
        self.channel = plan.channel
        self.traffic = traffic
        self.device = torch.device(device)
        ring_device = _index_of(plan.device_uuid)
        rebuild, args, event_handles = pickle.loads(plan.handle)  # the plan comes from our own target's handshake
        args = list(args)
        args[STORAGE_DEVICE_ARG] = ring_device
        with torch.cuda.device(ring_device):
            self._bytes = rebuild(*args)  # [ring_bytes] on the target's GPU, mapped once
            self._events = [torch.cuda.Event.from_ipc_handle(ring_device, h) for h in event_handles]
        self.size = plan.ring_bytes

    def recv(self, ref: common_pb2.FeatureRef) -> torch.Tensor:
        check_ref(ref, self.channel)
        dtype = TORCH_DTYPES[ref.dtype]
        nbytes = ref.rows * ref.width * dtype.itemsize
        if ref.offset < 0 or ref.offset + nbytes > self.size or not 0 <= ref.event < len(self._events):
            raise TransportError(f"feature descriptor [{ref.offset}, +{nbytes}) event {ref.event} is outside the ring")
        for device in {self.device, self._bytes.device}:  # a cross-device copy orders on both current streams
            # GPU-side: the copy below starts after the target's write
            torch.cuda.current_stream(device).wait_event(self._events[ref.event])
        rows = self._bytes[ref.offset : ref.offset + nbytes].view(dtype).view(ref.rows, ref.width)
        out = rows.to(self.device, copy=True)  # [n, 3H], ours: the range is reused after this step
        count(self.traffic, "received", self.name, out)
        return out

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        del self._bytes, self._events
