"""Point-to-point over a two-rank torch.distributed group: target = rank 0, draft = rank 1.

NCCL for CUDA tensors (any two GPUs, same node or not; not two ranks on one GPU), gloo for CPU
tensors (the same code, so the tests run it). The group is built on its own TCPStore per handshake,
outside torch.distributed's default group, so that a new handshake (a restarted draft) can build
another.

Point-to-point ops match in order, not by tag, and many sessions send at once, so exactly one
thread sends on the target and one receives on the draft. The target's session threads only queue
(sequence, rows) and return the descriptor; the draft's receiver thread files each step under its
sequence number in a mailbox, where the session thread that holds the descriptor picks it up. Each
step goes as a header [sequence, rows, width, dtype code] and its rows: the receiver must size the
rows before they come, and the descriptors reach the draft in any order or not at all (a generation's
last features are never read), so they cannot tell it.

Waiting. The draft always has a receive posted: it waits for the next step, however long the server
idles. NCCL's watchdog aborts any op older than the group's own timeout and, with
TORCH_NCCL_ASYNC_ERROR_HANDLING at its default (3), takes the whole process down; with the group's
timeout at the transport's 10 s an idle draft crash-looped. So the group's timeout is out of the way
(a day) and the group is built with TORCH_NCCL_ASYNC_ERROR_HANDLING=2, which aborts a failed
communicator and keeps the process (PyTorch's ProcessGroupNCCL environment variables). Every wait is
bounded here instead: `work.wait(timeout)` blocks this thread until the op is done or the timeout
passes, and then aborts the communicator and raises. No session waits on the other process without a
timeout: a full send queue sends the step inline, and a dead or stuck draft breaks the channel (the
target then sends inline until the coordinator runs the handshake again).

Closing (every re-handshake) aborts the group, so that no communicator is left behind, and the
target's end first sends a CLOSE header: gloo cannot abort a receive already posted, so that is what
ends the draft's receiver thread there (NCCL's abort ends it too).

Streams (CUDA). Nothing on the send path waits for the GPU: a session's rows are cloned on a side
stream that waits for the engine's `ready` event (the end of its batch), not behind the engine's next
forward; the sender thread posts a step's header (from pinned memory) and rows from its own stream and
goes on to the next step: it looks at the posted sends' completion between steps, and breaks the channel
if the oldest is not done within the timeout. The receiver thread receives on its own stream: reading a
header waits for that receive only (its values size the rows), and the rows' arrival is an event on that
stream, which the draft's forward stream (recv's consumer) waits for on the GPU, not the host. On the
CPU (gloo) the rows are waited for by the receiver thread, as a host copy must be.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import queue
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.dtypes import BY_CODE, DTYPES, name_of
from tandem.transports.contract import TransportError, check_ref, consumer_stream, count
from tandem.v1 import common_pb2

log = logging.getLogger("tandem.transports")

WARMUP = -1  # the sequence number of the first exchange: NCCL's first send/recv sets up, slowly
CLOSE = -2  # the target's last header: the draft's receiver thread ends
POLL = 0.0005  # seconds between looks at posted sends while some are in flight
IDLE = timedelta(days=1)  # the draft's receiver waits this long for the next step; the target's close or death ends it sooner
_ENV_LOCK = threading.Lock()  # the group reads TORCH_NCCL_ASYNC_ERROR_HANDLING from the environment as it is built


def _local_address(host: str, port: int) -> str:
    """This host's address on the route to HOST:PORT (where gloo must listen for the peer)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # UDP: no packet is sent, only the route is looked up
        return probe.getsockname()[0]


def _group(store: dist.Store, rank: int, device: torch.device, timeout: float, host: str) -> dist.ProcessGroup:
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicator binds to the current device of this thread
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = IDLE  # the watchdog's deadline: never reached; every wait below has its own
        with _ENV_LOCK:
            saved = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"  # on an error: abort the communicator, not the process
            try:
                return dist.ProcessGroupNCCL(store, rank, 2, opts)
            finally:
                if saved is None:
                    del os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
                else:
                    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = saved
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=timeout)  # the rendezvous; each op below passes its own
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, 2, opts)


def _abort(pg: dist.ProcessGroup | None) -> None:
    """Abort the group's communicators (NCCL: ncclCommAbort, which also ends a posted receive); safe twice."""
    if pg is None:
        return
    try:
        pg.abort()
    except Exception as exc:  # noqa: BLE001 - an abort that fails leaves nothing more to do
        log.debug("aborting the nccl feature group: %r", exc)


def _reason(exc: BaseException) -> str:
    text = str(exc).splitlines()[0][:300] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"


def _stream(device: torch.device):
    """A side stream on a CUDA device (None on the CPU), and the context that makes it current."""
    if device.type != "cuda":
        return None, contextlib.nullcontext()
    stream = torch.cuda.Stream(device)
    return stream, torch.cuda.stream(stream)


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
        # the rows queued and not yet sent are copies on our device: at most ring_bytes of them
        self._max_bytes, self._queued_bytes = plan.ring_bytes or (256 << 20), 0
        self._bytes_lock = threading.Lock()
        self._seq = itertools.count(1)
        self._ready = threading.Event()
        self._closed = threading.Event()
        self.broken: str | None = None
        self.pg: dist.ProcessGroup | None = None
        self._copy_stream, _ = _stream(self.device)  # session threads clone their rows here
        self._thread = threading.Thread(target=self._run, name=f"tandem-nccl-send-{self.channel[:8]}", daemon=True)
        self._thread.start()

    def start(self, timeout: float) -> None:
        """The draft has joined: wait (bounded) for the group and its warm-up exchange."""
        if not self._ready.wait(timeout) or self.broken:
            raise TransportError(f"the nccl group did not form within {timeout:g}s: {self.broken or 'no draft joined'}")

    def send(self, session_id: str, features: torch.Tensor, ready=None) -> common_pb2.FeatureRef | None:
        """Queue the step's rows for the sender thread; `ready`: a CUDA event the engine recorded when
        they were computed (the rows are read once the GPU is past it, without waiting here)."""
        if not self._ready.is_set() or self.broken:
            return None
        rows, width = features.shape
        nbytes = features.numel() * features.element_size()
        with self._bytes_lock:
            if self._queued_bytes + nbytes > self._max_bytes:
                log.debug("nccl send queue holds %d bytes: step of %d rows inline", self._queued_bytes, rows)
                return None
            self._queued_bytes += nbytes
        copied = self._copy(features, ready)
        sequence = next(self._seq)
        try:
            self._queue.put_nowait((sequence, *copied))
        except queue.Full:
            self._sent(nbytes)
            log.debug("nccl send queue full: step of %d rows inline", rows)
            return None
        count(self.traffic, "sent", self.name, features)
        return common_pb2.FeatureRef(transport=self.name, channel=self.channel, sequence=sequence, rows=rows,
                                     width=width, dtype=name_of(features.dtype))

    def _copy(self, features: torch.Tensor, ready) -> tuple[torch.Tensor, object]:
        """Our own copy of the rows (the engine reuses its buffers), and the event it is complete at."""
        if self._copy_stream is None:
            return features.detach().to(self.device).clone(), None
        stream = self._copy_stream
        if ready is not None:
            stream.wait_event(ready)  # the end of the batch that computed them, not the forward after it
        else:
            stream.wait_stream(torch.cuda.current_stream(features.device if features.is_cuda else self.device))
        with torch.cuda.stream(stream):
            copy = features.detach().to(self.device, copy=True)  # [n, 3H]
            done = torch.cuda.Event()
            done.record(stream)
        if features.is_cuda:
            features.record_stream(stream)  # the engine's buffer stays until the copy has read it
        return copy, done

    def _sent(self, nbytes: int) -> None:
        with self._bytes_lock:
            self._queued_bytes -= nbytes

    def release(self, session_id: str) -> None:
        pass  # the sender thread owns each step until it is sent

    def _header(self, sequence: int, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        header = torch.tensor([sequence, rows, width, DTYPES[name_of(dtype)].code], dtype=torch.int64)  # [4]
        if self.device.type != "cuda":
            return header
        return header.pin_memory().to(self.device, non_blocking=True)  # no wait for the GPU on the send path

    def _post(self, sequence: int, features: torch.Tensor, done=None, queued: bool = True) -> tuple:
        """Post a step's header and rows -> (their works, the bytes they hold of the queue's count (`queued`:
        a session's step; the warm-up and the close are not counted), deadline, the tensors they read)."""
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        rows, width = features.shape
        tensors = (self._header(sequence, rows, width, features.dtype), features)
        works = []
        for tensor in tensors:
            works.append(self.pg.send([tensor], 1, 0))
            if self.device.type != "cuda":  # gloo: one send at a time, done only once waited for (blocking)
                works[-1].wait(timedelta(seconds=self.timeout))
        nbytes = features.numel() * features.element_size() if queued else 0
        return works, nbytes, time.monotonic() + self.timeout, tensors

    def _reap(self, in_flight: collections.deque, wait: bool = False) -> None:
        """Drop the posted steps that are done (their bytes leave the queue's count), oldest first; `wait`:
        until all are. A step not done within the timeout breaks the channel (a dead or stuck draft)."""
        while in_flight:
            works, nbytes, deadline, _ = in_flight[0]
            if all(work.is_completed() for work in works):
                if self.device.type == "cuda":  # gloo's were waited for as they were posted
                    for work in works:
                        work.wait()  # done: raises the send's error, if it had one
                in_flight.popleft()
                self._sent(nbytes)
                continue
            if time.monotonic() > deadline:
                raise TransportError(f"a feature send was not done within {self.timeout:g}s")
            if not wait:
                return
            time.sleep(POLL)

    def _run(self) -> None:
        _, on_own_stream = _stream(self.device)
        in_flight: collections.deque = collections.deque()
        try:
            with on_own_stream:
                self.pg = _group(self.store, 0, self.device, self.timeout, self.host)
                in_flight.append(self._post(WARMUP, torch.zeros((1, 1), device=self.device), queued=False))
                self._reap(in_flight, wait=True)
                self._ready.set()
                while not self._closed.is_set():
                    try:
                        item = self._queue.get(timeout=POLL if in_flight else 0.5)
                    except queue.Empty:
                        item = ()
                    self._reap(in_flight)
                    if item is None:
                        break
                    if item:
                        sequence, features, done = item
                        in_flight.append(self._post(sequence, features, done))
                # the draft's receiver ends
                in_flight.append(self._post(CLOSE, torch.zeros((1, 1), device=self.device), queued=False))
                self._reap(in_flight, wait=True)
        except Exception as exc:  # noqa: BLE001 - anything (a dead or stuck draft, a broken group, a bad device)
            # breaks the channel with its reason: start() reports it at once, and every step goes inline
            if self.broken is None:
                self.broken = _reason(exc)
                log.warning("the nccl feature channel %s broke (%s): features go over gRPC until the next handshake",
                            self.channel, self.broken)
            self._ready.set()
        finally:
            for _, nbytes, _, _ in in_flight:
                self._sent(nbytes)
            _abort(self.pg)

    def close(self) -> None:
        """Steps not sent yet are not sent; the thread tells the draft and aborts the group. A thread stuck
        in a send ends at that send's timeout."""
        self.broken = self.broken or "closed"
        self._closed.set()
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)  # wakes the thread now rather than at its next look


class Mailbox:
    """Steps received but not yet claimed, by sequence number; bounded (unclaimed steps of abandoned
    sessions are dropped oldest first)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: dict[int, tuple[torch.Tensor, object]] = {}  # sequence -> (rows, their arrival event)
        self._changed = threading.Condition()
        self.broken: str | None = None

    def put(self, sequence: int, item: tuple[torch.Tensor, object]) -> None:
        with self._changed:
            self._items[sequence] = item
            while len(self._items) > self.capacity:
                del self._items[min(self._items)]
            self._changed.notify_all()

    def get(self, sequence: int, timeout: float) -> tuple[torch.Tensor, object]:
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
        stream, on_own_stream = _stream(self.device)  # reading a header waits for its receive, not for our forward
        try:
            with on_own_stream:
                while not self._closed:
                    header = torch.empty(4, dtype=torch.int64, device=self.device)
                    self.pg.recv([header], 0, 0).wait(IDLE)
                    sequence, rows, width, code = header.tolist()
                    features = torch.empty((rows, width), dtype=BY_CODE[code].torch, device=self.device)
                    work = self.pg.recv([features], 0, 0)
                    arrived = None
                    if stream is None:  # gloo: a host copy, complete once the wait returns
                        work.wait(timedelta(seconds=self.timeout))
                    else:
                        work.wait()  # no timeout: our stream waits for the receive, the host does not
                        arrived = torch.cuda.Event()
                        arrived.record(stream)
                    if sequence == CLOSE:
                        break
                    if sequence != WARMUP:
                        self.mailbox.put(sequence, (features, arrived))
                    if stream is not None:
                        self._bound(work)
            self.mailbox.fail("the target closed the channel")
        except Exception as exc:  # noqa: BLE001 - the target went away, the group broke: waiting sessions fail at once
            reason = f"channel broken: {_reason(exc)}"
            if not self._closed:
                log.warning("the nccl feature channel %s broke: %s", self.channel, reason)
            self.mailbox.fail(reason)
        finally:
            _abort(self.pg)

    def _bound(self, work) -> None:
        """The receive is done within the timeout (a sender gone between a header and its rows breaks the
        channel); its step is in the mailbox already, so a reader's stream does not wait for this look."""
        deadline = time.monotonic() + self.timeout
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TransportError(f"feature rows not received within {self.timeout:g}s of their header")
            time.sleep(POLL)

    def recv(self, ref: common_pb2.FeatureRef, consumer=None) -> torch.Tensor:
        check_ref(ref, self.channel)
        features, arrived = self.mailbox.get(ref.sequence, self.timeout)
        if tuple(features.shape) != (ref.rows, ref.width):
            raise TransportError(f"nccl step {ref.sequence} is {list(features.shape)}, its descriptor says "
                                 f"[{ref.rows}, {ref.width}]")
        if features.is_cuda:
            consumer = consumer_stream(consumer, self.device)
            consumer.wait_event(arrived)  # GPU-side: the draft's forward waits for the receive, nothing else
            # received on the receiver's stream, read on the consumer's: the allocator must not hand the
            # memory back to the receiver's stream while the consumer's kernels still read it
            features.record_stream(consumer)
        count(self.traffic, "received", self.name, features)
        return features

    def close(self) -> None:
        self._closed = True
        self.mailbox.fail("closed")
        _abort(self.pg)  # NCCL: ends the posted receive; gloo: the target's CLOSE or its exit does
