"""What this process can run: the TransportCaps each end offers at the handshake."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from tandem.v1 import common_pb2


def host_id() -> str:
    """Equal for two processes that can share memory: same boot and same IPC namespace (containers
    need `ipc: host` or a shared IPC namespace for shm and CUDA IPC)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    try:
        ipc = os.readlink("/proc/self/ns/ipc")
    except OSError:
        ipc = ""
    return f"{boot.read_text().strip() if boot.is_file() else socket.gethostname()}/{ipc}"


def device_uuid(device: str) -> str:
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return ""
    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


def visible_uuids(device: str) -> list[str]:
    """The UUIDs of every GPU this process can see. A container sees only the GPUs given to it, so two
    containers on one host may share an IPC namespace and still not reach each other's GPU memory."""
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return []
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def available(device: str) -> list[str]:
    import torch

    found = ["grpc"]
    if Path("/dev/shm").is_dir():
        found.append("shm")
    on_cuda = device.startswith("cuda") and torch.cuda.is_available()
    if on_cuda:
        found.append("cuda-ipc")
    import torch.distributed as dist

    if dist.is_available() and (dist.is_nccl_available() if on_cuda else dist.is_gloo_available()):
        found.append("nccl")
    return found


def local_caps(requested: str, device: str, dtype: str, feature_width: int) -> common_pb2.TransportCaps:
    return common_pb2.TransportCaps(
        requested=requested, available=available(device), host_id=host_id(), device=device,
        device_uuid=device_uuid(device), dtype=dtype, feature_width=feature_width,
        visible_uuids=visible_uuids(device),
    )
