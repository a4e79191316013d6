"""The feature-path handshake, brokered by the coordinator (it already reads both services' ModelInfo).

    negotiate(TargetInfo.transport, DraftInfo.transport)  -> transport and why, or TransportMismatch
    target.OpenTransport(plan)   the target prepares it (ring, rendezvous) and fills in the plan
    draft.OpenTransport(plan)    the draft checks the plan (TransportMismatch by field) and attaches
    target.StartTransport(plan)  the target switches from inline gRPC to it

A transport that cannot be set up (unavailable, a failed rendezvous, an old service without the
RPCs) falls back to grpc with a warning: features then go inline, as before. A mismatch in what
both ends were configured with is one clear error, like a draft that does not fit the target.
No torch here.
"""

from __future__ import annotations

import logging

import grpc

from tandem.transports.negotiate import TransportMismatch, negotiate
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

log = logging.getLogger("tandem.coordinator")

# Opening covers a rendezvous, a warm-up exchange (NCCL's first send is slow) and mapping a ring.
HANDSHAKE_TIMEOUT = 60.0


def connect_transport(
    target: target_pb2_grpc.TargetServiceStub, target_info: target_pb2.TargetInfo,
    draft: draft_pb2_grpc.DraftServiceStub, draft_info: draft_pb2.DraftInfo,
) -> str:
    """Agree on a feature path and set it up; returns the transport in use. TransportMismatch on a mismatch."""
    if not target_info.HasField("transport") or not draft_info.HasField("transport"):
        return "grpc"  # a service from before the fast paths: inline, as it always was
    choice = negotiate(target_info.transport, draft_info.transport)
    (log.warning if choice.fallback else log.info)("feature transport: %s (%s)", choice.transport, choice.reason)
    plan = common_pb2.TransportPlan(transport=choice.transport, reason=choice.reason)
    try:
        plan = target.OpenTransport(plan, timeout=HANDSHAKE_TIMEOUT)
        draft.OpenTransport(plan, timeout=HANDSHAKE_TIMEOUT)
        target.StartTransport(plan, timeout=HANDSHAKE_TIMEOUT)
        return plan.transport
    except grpc.RpcError as exc:
        if plan.transport == "grpc":
            return "grpc"  # nothing to fall back from (an old service without the RPCs)
        if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "handshake:" in (exc.details() or ""):
            raise TransportMismatch(exc.details()) from None
        log.warning("feature transport %s could not be set up (%s: %s): features go over grpc",
                    plan.transport, exc.code().name, exc.details())
    fallback = common_pb2.TransportPlan(transport="grpc", reason=f"{plan.transport} failed to set up")
    try:
        fallback = target.OpenTransport(fallback, timeout=HANDSHAKE_TIMEOUT)
        draft.OpenTransport(fallback, timeout=HANDSHAKE_TIMEOUT)
        target.StartTransport(fallback, timeout=HANDSHAKE_TIMEOUT)
    except grpc.RpcError as exc:
        log.warning("could not switch the feature path back to grpc: %s", exc.details())
    return "grpc"
