"""The shell every Tandem service shares: a gRPC server with health and reflection, admission of
requests, typed errors, and the graceful drain on SIGTERM.

Life of a service process:
  bind and start   health NOT_SERVING, requests get UNAVAILABLE ("loading")
  ready()          the model is loaded: health SERVING
  SIGTERM/SIGINT   health NOT_SERVING, new requests get UNAVAILABLE, in-flight ones finish
                   (up to the grace period), then the server stops and the process exits 0;
                   a second signal stops at once.
No torch here: the coordinator uses it too.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem import auth, security
from tandem.config import ServiceSettings, parse_cpus
from tandem.errors import Abort, StatusInterceptor
from tandem.metrics import new_registry, serve_metrics
from tandem.traffic import SERVER_LINKS, Traffic, TrafficInterceptor

log = logging.getLogger("tandem")

# Set by `tandem serve` for its children: a child whose parent is gone drains and exits.
PARENT_PID_ENV = "TANDEM_PARENT_PID"


def channel_options(max_message_mib: int) -> list[tuple[str, int]]:
    limit = max_message_mib << 20
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


class Admission:
    """Counts in-flight requests; refuses new ones while loading, draining, or at the limit."""

    def __init__(self, limit: int, what: str):
        self.limit = limit
        self.named = "max_sessions"  # what sets the limit, for the refusal
        self.what = what
        self.ready = False
        self.draining = False
        self._active = 0
        self._changed = threading.Condition()

    @property
    def active(self) -> int:
        return self._active

    @contextmanager
    def admit(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def enter(self) -> None:
        """One more in flight (a request; on the target and the draft, a session), or the reason it is refused."""
        with self._changed:
            if self.draining:
                raise Abort(grpc.StatusCode.UNAVAILABLE, f"the {self.what} is draining (shutting down)")
            if not self.ready:
                raise Abort(grpc.StatusCode.UNAVAILABLE, f"the {self.what} is still loading")
            if self._active >= self.limit:
                raise Abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the {self.what} has {self._active} requests in flight ({self.named}={self.limit})",
                )
            self._active += 1

    def leave(self) -> None:
        with self._changed:
            self._active -= 1
            self._changed.notify_all()

    def wait_idle(self, timeout: float, stop: threading.Event | None = None) -> bool:
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._active:
                left = deadline - time.monotonic()
                if left <= 0 or (stop is not None and stop.is_set()):
                    return False
                self._changed.wait(min(left, 0.2))
        return True


def metrics_announce_file(announce: Path) -> Path:
    """Where a service that announces its address to `announce` writes its /metrics HOST:PORT."""
    return announce.with_name(announce.name + ".metrics")


def restrict_cpus(cpus: frozenset[int]) -> None:
    """Run this process on `cpus` only: every thread it has (threads started later inherit it)."""
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    log.info("running on CPUs %s", sorted(cpus))


class Service:
    """A gRPC server with health, reflection, admission and the drain; the servicers are added by the caller."""

    def __init__(self, name: str, settings: ServiceSettings, service_names: Sequence[str]):
        self.name = name  # "target", "draft", "coordinator": for messages
        if settings.cpus is not None:  # before the server's threads start: they inherit it
            restrict_cpus(parse_cpus(settings.cpus))
        self.settings = settings
        self.service_names = list(service_names)
        # what this process sends and receives, counted at the serializers; exported on /metrics
        self.traffic = Traffic()
        self.registry = new_registry(self.traffic)
        self.metrics_address = ""
        self.keys = auth.key_ring(settings)  # the coordinator's API keys, shared by its gRPC and HTTP fronts
        # +8 threads beyond the sessions: health checks and info calls must get through under full load
        self.server = grpc.server(
            ThreadPoolExecutor(max_workers=settings.max_sessions + 8, thread_name_prefix=f"tandem-{name}"),
            options=channel_options(settings.max_message_mib),
            interceptors=[
                *([auth.KeyInterceptor(self.keys)] if self.keys else []),  # before anything runs
                *([TrafficInterceptor(self.traffic, *SERVER_LINKS[name])] if name in SERVER_LINKS else []),
                StatusInterceptor(),  # typed errors -> status codes, for every method (tandem/errors.py)
            ],
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.admission = Admission(settings.max_sessions, f"{name} service")
        self.address = ""
        self._stop = threading.Event()
        self._force = threading.Event()

    def start(self) -> str:
        """Bind and start serving health (NOT_SERVING until `ready`); returns the bound HOST:PORT."""
        names = [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        for service in ["", *self.service_names]:
            self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        host = self.settings.host
        bind_host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        try:
            port = security.add_port(self.server, f"{bind_host}:{self.settings.port}", self.settings)
        except RuntimeError as exc:
            raise OSError(f"the {self.name} service cannot bind {bind_host}:{self.settings.port}: {exc}") from None
        if port == 0:
            raise OSError(f"the {self.name} service cannot bind {bind_host}:{self.settings.port}")
        self.server.start()
        self.address = f"{bind_host}:{port}"
        log.info("tandem %s listening on %s (loading)", self.name, self.address)
        if self.settings.metrics_port is not None:
            self.metrics_address = serve_metrics(self.registry, host, self.settings.metrics_port)
            log.info("tandem %s metrics on http://%s/metrics", self.name, self.metrics_address)
            if self.settings.announce_file is not None:  # beside the address, for `serve` to print
                _write_atomically(metrics_announce_file(self.settings.announce_file), self.metrics_address)
        if self.settings.announce_file is not None:
            _write_atomically(self.settings.announce_file, self.address)
        return self.address

    def ready(self) -> None:
        self.admission.ready = True
        self.set_serving(True)
        log.info("tandem %s serving on %s", self.name, self.address)

    def set_serving(self, serving: bool) -> None:
        """What health reports (the coordinator goes NOT_SERVING while its target is down); a no-op once draining."""
        if serving and not self.admission.ready:
            return  # still loading: ready() says when
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ["", *self.service_names]:
            self.health.set(service, status)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def handle_signals(self) -> None:
        """SIGTERM/SIGINT start the drain (a second one stops at once). Called by the service's main."""

        def handle(signum, frame):
            if self._stop.is_set():
                self._force.set()
            self._stop.set()

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)
        parent = os.environ.get(PARENT_PID_ENV)
        if parent and parent.isdigit():
            threading.Thread(target=self._watch_parent, args=(int(parent),), daemon=True).start()

    def _watch_parent(self, parent: int) -> None:
        while not self._stop.wait(1.0):
            if os.getppid() != parent:
                log.warning("tandem %s: the parent process %d is gone; draining", self.name, parent)
                self._stop.set()

    def wait_for_signal(self) -> None:
        while not self._stop.wait(0.5):
            pass

    def drain(self) -> bool:
        """NOT_SERVING, refuse new requests, let in-flight ones finish; True when all finished in time."""
        self._stop.set()
        self.health.enter_graceful_shutdown()
        self.admission.draining = True
        active = self.admission.active
        log.info("tandem %s draining: %d requests in flight, grace period %.0fs",
                 self.name, active, self.settings.grace_period)
        finished = self.admission.wait_idle(self.settings.grace_period, self._force)
        if not finished:
            log.warning("tandem %s: %d requests still in flight; stopping anyway", self.name, self.admission.active)
        self.server.stop(grace=1.0).wait()
        log.info("tandem %s stopped", self.name)
        return finished

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT, then drain. The process exit status."""
        self.wait_for_signal()
        self.drain()
        return 0


class StartupError(RuntimeError):
    """A service that cannot start (its peers are unreachable or do not fit): logged, exit status 1."""


class Servicer(Protocol):
    """What `run_service` needs of a servicer class: its gRPC service name and how to register it."""

    SERVICE_NAME: str

    def add_to_server(self, server: grpc.Server) -> None: ...


def run_service(
    name: str,
    settings: ServiceSettings,
    servicer_class: type[Servicer],
    load: Callable[[Service, Servicer], Callable[[], None] | None],
    *servicer_args,
) -> int:
    """The life of a service process, the same for all three: bind and report NOT_SERVING, `load`
    (the model, or the connection to the services), report SERVING, serve until SIGTERM, drain.
    `load` may return a clean-up to run at exit; a StartupError from it ends the process with 1."""
    setup_logging(settings.log_level)
    service = Service(name, settings, [servicer_class.SERVICE_NAME])
    servicer = servicer_class(service, *servicer_args)
    servicer.add_to_server(service.server)
    service.start()
    service.handle_signals()
    try:
        close = load(service, servicer)
    except StartupError as exc:
        log.error("the %s cannot start: %s", name, exc)
        service.server.stop(grace=None)
        return 1
    if not service.stopping:
        service.ready()
    try:
        return service.run()
    finally:
        if close is not None:
            close()


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def health_status(address: str, service: str = "", timeout: float = 2.0,
                  tls: security.ChannelTls | None = None) -> str:
    """The health of a service: "SERVING", "NOT_SERVING", ... or "UNREACHABLE"."""
    with security.channel(address, tls=tls) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def wait_for_serving(address: str, timeout: float, alive=lambda: True, what: str = "service",
                     tls: security.ChannelTls | None = None) -> None:
    """Block until the service at `address` reports SERVING; TimeoutError after `timeout` seconds,
    RuntimeError as soon as `alive()` says the process behind it has died."""
    deadline = time.monotonic() + timeout
    with security.channel(address, tls=tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                response = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if not alive():
                raise RuntimeError(f"the {what} at {address} exited before it was ready")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {what} at {address} was not SERVING within {timeout:.0f}s")
            time.sleep(0.1)
