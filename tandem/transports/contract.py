"""The transport contract: what a target's sender and a draft's receiver do, and how they fail.

Target side, one FeatureSender per process, called from every session's thread:

    send(session_id, features [n, 3H], ready) -> FeatureRef | None   None: send this step inline (gRPC)
    release(session_id)                                       the session ended: free what it holds
    close()

`ready` is the CUDA event the engine recorded at the end of the batch that computed the rows (None on
a CPU): a fast path reads them on its own stream once the GPU is past it, never behind the engine's
next forward, and nothing on the send path waits for the GPU.

Draft side, one FeatureReceiver:

    recv(ref, consumer) -> features [n, 3H]   TransportError when the rows are gone, late or never came

`consumer` is the CUDA stream that reads the rows (the draft engine's, named by the caller, never taken
from the thread): it waits GPU-side for the copy or the receive that brings them, and nothing else.

A step's buffer is freed when its session is two steps on (the draft may read step r beside verify
r+1, with overlap, but has answered the step that read it before verify r+2) or ends. A full ring or queue sends the step
inline rather than wait: no session ever blocks on the draft.

No torch at import: the coordinator maps these errors to status codes (tandem/errors.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from tandem.dtypes import DTYPES
from tandem.v1 import common_pb2

if TYPE_CHECKING:
    import torch

    from tandem.traffic import Traffic

LINK = "target->draft"


class TransportError(RuntimeError):
    """A fast path could not deliver a step (gone, stale, timed out, broken)."""


class NoChannel(TransportError):
    """A descriptor names a channel this process has not opened (it restarted): the handshake must run again."""


class FeatureSender(Protocol):
    name: str

    def send(self, session_id: str, features: torch.Tensor, ready=None) -> common_pb2.FeatureRef | None: ...
    def release(self, session_id: str) -> None: ...
    def close(self) -> None: ...


class FeatureReceiver(Protocol):
    name: str
    channel: str

    def recv(self, ref: common_pb2.FeatureRef, consumer=None) -> torch.Tensor: ...
    def close(self) -> None: ...


def count(traffic: Traffic | None, direction: str, transport: str, features: torch.Tensor) -> None:
    """Feature bytes that went over a fast path, on the target->draft link under the transport's label."""
    if traffic is not None:
        nbytes = features.numel() * features.element_size()
        traffic.add(direction, LINK, transport, features=nbytes, feature_rows=features.shape[0])


def check_ref(ref: common_pb2.FeatureRef, channel: str, max_rows: int | None = None) -> None:
    if ref.channel != channel:
        raise NoChannel(f"feature descriptor for channel {ref.channel!r}; this draft has {channel!r} open")
    if ref.rows < 0 or ref.width <= 0 or ref.dtype not in DTYPES or (max_rows is not None and ref.rows > max_rows):
        raise TransportError(f"bad feature descriptor: {ref.rows} rows x {ref.width} of {ref.dtype!r}")


def consumer_stream(consumer, device: torch.device):
    """The stream that reads a received step: the caller's, else this thread's current one on `device`."""
    import torch

    return consumer if consumer is not None else torch.cuda.current_stream(device)
