"""uvicorn in the coordinator process: the front's own event loop on a thread, on --host and
--http-port (0: any free port; the bound address goes to the announce file's `.http` sibling, where
`tandem serve` reads it). Stopped after the coordinator's drain, so in-flight requests finish."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from pathlib import Path

import uvicorn

from coordinator.generation import Generations
from coordinator.http.app import Front
from coordinator.http.auth import Door
from tandem.auth import KeyRing
from tandem.config import CoordinatorSettings

log = logging.getLogger("tandem.coordinator")

# After the drain, connections still open (idle keep-alive ones) get this long to close.
SHUTDOWN_GRACE_S = 5.0
# A request's line and headers together (h11 answers 431 past it): an OpenAI client sends well under 2 KiB,
# and a header of megabytes held a connection's memory and parser time (vLLM's CVE-2025-48956).
MAX_HEADER_BYTES = 64 << 10


def http_announce_file(announce: Path) -> Path:
    return announce.with_name(announce.name + ".http")


class HttpFront:
    def __init__(self, settings: CoordinatorSettings, generations: Generations, keys: KeyRing):
        """`keys`: the coordinator's API keys, shared with its gRPC front (tandem/auth.py)."""
        host = settings.host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self.socket = socket.create_server((host, settings.http_port), family=family, backlog=2048)
        except OSError as exc:
            raise OSError(f"the coordinator's HTTP front cannot bind {host}:{settings.http_port}: {exc}") from None
        # Inherited by the accepted connections. asyncio sets it only on sockets created with proto
        # IPPROTO_TCP (create_server's is 0): without it a response's body waited for the ACK of its
        # headers, the client's delayed ACK, 40 ms per request on a kept-alive connection.
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        port = self.socket.getsockname()[1]
        scheme = "https" if settings.tls_cert is not None else "http"
        self.url = f"{scheme}://{f'[{host}]' if family == socket.AF_INET6 else host}:{port}"
        app = Door(Front(generations, settings.served_model_name, settings.chat_template).app(), keys,
                   settings.open_metrics)
        config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False,
                                timeout_graceful_shutdown=SHUTDOWN_GRACE_S, http="h11",
                                h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                                ssl_certfile=settings.tls_cert, ssl_keyfile=settings.tls_key)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, name="tandem-http", daemon=True)
        self.thread.start()
        log.info("tandem coordinator: OpenAI-compatible HTTP on %s/v1", self.url)
        if settings.announce_file is not None:
            path = http_announce_file(settings.announce_file)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(self.url)
            tmp.replace(path)

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.socket]))

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(SHUTDOWN_GRACE_S + 5)
