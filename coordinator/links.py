"""The scheduler's streams to the target and the draft (TargetService.Step, DraftService.Step): one batch
message each way per step (TGI's model server speaks in whole batches too). `ServiceLink.send` puts a
step's batch on the stream, `ServiceLink.receive` reads its answer: the scheduler sends the target's and
the draft's batches before it reads either, so both services work during the same step.

A broken stream fails the steps in flight with its status and ends every session opened on it (the
service frees them when the stream ends); the next step opens a new stream. A draft step has a deadline
(--draft-timeout): a draft that hangs past it is cancelled like a broken stream.

A service on this host offers its steps over a Unix socket too (tandem/step_socket.py: the same messages,
without gRPC's threads); the link takes it when it can connect, and gRPC when it cannot.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from tandem.errors import code_of
from tandem.step_socket import TRANSPORT, SocketCall, StepStreamError

log = logging.getLogger("tandem.coordinator")

_CLOSE = object()
# when each service last answered a step (time.monotonic(), by service name): the health monitor keeps a
# service whose checks come back late while its steps still do (a busy host) up (coordinator/monitor.py)
last_answer: dict[str, float] = {}
OWNER_KEY = "tandem-coordinator"  # the metadata naming who steps a service (one coordinator per pair)


class BackendError(Exception):
    """A target or draft service failed a step; carries its status code to pass on to the client."""

    def __init__(self, service: str, code: grpc.StatusCode, details: str):
        super().__init__(f"{service} service: {details}")
        self.service = service
        self.code = code
        self.details = details



class _Watchdog:
    """Cancels streams whose answer is overdue: one thread for all of them, instead of a timer per step."""

    def __init__(self):
        self._due: list[tuple[float, int, _Stream]] = []  # heap of (deadline, arm id, stream)
        self._armed: dict[_Stream, int] = {}  # the stream's current arm id; older heap entries are stale
        self._ids = itertools.count()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def arm(self, stream: _Stream, seconds: float) -> None:
        with self._changed:
            arm_id = next(self._ids)
            self._armed[stream] = arm_id
            heapq.heappush(self._due, (time.monotonic() + seconds, arm_id, stream))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tandem-watchdog", daemon=True)
                self._thread.start()
            elif self._due[0][1] == arm_id:  # the new deadline is the earliest: wake the thread for it
                self._changed.notify()

    def disarm(self, stream: _Stream) -> None:
        with self._changed:
            self._armed.pop(stream, None)

    def _run(self) -> None:
        with self._changed:
            while True:
                now = time.monotonic()
                while self._due and (self._due[0][0] <= now or self._armed.get(self._due[0][2]) != self._due[0][1]):
                    _, arm_id, stream = heapq.heappop(self._due)
                    if self._armed.get(stream) == arm_id:
                        del self._armed[stream]
                        stream.expire()
                self._changed.wait(self._due[0][0] - now if self._due else None)


_watchdog = _Watchdog()


class _Stream:
    """A bidirectional call driven step by step: send() queues a message, recv() waits for the next; the
    call starts with the first message."""

    def __init__(self, service: str, method: Callable, metadata: Sequence[tuple[str, str]] = ()):
        self.service = service
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._method = method
        self._metadata = tuple(metadata)
        self._call = None  # started by the first send()
        self.cancelled = False  # by us (cancel()), not by the service or the network
        self._expired = False  # the watchdog cancelled the call: a step's deadline passed

    def send(self, message) -> None:
        self._requests.put(message)
        if self._call is None:
            self._call = self._method(iter(self._requests.get, _CLOSE), metadata=self._metadata)
            if self.cancelled:  # cancel() came while the call started
                self._call.cancel()

    def recv(self, step_timeout: float | None = None):
        """The next message; with `step_timeout`, give up (DEADLINE_EXCEEDED) after that many seconds."""
        if step_timeout is not None:
            _watchdog.arm(self, step_timeout)
        try:
            message = self._next()
        except StopIteration:
            raise BackendError(self.service, grpc.StatusCode.INTERNAL, "the step stream ended early") from None
        except (grpc.RpcError, StepStreamError) as exc:
            if self._expired:
                raise BackendError(
                    self.service, grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {step_timeout:g}s"
                ) from None
            if isinstance(exc, StepStreamError):
                raise BackendError(self.service, exc.code, exc.details) from None
            raise BackendError(self.service, exc.code(), exc.details() or "") from None
        finally:
            if step_timeout is not None:
                _watchdog.disarm(self)
        last_answer[self.service] = time.monotonic()
        return message

    def _next(self):
        return next(self._call)

    def expire(self) -> None:
        """Called by the watchdog when a step's deadline passed: the waiting recv() fails."""
        self._expired = True
        if self._call is not None:
            self._call.cancel()

    def cancel(self) -> None:
        self.cancelled = True
        self._requests.put(_CLOSE)
        if self._call is not None:
            self._call.cancel()


class _SocketStream(_Stream):
    """The stream over a service's step socket (tandem/step_socket.py): opened at once; each message is
    serialized here and counted as gRPC's serializers count theirs (tandem/traffic.py), labelled unix."""

    def __init__(self, service: str, local, answer_type, owner: str, traffic=None, links=("", "")):
        super().__init__(service, None)
        self._call = SocketCall(local.path, local.token, owner)  # OSError: no socket to reach here
        self._answer_type, self._traffic, self._links = answer_type, traffic, links

    def send(self, message) -> None:
        data = message.SerializeToString()
        if self._traffic is not None:
            self._traffic.count("sent", self._links[0], len(data), message, TRANSPORT)
        self._call.send(data)

    def _next(self):
        data = self._call.recv()
        message = self._answer_type.FromString(data)
        if self._traffic is not None:
            self._traffic.count("received", self._links[1], len(data), message, TRANSPORT)
        return message


class ServiceLink:
    """The scheduler's stream to one service. `pack(steps, releases)` -> the batch message; the answer's
    `results` come back one per step, each a response or a StepError."""

    typed = False  # its answers are wire messages (the scheduler unpacks them); an in-process engine's are not

    def __init__(self, service: str, method: Callable, pack: Callable[[Sequence, Sequence[str]], Any],
                 step_timeout: float | None = None, owner: str | None = None, local=None, answer_type=None,
                 traffic=None):
        """`owner`: who steps the service (the coordinator's id): its own new stream may replace its last.
        `local`: the service's step socket (common.LocalSteps, from its ModelInfo), tried first; its streams
        read `answer_type` messages and count them in `traffic`."""
        self.service = service
        self.owner = owner or uuid.uuid4().hex
        self._method = method
        self._pack = pack
        self._step_timeout = step_timeout
        self._local = local if local is not None and local.path else None
        self._answer_type, self._traffic = answer_type, traffic
        self._stream: _Stream | None = None
        self._sent = 0  # steps of the batch in flight
        self.generation = 0  # counts the streams opened: a session of an earlier one is gone
        # when the last batch went and its answer came (time.monotonic_ns): a profiled request's stamps, taken
        # here because the scheduler reads the target's answer and the draft's before it hands either on
        self.sent_ns = self.received_ns = 0

    @property
    def transport(self) -> str:
        """What the steps go by: unix (the service's step socket) or grpc."""
        return TRANSPORT if self._local is not None else "grpc"

    def _open(self) -> _Stream:
        if self._local is not None:
            try:
                stream = _SocketStream(self.service, self._local, self._answer_type, self.owner, self._traffic,
                                       (f"coordinator->{self.service}", f"{self.service}->coordinator"))
                if not self.generation:
                    log.info("the %s's steps go over its step socket %s", self.service, self._local.path)
                return stream
            except OSError as exc:  # another host or container: the socket is not there to reach
                log.info("the %s's step socket %s cannot be reached (%s): its steps go over gRPC",
                         self.service, self._local.path, exc)
                self._local = None
        return _Stream(self.service, self._method, [(OWNER_KEY, self.owner)])

    def send(self, steps: Sequence, releases: Sequence[str] = ()) -> None:
        if self._stream is None:
            self._stream = self._open()
            self.generation += 1
        self._sent = len(steps)
        self._stream.send(self._pack(steps, releases))
        self.sent_ns = time.monotonic_ns()

    def receive(self) -> list:
        """The answers of the batch sent: a response or a BackendError per step. A broken stream (or one past
        its step deadline) is closed: every step gets its error."""
        stream, n = self._stream, self._sent
        try:
            answer = stream.recv(self._step_timeout)
        except BackendError as exc:
            stream.cancel()
            self._stream = None
            return [exc] * n
        finally:
            self.received_ns = time.monotonic_ns()
        if len(answer.results) != n:
            self.close()
            return [BackendError(self.service, grpc.StatusCode.INTERNAL,
                                 f"the {self.service} answered {len(answer.results)} of {n} steps")] * n
        return [BackendError(self.service, code_of(r.error.code), r.error.message) if r.HasField("error")
                else r.response for r in answer.results]

    def close(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None
