"""The scheduler's step stream over a Unix socket, for a coordinator on the service's host.

It carries what the gRPC stream (TargetService.Step, DraftService.Step) carries, the batch messages and
their answers, one frame each, written and read by the threads that use them. Over gRPC's synchronous API a
message crosses three threads on its way, a wake-up each; here a round trip costs the
two processes' wake-ups (docs/benchmarks.md, "A round's hops").

    coordinator                                      service
    connect(path); hello {token, owner}      ->      the token must be the one its ModelInfo gave (read
                                                     over gRPC, TLS included): who could not read it cannot step
    batch                                    ->      run at once (EngineServicer.steps), as over gRPC
                                             <-      its answer; or an error (code, message) that ends the stream

A frame: one kind byte (MESSAGE, HELLO, ERROR), the body's length (4 bytes, little-endian), the body. The
stream's life is the connection's: the sessions opened on it end when it closes, as with the gRPC stream.
The service offers the socket in its ModelInfo (common.LocalSteps) unless its --transport is grpc; a
coordinator that cannot connect (another host, another container) steps it over gRPC.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Callable, Iterator

import grpc

from tandem.errors import code_of, status_of
from tandem.v1 import common_pb2

log = logging.getLogger("tandem")

MESSAGE, HELLO, ERROR = b"M", b"H", b"E"
_HEADER = struct.Struct("<cI")  # kind, length of the body
TRANSPORT = "unix"  # the steps' label in the traffic counts (tandem/traffic.py)


class StreamClosed(Exception):
    """The other end closed the connection (or it was shut down)."""


def write_frame(sock: socket.socket, kind: bytes, body: bytes) -> None:
    sock.sendall(_HEADER.pack(kind, len(body)) + body)


def read_frame(reader) -> tuple[bytes, bytes]:
    """(kind, body) of the next frame from a socket's binary file; StreamClosed at its end."""
    header = reader.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise StreamClosed()
    kind, size = _HEADER.unpack(header)
    body = reader.read(size)
    if len(body) < size:
        raise StreamClosed()
    return kind, body


def error_body(code: grpc.StatusCode, message: str) -> bytes:
    return json.dumps({"code": code.value[0], "message": message}).encode()


def hello_body(token: str, owner: str) -> bytes:
    return json.dumps({"token": token, "owner": owner}).encode()


# The service's end: `serve(batches, owner)` is the servicer's step loop over serialized messages.
Serve = Callable[[Iterator[bytes], str], Iterator[bytes]]


class StepSocket:
    """A service's listening socket for the scheduler's steps (owner-only, in a directory of its own), and
    a thread per connection that runs `serve` over its frames."""

    def __init__(self, name: str, serve: Serve):
        self._serve = serve
        self._directory = tempfile.mkdtemp(prefix=f"tandem-{name}-")  # mode 0700
        self.path = os.path.join(self._directory, "steps.sock")
        self.token = secrets.token_hex(16)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(self.path)  # OSError where the path is too long for AF_UNIX (a deep TMPDIR)
        except OSError:
            self._listener.close()
            shutil.rmtree(self._directory, ignore_errors=True)
            raise
        os.chmod(self.path, 0o600)
        self._listener.listen(8)
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self.close)
        threading.Thread(target=self._accept, name=f"tandem-{name}-steps", daemon=True).start()

    def info(self) -> common_pb2.LocalSteps:
        return common_pb2.LocalSteps(path=self.path, token=self.token)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._connections.add(conn)
            threading.Thread(target=self._run, args=(conn,), name="tandem-steps", daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        answers = None
        try:
            kind, body = read_frame(reader)
            hello = json.loads(body) if kind == HELLO else {}
            if not secrets.compare_digest(str(hello.get("token", "")), self.token):
                write_frame(conn, ERROR, error_body(grpc.StatusCode.PERMISSION_DENIED,
                                                    "the step socket's token does not match this service's"))
                return
            answers = self._serve(_messages(reader), str(hello.get("owner", "")) or "a local coordinator")
            for answer in answers:
                write_frame(conn, MESSAGE, answer)
        except (StreamClosed, OSError):  # the coordinator went away
            pass
        except Exception as exc:  # the stream ends with its status, as a gRPC stream would
            code, message = status_of(exc) or (grpc.StatusCode.INTERNAL, "the step stream failed")
            if code == grpc.StatusCode.INTERNAL:
                log.error("the step socket's stream failed", exc_info=exc)
            try:
                write_frame(conn, ERROR, error_body(code, message))
            except OSError:
                pass
        finally:
            if answers is not None:
                answers.close()  # the sessions opened on the stream end with it
            with self._lock:
                self._connections.discard(conn)
            reader.close()
            conn.close()

    def close(self) -> None:
        """Stop listening and end the streams open on it (their coordinators see UNAVAILABLE)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections = list(self._connections)
        for conn in connections:
            _shut(conn)
        _shut(self._listener)
        self._listener.close()
        shutil.rmtree(self._directory, ignore_errors=True)


def _messages(reader) -> Iterator[bytes]:
    """The batch messages of a connection, until it closes."""
    while True:
        try:
            kind, body = read_frame(reader)
        except StreamClosed:
            return
        if kind != MESSAGE:
            raise ValueError(f"unexpected frame {kind!r} on the step socket")
        yield body


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


# The coordinator's end.


class SocketCall:
    """The coordinator's side of one stream over the socket: `send(bytes)`, `recv()` -> bytes; an error
    frame or a closed connection raises grpc-like (code, details) as StepStreamError."""

    def __init__(self, path: str, token: str, owner: str):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect(path)
            write_frame(self._sock, HELLO, hello_body(token, owner))
        except OSError:
            self._sock.close()
            raise
        self._reader = self._sock.makefile("rb")

    def send(self, body: bytes) -> None:
        try:
            write_frame(self._sock, MESSAGE, body)
        except OSError:
            pass  # the service is gone: the next recv() says so

    def recv(self) -> bytes:
        try:
            kind, body = read_frame(self._reader)
        except (StreamClosed, OSError):
            raise StepStreamError(grpc.StatusCode.UNAVAILABLE, "the step stream's socket closed") from None
        if kind == ERROR:
            error = json.loads(body)
            raise StepStreamError(code_of(error["code"]), error["message"])
        return body

    def cancel(self) -> None:
        """End the stream: a recv() waiting on it returns at once (the socket closes when dropped)."""
        _shut(self._sock)


class StepStreamError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details
