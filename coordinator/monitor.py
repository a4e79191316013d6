"""The coordinator's view of its target and draft services: up or down, what they are, whether they fit.

A monitor thread checks each service's health: every HEALTH_INTERVAL seconds (tandem/defaults.py) while it
is up, and with backoff (0.1 s, doubling, up to RETRY_MAX) while it is down. A generation that sees a service
fail reports it (`fault`), so that the next generations do not wait for the next check.

  target down   the coordinator reports NOT_SERVING and refuses generations with UNAVAILABLE; when the
                target is back it reads what it is again (a restart may bring another model), checks
                the pair, and serves again.
  draft down    generations run target-only (the same greedy output, without the speed-up); when the
                draft is back and still fits the target, new generations get draft sessions again.

No torch here: only health checks, ModelInfo and the tokenizer cross.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenizers import Tokenizer

from coordinator.handshake import connect_transport
from coordinator.links import BackendError, last_answer
from tandem import security
from tandem.config import CoordinatorSettings
from tandem.convert import draft_shape_from_pb, target_shape_from_pb
from tandem.defaults import BATCH_MESSAGE_MIB, HEALTH_INTERVAL
from tandem.errors import Abort
from tandem.pairing import PairMismatch, check_pair
from tandem.service import channel_options, wait_for_serving
from tandem.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

log = logging.getLogger("tandem.coordinator")

# gRPC's own reconnect backoff grows to 120 s: a service restarted on its port would sit unused
# for minutes. Keep the channel's retries as quick as the health checks.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
CHECK_TIMEOUT = 1.0  # a health check that takes longer is a slow answer...
SLOW_CHECKS = 3  # ...and this many in a row (each re-checked at once) a hung service: one busy second of a
# loaded host (a big batch, another engine spinning on the same cores) must not take a serving service down;
# nor must more, while it answers steps: a service that answered one within the slow checks' span is busy, not
# hung (taken down for checks it missed while busy, a target failed every request in flight)
RETRY_MIN, RETRY_MAX = 0.1, 2.0
# A new generation waits this long for a target that is down for late checks (not for a refusal) before it is
# refused: on a loaded host (another engine, a compile) an idle target can miss its checks for seconds, and
# every request that came meanwhile failed UNAVAILABLE where it would have run seconds later
LATE_PATIENCE_S = 5.0
# Statuses of a failed step that mean the service itself is gone (or, for the draft, stuck past its
# step deadline, or without the feature channel the target sends on), not that this request went
# wrong. Others only trigger a health check. A draft that comes back runs the handshake again.
DOWN_CODES = {
    "target": (grpc.StatusCode.UNAVAILABLE,),
    "draft": (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.FAILED_PRECONDITION),
}


# (channel, service name) -> the channel the service's stub uses (e.g. one that meters traffic)
WrapChannel = Callable[[grpc.Channel, str], grpc.Channel]


@dataclass(frozen=True)
class Pair:
    """The target and draft services as one generation uses them, taken at its start."""

    target: target_pb2_grpc.TargetServiceStub
    target_info: target_pb2.TargetInfo
    draft: draft_pb2_grpc.DraftServiceStub | None  # None: no draft service, or it is down
    draft_info: draft_pb2.DraftInfo | None
    tokenizer: Tokenizer | None


def check_services_pair(target: target_pb2.TargetInfo, draft: draft_pb2.DraftInfo) -> None:
    """PairMismatch, naming every problem in one message, unless the draft fits the target."""
    check_pair(target_shape_from_pb(target), draft_shape_from_pb(draft))


def _late(reason: str) -> bool:
    """Whether a service went down for health checks that took too long (not for a refusal)."""
    return reason.startswith(grpc.StatusCode.DEADLINE_EXCEEDED.name)


class Link:
    """One internal service: a channel that reconnects by itself, what the service said it is, up or down."""

    def __init__(self, name: str, address: str, options: list, stub_class, wrap: WrapChannel | None = None,
                 tls: security.ChannelTls | None = None):
        self.name = name
        self.address = address
        self.tls = tls  # mutual TLS to the service (tandem/security.py); None: plain
        self.channel = security.channel(address, [*options, *RECONNECT_OPTIONS], tls)
        self.stub = stub_class(wrap(self.channel, name) if wrap is not None else self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)  # unwrapped: checks are not traffic
        self.info = None
        self.up = False
        self.slow = 0  # health checks in a row that timed out while up
        self.busy = False  # its checks time out while its steps come back
        self.reason = "not connected yet"
        self.retry_in = RETRY_MIN
        self.next_check = 0.0

    def problem(self) -> str | None:
        """None when the service reports SERVING; otherwise what is wrong."""
        try:
            response = self._health.Check(health_pb2.HealthCheckRequest(), timeout=CHECK_TIMEOUT)
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        if response.status != health_pb2.HealthCheckResponse.SERVING:
            return f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}"
        return None


class Monitor:
    """Keeps the target and draft links current; `pair()` is what a new generation gets."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        on_target: Callable[[bool], None] = lambda up: None,
        wrap_channel: WrapChannel | None = None,
    ):
        """`on_target(up)` is told when the target goes down and comes back (the coordinator's health)."""
        options, tls = channel_options(BATCH_MESSAGE_MIB), security.services_tls(settings)  # batches: features inline
        self.target = Link("target", settings.target_addr, options, target_pb2_grpc.TargetServiceStub, wrap_channel, tls)
        self.draft = (
            Link("draft", settings.draft_addr, options, draft_pb2_grpc.DraftServiceStub, wrap_channel, tls)
            if settings.draft_addr is not None else None
        )
        self.interval = HEALTH_INTERVAL
        self.connect_timeout = settings.connect_timeout
        self._on_target = on_target
        self._tokenizer: Tokenizer | None = None
        self.transport = "grpc"  # the feature path target -> draft the last handshake set up
        self._current: Pair | None = None
        self._lock = threading.Lock()  # link state and the published Pair
        self._changed = threading.Condition(self._lock)  # a link went up or down
        self._wake = threading.Event()
        self._stop = threading.Event()

    @property
    def links(self) -> list[Link]:
        return [self.target, *([self.draft] if self.draft is not None else [])]

    # -- start-up -----------------------------------------------------------------------------------

    def connect(self) -> None:
        """Wait for the services to be SERVING, read what they are, check they fit (PairMismatch if not)."""
        wait_for_serving(self.target.address, self.connect_timeout, what="target service", tls=self.target.tls)
        self._read_target()
        if self.draft is not None:
            wait_for_serving(self.draft.address, self.connect_timeout, what="draft service", tls=self.draft.tls)
            self._read_draft()
        now = time.monotonic()
        for link in self.links:
            link.up, link.reason, link.next_check = True, "", now + self.interval
        self._publish()

    def start(self) -> None:
        threading.Thread(target=self._run, name="tandem-monitor", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    # -- what generations use -----------------------------------------------------------------------

    @property
    def current(self) -> Pair | None:
        """The services as last seen (None before connect), whether or not the target is up."""
        return self._current

    def pair(self, patience: float = 0.0) -> Pair:
        """The services for a new generation; UNAVAILABLE while the target is down. With `patience`, a target
        down for late health checks (a loaded host, not a refusal) is waited for that many seconds first."""
        if patience > 0 and not self.target.up and _late(self.target.reason):
            with self._changed:
                self._changed.wait_for(lambda: self.target.up or not _late(self.target.reason), timeout=patience)
        current = self._current
        if current is None or not self.target.up:
            raise Abort(
                grpc.StatusCode.UNAVAILABLE,
                f"the target service at {self.target.address} is unavailable ({self.target.reason}); "
                f"the coordinator serves again as soon as it is back",
            )
        return current

    @property
    def draft_attached(self) -> bool:
        current = self._current
        return current is not None and current.draft is not None

    def fault(self, service: str, error: BackendError) -> None:
        """A generation saw `service` fail: down at once if it is gone or stuck, and checked right away."""
        link = self.target if service == "target" else self.draft
        if link is None:
            return
        if error.code in DOWN_CODES[service]:
            self._down(link, f"{error.code.name}: {error.details}")
        link.next_check = 0.0
        self._wake.set()

    # -- the monitor ----------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            for link in self.links:
                if time.monotonic() >= link.next_check:
                    self._check(link)
            wait = min(link.next_check for link in self.links) - time.monotonic()
            if wait > 0:
                self._wake.wait(wait)
            self._wake.clear()

    def _check(self, link: Link) -> None:
        problem = link.problem()
        if link.up:
            slow = problem is not None and _late(problem)
            link.slow = link.slow + 1 if slow else 0
            if link.slow >= SLOW_CHECKS and self._answering(link):  # busy: each next late check asks again
                if not link.busy:
                    log.info("the %s service answers its steps but not its health checks (a busy host): up",
                             link.name)
                link.slow, link.busy = SLOW_CHECKS - 1, True
            elif not slow:
                link.busy = False
            if problem is not None and not 0 < link.slow < SLOW_CHECKS:
                link.slow = 0
                self._down(link, problem)
            else:
                link.next_check = time.monotonic() + (0.0 if slow else self.interval)
            return
        if problem is None:
            try:
                self._read_target() if link is self.target else self._read_draft()
            except (grpc.RpcError, PairMismatch, ValueError) as exc:
                problem = str(exc) if not isinstance(exc, grpc.RpcError) else f"{exc.code().name}: {exc.details()}"
        if problem is None:
            self._up(link)
        else:
            if problem != link.reason:
                (log.error if "does not fit" in problem else log.info)(
                    "the %s service at %s is still down: %s", link.name, link.address, problem
                )
            link.reason = problem
            link.next_check = time.monotonic() + link.retry_in
            link.retry_in = min(link.retry_in * 2, RETRY_MAX)

    @staticmethod
    def _answering(link: Link) -> bool:
        """Whether the service answered a generation's step within the span of its slow checks."""
        return time.monotonic() - last_answer.get(link.name, -float("inf")) < SLOW_CHECKS * CHECK_TIMEOUT

    def _read_target(self) -> None:
        """What the target is, and its tokenizer; a draft that no longer fits it is detached."""
        info = self.target.stub.ModelInfo(target_pb2.TargetInfoRequest(), timeout=30)
        tokenizer = None
        if info.tokenizer_size:
            request = target_pb2.GetTokenizerRequest()
            data = b"".join(chunk.data for chunk in self.target.stub.GetTokenizer(request, timeout=60))
            tokenizer = Tokenizer.from_str(data.decode())
        with self._lock:
            self.target.info, self._tokenizer = info, tokenizer
        draft = self.draft
        if draft is not None and draft.info is not None:
            try:
                check_services_pair(info, draft.info)
                if draft.up:  # a restarted target has no feature channel: open one again
                    self.transport = connect_transport(self.target.stub, info, draft.stub, draft.info)
            except (PairMismatch, grpc.RpcError) as exc:
                if draft.up:
                    self._down(draft, str(exc))

    def _read_draft(self) -> None:
        info = self.draft.stub.ModelInfo(draft_pb2.DraftInfoRequest(), timeout=30)
        check_services_pair(self.target.info, info)
        self.transport = connect_transport(self.target.stub, self.target.info, self.draft.stub, info)
        if info.max_context and info.max_context < self.target.info.max_context:
            log.info("the draft was trained on %d positions, the target serves %d: acceptance may drop past %d",
                     info.max_context, self.target.info.max_context, info.max_context)
        with self._lock:
            self.draft.info = info

    def _up(self, link: Link) -> None:
        with self._lock:
            link.up, link.reason = True, ""
            link.retry_in = RETRY_MIN
            link.next_check = time.monotonic() + self.interval
            self._publish()
            self._changed.notify_all()
        log.warning("the %s service at %s is back%s", link.name, link.address,
                    "; speculation resumes" if link is self.draft else "; serving again")
        if link is self.target:
            self._on_target(True)

    def _down(self, link: Link, reason: str) -> None:
        with self._lock:
            was_up = link.up
            link.up, link.reason = False, reason
            link.retry_in = RETRY_MIN
            link.next_check = time.monotonic() + RETRY_MIN
            self._publish()
            self._changed.notify_all()
        if was_up:
            what = "generations run target-only until it is back" if link is self.draft else "NOT_SERVING"
            log.warning("the %s service at %s is down (%s): %s", link.name, link.address, reason, what)
            if link is self.target:
                self._on_target(False)

    def _publish(self) -> None:
        draft_up = self.draft is not None and self.draft.up and self.draft.info is not None
        self._current = Pair(
            target=self.target.stub,
            target_info=self.target.info,
            draft=self.draft.stub if draft_up else None,
            draft_info=self.draft.info if draft_up else None,
            tokenizer=self._tokenizer,
        )
