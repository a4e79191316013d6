#!/usr/bin/env python3
"""A grpc.health.v1 probe for container healthchecks: exit 0 when the service is SERVING, 1 otherwise.

    tandem-healthcheck 127.0.0.1:50051                       # overall health of the process
    tandem-healthcheck 127.0.0.1:50050 --service tandem.v1.Coordinator
    tandem-healthcheck 127.0.0.1:50051 --ca ca.pem --cert cert.pem --key key.pem   # TLS, mutual with a cert

The images install this file as `tandem-healthcheck`. It needs only grpcio and grpcio-health-checking
(no torch, no tandem import), so a check costs one short-lived interpreter, not a model load.
A service answers NOT_SERVING while its model loads and while it drains on SIGTERM, so "unhealthy"
during start-up is covered by the compose file's start_period.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def channel(address: str, ca: str | None = None, cert: str | None = None, key: str | None = None) -> grpc.Channel:
    """Plain, or TLS checked against `ca` (mutual with `cert` and `key`), as tandem/security.py makes them."""
    if ca is None:
        return grpc.insecure_channel(address)
    def read(path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return grpc.secure_channel(address, grpc.ssl_channel_credentials(read(ca), read(key), read(cert)))


def probe(address: str, service: str = "", timeout: float = 3.0, ca: str | None = None, cert: str | None = None,
          key: str | None = None) -> str:
    """The service's status name ("SERVING", "NOT_SERVING", ...) or "UNREACHABLE"."""
    with channel(address, ca, cert, key) as channel_:
        try:
            response = health_pb2_grpc.HealthStub(channel_).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as exc:
            return f"UNREACHABLE ({exc.code().name})"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem-healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("address", metavar="HOST:PORT")
    parser.add_argument("--service", default="", help="a gRPC service name (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    parser.add_argument("--ca", help="TLS: the CA of the service's certificate (PEM)")
    parser.add_argument("--cert", help="mutual TLS: this client's certificate (PEM), with --key")
    parser.add_argument("--key", help="mutual TLS: the key of --cert (PEM)")
    args = parser.parse_args(argv)
    status = probe(args.address, args.service, args.timeout, args.ca, args.cert, args.key)
    print(f"{args.address} {args.service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
