"""The feature-path handshake, brokered by the coordinator (it already reads both services' ModelInfo).

    candidates(TargetInfo.transport, DraftInfo.transport)  -> transports to try and why, or TransportMismatch
    target.OpenTransport(plan)   the target prepares it (ring, rendezvous) and fills in the plan
    draft.OpenTransport(plan)    the draft checks the plan (TransportMismatch by field) and attaches
    target.StartTransport(plan)  the target switches from inline gRPC to it

A transport that cannot be set up (a ring the draft cannot map, a failed rendezvous) makes way for
the next one both ends support, and at the end for grpc, with a warning: features then go inline,
as before (so does an old service without the RPCs). A mismatch in what
both ends were configured with is one clear error, like a draft that does not fit the target.
No torch here.
"""

from __future__ import annotations

import logging

import grpc

from tandem.transports.negotiate import TransportMismatch, candidates
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

log = logging.getLogger("tandem.coordinator")

# Opening covers a rendezvous, a warm-up exchange (NCCL's first send is slow) and mapping a ring.
HANDSHAKE_TIMEOUT = 60.0


def connect_transport(
    target: target_pb2_grpc.TargetServiceStub, target_info: target_pb2.TargetInfo,
    draft: draft_pb2_grpc.DraftServiceStub, draft_info: draft_pb2.DraftInfo,
) -> str:
    """Agree on a feature path and set it up; returns the transport in use. TransportMismatch on a mismatch.

    A fast path that fails to set up (a ring the draft cannot map, a rendezvous that does not form)
    makes way for the next one both ends support, then for grpc."""
    if not target_info.HasField("transport") or not draft_info.HasField("transport"):
        return "grpc"  # a service from before the fast paths: inline, as it always was
    choices = candidates(target_info.transport, draft_info.transport)
    failed: list[str] = []
    for choice in choices:
        if choice.transport == "grpc":
            break
        reason = choice.reason + (f"; after {'; '.join(failed)}" if failed else "")
        log.info("feature transport: %s (%s)", choice.transport, reason)
        plan = common_pb2.TransportPlan(transport=choice.transport, reason=reason)
        try:
            plan = target.OpenTransport(plan, timeout=HANDSHAKE_TIMEOUT)
            draft.OpenTransport(plan, timeout=HANDSHAKE_TIMEOUT)
            target.StartTransport(plan, timeout=HANDSHAKE_TIMEOUT)
            return plan.transport
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "handshake:" in (exc.details() or ""):
                raise TransportMismatch(exc.details()) from None
            log.warning("feature transport %s could not be set up (%s: %s)", choice.transport, exc.code().name,
                        exc.details())
            failed.append(f"{choice.transport} failed to set up ({exc.code().name}: {exc.details()})")
    last = choices[-1]
    reason = "; ".join(failed) if failed else last.reason
    (log.warning if failed or last.fallback else log.info)("feature transport: grpc (%s)", reason)
    # grpc too goes through the RPCs: the target closes whatever it opened and did not start
    fallback = common_pb2.TransportPlan(transport="grpc", reason=reason)
    try:
        fallback = target.OpenTransport(fallback, timeout=HANDSHAKE_TIMEOUT)
        draft.OpenTransport(fallback, timeout=HANDSHAKE_TIMEOUT)
        target.StartTransport(fallback, timeout=HANDSHAKE_TIMEOUT)
    except grpc.RpcError as exc:
        if failed:
            log.warning("could not switch the feature path back to grpc: %s", exc.details())
        # else: an old service without the RPCs: inline, as it always was
    return "grpc"
