"""Which feature transport a target and a draft share: plain rules on both ends' TransportCaps (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.pairing import PairMismatch
from tandem.v1 import common_pb2

TRANSPORTS = ("grpc", "shm", "cuda-ipc", "nccl")
CHOICES = ("auto", *TRANSPORTS)
# auto's order: fastest first. cuda-ipc copies once on the GPUs of one node; nccl crosses GPUs
# anywhere; shm costs a host copy on each side; grpc adds serialization and the coordinator hop.
AUTO_ORDER = ("cuda-ipc", "nccl", "shm")


class TransportMismatch(PairMismatch):
    """The two ends cannot agree on the feature path; the message names the field."""


@dataclass(frozen=True)
class Choice:
    transport: str
    reason: str
    fallback: bool = False  # an explicit choice could not be honoured: grpc instead (warn)


def _on_cuda(caps: common_pb2.TransportCaps) -> bool:
    return caps.device.startswith("cuda")


def why_not(transport: str, target: common_pb2.TransportCaps, draft: common_pb2.TransportCaps) -> str | None:
    """None when both ends can use `transport`, else the reason they cannot."""
    for end, caps in (("target", target), ("draft", draft)):
        if transport not in caps.available:
            return f"the {end} ({caps.device or 'unknown device'}) cannot run {transport}"
    same_host = bool(target.host_id) and target.host_id == draft.host_id
    if transport in ("shm", "cuda-ipc") and not same_host:
        return f"{transport} needs both on one host (and IPC namespace); target {target.host_id}, draft {draft.host_id}"
    if transport == "cuda-ipc" and not (_on_cuda(target) and _on_cuda(draft)):
        return "cuda-ipc needs both on CUDA devices"
    if transport == "cuda-ipc" and draft.visible_uuids and target.device_uuid not in draft.visible_uuids:
        # one host and one IPC namespace (compose's `ipc: host`), but a container sees only its own GPUs
        return (f"the draft cannot see the target's GPU {target.device_uuid or '?'} (it sees "
                f"{', '.join(draft.visible_uuids)}), so it cannot map the target's ring")
    if transport == "nccl":
        if _on_cuda(target) != _on_cuda(draft):
            return "nccl needs both on CUDA (NCCL) or both on the CPU (gloo)"
        if _on_cuda(target) and target.device_uuid and target.device_uuid == draft.device_uuid:
            return "NCCL refuses two ranks on one GPU (use cuda-ipc there)"
    return None


def negotiate(target: common_pb2.TransportCaps, draft: common_pb2.TransportCaps) -> Choice:
    """The transport both ends use, or TransportMismatch naming the one field they disagree on.

    An end set to `auto` follows the other's explicit choice; `auto` on both picks the fastest
    both support. An explicit choice that cannot run here falls back to grpc (Choice.fallback)."""
    return candidates(target, draft)[0]


def candidates(target: common_pb2.TransportCaps, draft: common_pb2.TransportCaps) -> list[Choice]:
    """Every transport to try, in order (the handshake sets up the first and, when that fails, the next):
    the fastest both ends support first, grpc last. TransportMismatch as in `negotiate`."""
    for field, what in (("dtype", "feature dtype"), ("feature_width", "feature width")):
        t, d = getattr(target, field), getattr(draft, field)
        if t and d and t != d:
            raise TransportMismatch(f"transport handshake: {what} differs: the target sends {t}, the draft expects {d}")
    t_req, d_req = target.requested or "auto", draft.requested or "auto"
    if "auto" not in (t_req, d_req) and t_req != d_req:
        raise TransportMismatch(
            f"transport handshake: transport differs: the target is set to {t_req}, the draft to {d_req} "
            f"(give both the same --transport, or auto)"
        )
    wanted = d_req if t_req == "auto" else t_req
    if wanted == "grpc":
        return [Choice("grpc", "requested")]
    if wanted != "auto":
        problem = why_not(wanted, target, draft)
        if problem is None:
            return [Choice(wanted, "requested"), Choice("grpc", f"{wanted} failed to set up", fallback=True)]
        return [Choice("grpc", f"{wanted} was requested but {problem}", fallback=True)]
    fits, skipped = [], []
    for transport in AUTO_ORDER:
        problem = why_not(transport, target, draft)
        if problem is None:
            if transport == "nccl" and not _on_cuda(target):
                skipped.append("nccl over gloo is slower than shared memory on one host")
                continue  # auto takes gloo only where nothing else is faster
            which = "the next fastest both ends support" if fits else "the fastest both ends support"
            fits.append(Choice(transport, f"auto: {which}" + (f" ({'; '.join(skipped)})" if skipped else "")))
        else:
            skipped.append(problem)
    why = "no other fast path fits" if fits else "no fast path fits"
    return [*fits, Choice("grpc", f"auto: {why} (" + "; ".join(skipped) + ")" if skipped else f"auto: {why}")]
