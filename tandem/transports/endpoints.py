"""Each service's end of the feature path: what it offers at the handshake, the transport in use, and
the factory that opens a plan's transport (the concrete transports are imported only here, on demand).

The coordinator drives the handshake (coordinator/handshake.py):

    target.OpenTransport(plan)   TargetTransport.open: ring / rendezvous ready, plan filled in
    draft.OpenTransport(plan)    DraftTransport.open: checks the plan against itself, attaches
    target.StartTransport(plan)  TargetTransport.start: the fast path takes over from gRPC

Until start, and whenever a fast path cannot take a step, the target sends inline.
"""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from typing import TYPE_CHECKING

from tandem.transports.caps import local_caps
from tandem.transports.contract import FeatureReceiver, FeatureSender, NoChannel, TransportError
from tandem.transports.grpc import GrpcSender
from tandem.transports.negotiate import TransportMismatch
from tandem.v1 import common_pb2

if TYPE_CHECKING:
    import torch

    from tandem.traffic import Traffic

log = logging.getLogger("tandem.transports")

# The shm / cuda-ipc ring: a 4096-token prefill of an 8B target in bf16 is 96 MiB; a step that does not fit
# (or finds the ring full) goes inline over gRPC instead of waiting, so a larger ring buys nothing but memory.
RING_BYTES = 256 << 20
# Steps outstanding at once on a fast path (ring ranges, CUDA events, nccl send queue); each session holds
# at most its last two steps, so half of this bounds sessions on the fast path (above the 64 of max_sessions).
MAX_INFLIGHT = 128
# Any wait on the fast path (rendezvous, a send, a draft waiting for a step's rows): far above a step (ms);
# a dead peer breaks the channel after it and the step goes inline.
TIMEOUT = 10.0


def _reachable(host: str) -> str:
    """An address the draft can reach us at: the bind address, unless that is every interface."""
    return socket.gethostbyname(socket.gethostname()) if host in ("", "0.0.0.0", "::", "[::]") else host


def open_sender(plan: common_pb2.TransportPlan, device: str, host: str, traffic: Traffic | None) -> FeatureSender:
    """The target's end of `plan`; fills in what the draft needs to attach (segment, address, handle)."""
    if plan.transport == "shm":
        from tandem.transports.shm import ShmSender

        return ShmSender(plan, traffic)
    if plan.transport == "cuda-ipc":
        from tandem.transports.cuda_ipc import CudaIpcSender

        return CudaIpcSender(plan, device, traffic)
    if plan.transport == "nccl":
        from tandem.transports.nccl import NcclSender

        return NcclSender(plan, device, host, traffic)
    return GrpcSender()


def open_receiver(plan: common_pb2.TransportPlan, device: str, traffic: Traffic | None) -> FeatureReceiver | None:
    """The draft's end of `plan`; None for grpc (features arrive inline)."""
    if plan.transport == "shm":
        from tandem.transports.shm import ShmReceiver

        return ShmReceiver(plan, traffic)
    if plan.transport == "cuda-ipc":
        from tandem.transports.cuda_ipc import CudaIpcReceiver

        return CudaIpcReceiver(plan, device, traffic)
    if plan.transport == "nccl":
        from tandem.transports.nccl import NcclReceiver

        return NcclReceiver(plan, device, traffic)
    return None


class TargetTransport:
    def __init__(self, requested: str, device: str, dtype: str, feature_width: int, *, host: str = "127.0.0.1",
                 ring_bytes: int = RING_BYTES, max_inflight: int = MAX_INFLIGHT, timeout: float = TIMEOUT,
                 traffic: Traffic | None = None):
        self.caps = local_caps(requested, device, dtype, feature_width)
        self.device, self.host, self.traffic = device, _reachable(host), traffic
        self.ring_bytes, self.max_inflight, self.timeout = ring_bytes, max_inflight, timeout
        self.sender = GrpcSender()  # in use: read once per step by each session thread
        self._pending: dict[str, object] = {}  # channel -> opened, not started
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.sender.name

    def open(self, plan: common_pb2.TransportPlan) -> common_pb2.TransportPlan:
        plan = common_pb2.TransportPlan(
            transport=plan.transport, reason=plan.reason, dtype=self.caps.dtype, feature_width=self.caps.feature_width,
            ring_bytes=self.ring_bytes, max_inflight=self.max_inflight, timeout=self.timeout,
            channel=uuid.uuid4().hex,
        )
        sender = None
        if plan.transport != "grpc":
            sender = open_sender(plan, self.device, self.host, self.traffic)  # may rename the channel (shm)
        with self._lock:
            stale, self._pending = list(self._pending.values()), ({plan.channel: sender} if sender else {})
        for old in stale:  # an earlier plan of this handshake that never started (its ring would leak)
            old.close()
        if sender is None:
            return plan
        log.info("feature transport %s opened (channel %s): %s", plan.transport, plan.channel, plan.reason)
        return plan

    def start(self, plan: common_pb2.TransportPlan) -> None:
        """The draft attached (or the plan is grpc): switch to the plan's transport."""
        if plan.transport == "grpc":
            new = GrpcSender()
        else:
            with self._lock:
                new = self._pending.pop(plan.channel, None)
            if new is None:
                raise TransportError(f"no {plan.transport} channel {plan.channel!r} was opened here")
            try:
                new.start(self.timeout)
            except TransportError:
                new.close()
                raise
        old, self.sender = self.sender, new
        old.close()
        log.info("features go over %s to the draft (%s)", plan.transport, plan.reason or "requested")

    def send(self, session_id: str, features: torch.Tensor, ready=None) -> common_pb2.FeatureRef | None:
        return self.sender.send(session_id, features, ready)

    def release(self, session_id: str) -> None:
        self.sender.release(session_id)

    def close(self) -> None:
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for sender in [*pending, self.sender]:
            sender.close()


class DraftTransport:
    def __init__(self, requested: str, device: str, dtype: str, feature_width: int, traffic: Traffic | None = None):
        self.caps = local_caps(requested, device, dtype, feature_width)
        self.device, self.traffic = device, traffic
        self.receiver: FeatureReceiver | None = None

    @property
    def name(self) -> str:
        return self.receiver.name if self.receiver is not None else "grpc"

    def check(self, plan: common_pb2.TransportPlan) -> None:
        """TransportMismatch naming the first field of the plan this draft cannot take."""
        if plan.dtype != self.caps.dtype:
            raise TransportMismatch(f"transport handshake: feature dtype differs: the target sends {plan.dtype}, "
                                    f"the draft expects {self.caps.dtype}")
        if plan.feature_width != self.caps.feature_width:
            raise TransportMismatch(f"transport handshake: feature width differs: the target sends "
                                    f"{plan.feature_width}, the draft expects {self.caps.feature_width}")
        if plan.transport not in self.caps.available:
            raise TransportMismatch(f"transport handshake: transport {plan.transport} is not available on the draft "
                                    f"(it has {', '.join(self.caps.available)})")
        if plan.transport != "grpc" and self.caps.requested not in ("auto", plan.transport):
            raise TransportMismatch(f"transport handshake: transport differs: the plan is {plan.transport}, "
                                    f"the draft is set to {self.caps.requested}")

    def open(self, plan: common_pb2.TransportPlan) -> None:
        self.check(plan)
        receiver = open_receiver(plan, self.device, self.traffic)
        old, self.receiver = self.receiver, receiver
        if old is not None:
            old.close()
        log.info("features come over %s from the target (%s)", plan.transport, plan.reason or "requested")

    def recv(self, ref: common_pb2.FeatureRef, rows: int, width: int, consumer=None) -> torch.Tensor:
        """The step's features [rows, width] from the fast path, ready for `consumer` (the CUDA stream the
        draft's forward runs on; None: this thread's current one); NoChannel when it is not the one open here."""
        receiver = self.receiver
        if receiver is None or ref.transport != receiver.name:
            raise NoChannel(f"a {ref.transport} feature descriptor, but this draft has "
                            f"{receiver.name + ' channel ' + receiver.channel if receiver else 'no fast path'} open")
        if (ref.rows, ref.width) != (rows, width):
            raise TransportError(f"features [{ref.rows}, {ref.width}] do not fit a step of {rows} tokens x {width}")
        return receiver.recv(ref, consumer)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
