"""CUDA IPC on one node: the target allocates one CUDA ring and a pool of interprocess events at the
handshake and exports them once; the draft maps them once (opening a handle is far too slow to do
per step) and keeps them.

Per step the target copies the rows into its range on a side stream, after the engine's `ready`
event (the end of the batch that computed them, not behind the forward the engine may have queued
since), and records the range's event there; the draft's side stream waits on that event (a GPU-side
wait: no CPU core spins) and copies the rows out, and the draft's own stream waits for that copy only.
A range is reused once its session is two steps on (tandem/transports/ring.py), by when the draft has
copied it.

CUDA_VISIBLE_DEVICES may number the GPUs differently in the two processes, so the ring's device
travels as its UUID and the draft finds its own index for it. The current device is per thread and
gRPC threads never set it, so every stream, event and copy here names its device.
"""

from __future__ import annotations

import contextlib
import pickle
import uuid as uuidlib

import torch
from torch.multiprocessing.reductions import reduce_tensor

from tandem.dtypes import TORCH_DTYPES
from tandem.transports.contract import TransportError, check_ref, consumer_stream, count
from tandem.transports.ring import RingSender
from tandem.v1 import common_pb2

STORAGE_DEVICE_ARG = 6  # rebuild_cuda_tensor(tensor_cls, size, stride, offset, storage_cls, dtype, storage_device, ...)


def _indexed(device: str) -> torch.device:
    """cuda -> cuda:<current>: the streams and copies below are per device index."""
    device = torch.device(device)
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


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
        self.device = _indexed(device)
        with torch.cuda.device(self.device):
            self._bytes = torch.empty(plan.ring_bytes, dtype=torch.uint8, device=self.device)  # [ring_bytes]
            self._events = [torch.cuda.Event(interprocess=True) for _ in range(plan.max_inflight)]
            for event in self._events:
                event.record(torch.cuda.current_stream(self.device))  # an event gets its CUDA handle on first use
            rebuild, args = reduce_tensor(self._bytes)
            plan.handle = pickle.dumps((rebuild, args, [e.ipc_handle() for e in self._events]))
        self._stream = torch.cuda.Stream(self.device)  # the ring's writes: never behind the engine's next forward
        plan.device_uuid = str(torch.cuda.get_device_properties(self.device).uuid)

    def _write(self, offset: int, slot: int, sequence: int, features: torch.Tensor, ready=None) -> None:
        nbytes = features.numel() * features.element_size()
        dest = self._bytes[offset : offset + nbytes].view(features.dtype).view(features.shape)
        stream = self._stream
        if ready is not None:
            stream.wait_event(ready)  # the end of the batch that computed the rows
        else:
            stream.wait_stream(torch.cuda.current_stream(features.device if features.is_cuda else self.device))
        with torch.cuda.stream(stream):
            dest.copy_(features, non_blocking=True)
            self._events[slot].record(stream)  # after the copy: what the draft's stream waits on
        if features.is_cuda:
            features.record_stream(stream)  # the engine's buffer stays until the copy has read it

    def _release_ring(self) -> None:
        torch.cuda.synchronize(self.device)
        del self._bytes


class CudaIpcReceiver:
    name = "cuda-ipc"

    def __init__(self, plan: common_pb2.TransportPlan, device: str, traffic=None):
        self.channel = plan.channel
        self.traffic = traffic
        self.device = _indexed(device)
        ring_device = _index_of(plan.device_uuid)
        rebuild, args, event_handles = pickle.loads(plan.handle)  # the plan comes from our own target's handshake
        args = list(args)
        args[STORAGE_DEVICE_ARG] = ring_device
        with torch.cuda.device(ring_device):
            self._bytes = rebuild(*args)  # [ring_bytes] on the target's GPU, mapped once
            self._events = [torch.cuda.Event.from_ipc_handle(ring_device, h) for h in event_handles]
        self.size = plan.ring_bytes
        # the copies out of the ring: a side stream on our GPU and, when the ring is on another GPU, one
        # there too (a cross-device copy runs on the source device's current stream, with barriers both ways)
        self._streams = [torch.cuda.Stream(self.device)]
        if ring_device != self.device.index:
            self._streams.append(torch.cuda.Stream(torch.device("cuda", ring_device)))

    def recv(self, ref: common_pb2.FeatureRef, consumer=None) -> torch.Tensor:
        check_ref(ref, self.channel)
        dtype = TORCH_DTYPES[ref.dtype]
        nbytes = ref.rows * ref.width * dtype.itemsize
        if ref.offset < 0 or ref.offset + nbytes > self.size or not 0 <= ref.event < len(self._events):
            raise TransportError(f"feature descriptor [{ref.offset}, +{nbytes}) event {ref.event} is outside the ring")
        consumer = consumer_stream(consumer, self.device)  # the draft engine's forward runs there
        rows = self._bytes[ref.offset : ref.offset + nbytes].view(dtype).view(ref.rows, ref.width)
        with contextlib.ExitStack() as on_side_streams:
            for stream in self._streams:
                on_side_streams.enter_context(torch.cuda.stream(stream))
            self._streams[-1].wait_event(self._events[ref.event])  # GPU-side: after the target's write
            out = torch.empty((ref.rows, ref.width), dtype=dtype, device=self.device)  # [n, 3H], ours
            out.copy_(rows)
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(self.device))  # our side stream, which waited for the copy
        consumer.wait_event(copied)  # the draft's forward waits for this copy, nothing else
        out.record_stream(consumer)  # allocated on the side stream, read on the caller's
        count(self.traffic, "received", self.name, out)
        return out

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        del self._bytes, self._events
