"""The inline path: every step's features travel in the session streams (tandem/wire.py's chunks),
relayed by the coordinator. Always available; what every fast path falls back to."""

from __future__ import annotations


class GrpcSender:
    name = "grpc"

    def send(self, session_id, features, ready=None):
        return None  # None: the service encodes the step inline

    def start(self, timeout: float) -> None:
        pass

    def release(self, session_id: str) -> None:
        pass

    def close(self) -> None:
        pass
