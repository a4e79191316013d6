"""Point-to-point over a two-rank torch.distributed group: target = rank 0, draft = rank 1.

NCCL for CUDA tensors (any two GPUs, same node or not; not two ranks on one GPU), gloo for CPU
tensors (the same code, so the tests run it). The group is built on its own TCPStore per handshake,
outside torch.distributed's default group, so that a new handshake (a restarted draft) can build
another.

Point-to-point ops match in order, not by tag, and many sessions send at once, so exactly one
thread sends on the target and one receives on the draft. The target's session threads only queue
(sequence, rows) and return the descriptor; the draft's receiver thread files each step under its
sequence number in a mailbox, where the session thread that holds the descriptor picks it up.

No session waits on the other process without a timeout: a full send queue sends the step inline,
each send is bounded, and a dead or stuck draft breaks the channel (the target then sends inline
until the coordinator runs the handshake again).
"""

from __future__ import annotations

import itertools
import logging
import queue
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.dtypes import BY_CODE, DTYPES, name_of
from tandem.transports.contract import TransportError, check_ref, count
from tandem.v1 import common_pb2

log = logging.getLogger("tandem.transports")

WARMUP = -1  # the sequence number of the first exchange: NCCL's first send/recv sets up for ~0.7 s
IDLE = timedelta(days=1)  # the draft's receiver waits this long for the next step; the target's death ends it sooner


def _local_address(host: str, port: int) -> str:
    """This host's address on the route to HOST:PORT (where gloo must listen for the peer)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # UDP: no packet is sent, only the route is looked up
        return probe.getsockname()[0]


def _group(store: dist.Store, rank: int, device: torch.device, timeout: float, host: str) -> dist.ProcessGroup:
    if device.type == "cuda":
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=timeout)  # the rendezvous; each op below passes its own
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, 2, opts)


def _header(sequence: int, features: torch.Tensor, device: torch.device) -> torch.Tensor:
    rows, width = features.shape
    code = DTYPES[name_of(features.dtype)].code
    return torch.tensor([sequence, rows, width, code], dtype=torch.int64, device=device)  # [4]


class NcclSender:
    name = "nccl"

    def __init__(self, plan: common_pb2.TransportPlan, device: str, host: str, traffic=None):
        self.device = torch.device(device)
        self.channel = plan.channel
        self.traffic = traffic
        self.timeout = plan.timeout or 10.0
        self.store = dist.TCPStore(host, 0, 2, is_master=True, timeout=timedelta(seconds=self.timeout),
                                   wait_for_workers=False)
        self.host = host
        plan.address = f"{host}:{self.store.port}"
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, plan.max_inflight))
        self._seq = itertools.count(1)
        self._ready = threading.Event()
        self.broken: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"tandem-nccl-send-{self.channel[:8]}", daemon=True)
        self._thread.start()

    def start(self, timeout: float) -> None:
        """The draft has joined: wait (bounded) for the group and its warm-up exchange."""
        if not self._ready.wait(timeout) or self.broken:
            raise TransportError(f"the nccl group did not form within {timeout:g}s: {self.broken or 'no draft joined'}")

    def send(self, session_id: str, features: torch.Tensor) -> common_pb2.FeatureRef | None:
        if not self._ready.is_set() or self.broken:
            return None
        features = features.detach().to(self.device).clone()  # ours: the engine may reuse its buffer
        sequence = next(self._seq)
        try:
            self._queue.put_nowait((sequence, features))
        except queue.Full:
            log.debug("nccl send queue full: step of %d rows inline", features.shape[0])
            return None
        count(self.traffic, "sent", self.name, features)
        rows, width = features.shape
        return common_pb2.FeatureRef(transport=self.name, channel=self.channel, sequence=sequence, rows=rows,
                                     width=width, dtype=name_of(features.dtype))

    def release(self, session_id: str) -> None:
        pass  # the sender thread owns each step until it is sent

    def _send(self, sequence: int, features: torch.Tensor) -> None:
        for tensor in (_header(sequence, features, self.device), features):
            self.pg.send([tensor], 1, 0).wait(timedelta(seconds=self.timeout))

    def _run(self) -> None:
        try:
            self.pg = _group(self.store, 0, self.device, self.timeout, self.host)
            self._send(WARMUP, torch.zeros((1, 1), device=self.device))
            self._ready.set()
            while (item := self._queue.get()) is not None:
                self._send(*item)
        except Exception as exc:  # noqa: BLE001 - anything (a dead or stuck draft, a broken group, a bad device)
            # breaks the channel with its reason: start() reports it at once, and every step goes inline
            self.broken = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            log.warning("the nccl feature channel %s broke (%s): features go over gRPC until the next handshake",
                        self.channel, self.broken)
            self._ready.set()

    def close(self) -> None:
        self.broken = self.broken or "closed"
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass  # the thread is stuck in a send: its timeout ends it


class Mailbox:
    """Steps received but not yet claimed, by sequence number; bounded (unclaimed steps of abandoned
    sessions are dropped oldest first)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: dict[int, torch.Tensor] = {}
        self._changed = threading.Condition()
        self.broken: str | None = None

    def put(self, sequence: int, features: torch.Tensor) -> None:
        with self._changed:
            self._items[sequence] = features
            while len(self._items) > self.capacity:
                del self._items[min(self._items)]
            self._changed.notify_all()

    def get(self, sequence: int, timeout: float) -> torch.Tensor:
        with self._changed:
            self._changed.wait_for(lambda: sequence in self._items or self.broken is not None, timeout)
            if sequence in self._items:
                return self._items.pop(sequence)
            raise TransportError(f"nccl step {sequence}: " + (self.broken or f"not received within {timeout:g}s"))

    def fail(self, reason: str) -> None:
        with self._changed:
            self.broken = reason
            self._changed.notify_all()


class NcclReceiver:
    name = "nccl"

    def __init__(self, plan: common_pb2.TransportPlan, device: str, traffic=None):
        self.device = torch.device(device)
        self.channel = plan.channel
        self.traffic = traffic
        self.timeout = plan.timeout or 10.0
        self.mailbox = Mailbox(capacity=2 * max(1, plan.max_inflight))
        host, port = plan.address.rsplit(":", 1)
        deadline = time.monotonic() + self.timeout
        self.store = dist.TCPStore(host, int(port), 2, is_master=False, timeout=timedelta(seconds=self.timeout))
        local = _local_address(host, int(port))
        self.pg = _group(self.store, 1, self.device, max(1.0, deadline - time.monotonic()), local)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"tandem-nccl-recv-{self.channel[:8]}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        header = torch.empty(4, dtype=torch.int64, device=self.device)
        try:
            while not self._closed:
                self.pg.recv([header], 0, 0).wait(IDLE)
                sequence, rows, width, code = header.tolist()
                features = torch.empty((rows, width), dtype=BY_CODE[code].torch, device=self.device)
                self.pg.recv([features], 0, 0).wait(timedelta(seconds=self.timeout))
                if sequence != WARMUP:
                    self.mailbox.put(sequence, features)
        except Exception as exc:  # noqa: BLE001 - the target went away, the group broke: waiting sessions fail at once
            reason = f"channel broken: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            if not self._closed:
                log.warning("the nccl feature channel %s broke: %s", self.channel, reason)
            self.mailbox.fail(reason)

    def recv(self, ref: common_pb2.FeatureRef) -> torch.Tensor:
        check_ref(ref, self.channel)
        features = self.mailbox.get(ref.sequence, self.timeout)
        if tuple(features.shape) != (ref.rows, ref.width):
            raise TransportError(f"nccl step {ref.sequence} is {list(features.shape)}, its descriptor says "
                                 f"[{ref.rows}, {ref.width}]")
        count(self.traffic, "received", self.name, features)
        return features

    def close(self) -> None:
        self._closed = True
        self.mailbox.fail("closed")
