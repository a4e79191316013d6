"""Feature transports: how a step's target features F [n, 3H] get from the target to the draft.

    grpc      inline bytes in the session streams, relayed by the coordinator (works anywhere)
    shm       POSIX shared memory ring on one host (CPU tensors)
    cuda-ipc  a CUDA ring the target exports once and the draft maps once (same node)
    nccl      point-to-point in a two-rank torch.distributed group (NCCL for CUDA, gloo for CPU)

With a fast path the target writes the rows itself and the session stream carries only a
FeatureRef (a few dozen bytes), so the coordinator relays ids and descriptors, never features.
The coordinator brokers a start-up handshake (coordinator/handshake.py): it compares both ends'
TransportCaps, picks one (negotiate.py), and has the target open it and the draft attach.

This package's __init__ and negotiate.py are torch-free (the coordinator imports them); the
transport modules import torch and are loaded only by the target and the draft.
"""

from tandem.transports.negotiate import CHOICES, TRANSPORTS, Choice, TransportMismatch, negotiate

__all__ = ["CHOICES", "TRANSPORTS", "Choice", "TransportMismatch", "negotiate"]
