#!/usr/bin/env python3
"""A grpc.health.v1 probe for container healthchecks: exit 0 when the service is SERVING, 1 otherwise.

    tandem-healthcheck 127.0.0.1:50051                       # overall health of the process
    tandem-healthcheck 127.0.0.1:50050 --service tandem.v1.Coordinator

The images install this file as `tandem-healthcheck`. It needs only grpcio and grpcio-health-checking
(no torch, no tandem import), so a check costs one short-lived interpreter, not a model load.
A service answers NOT_SERVING while its model loads and while it drains on SIGTERM, so "unhealthy"
during start-up is covered by the compose file's start_period.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def probe(address: str, service: str = "", timeout: float = 3.0) -> str:
    """The service's status name ("SERVING", "NOT_SERVING", ...) or "UNREACHABLE"."""
    with grpc.insecure_channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
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
    args = parser.parse_args(argv)
    status = probe(args.address, args.service, args.timeout)
    print(f"{args.address} {args.service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
