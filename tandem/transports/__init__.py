"""Feature transports: how a step's target features F [n, 3H] get from the target to the draft.

    grpc      inline bytes in the session streams, relayed by the coordinator (works anywhere)
    shm       POSIX shared memory ring on one host (CPU tensors)
    cuda-ipc  a CUDA ring the target exports once and the draft maps once (same node)
    nccl      point-to-point in a two-rank torch.distributed group (NCCL for CUDA, gloo for CPU)

With a fast path the target writes the rows itself and the session stream carries only a
FeatureRef (a few dozen bytes), so the coordinator relays ids and descriptors, never features.
The coordinator brokers a start-up handshake (coordinator/handshake.py): it compares both ends'
TransportCaps, picks one (negotiate.py), and has the target open it and the draft attach.

The modules, each importing only those above it:

    contract.py    the FeatureSender / FeatureReceiver protocols, TransportError, check_ref
    negotiate.py   which transport two ends share (rules on TransportCaps)
    caps.py        what this process can run (its TransportCaps)
    ring.py        the first-fit ring allocator shm and cuda-ipc share
    grpc.py, shm.py, cuda_ipc.py, nccl.py   one transport each
    endpoints.py   each service's end: the factory that opens a plan's transport, the one in use

This package's __init__, contract.py, negotiate.py and caps.py import no torch (the coordinator
imports them); the transport modules import torch and are loaded only by the target and the draft.
"""

from tandem.transports.negotiate import CHOICES, TRANSPORTS, Choice, TransportMismatch, negotiate

__all__ = ["CHOICES", "TRANSPORTS", "Choice", "TransportMismatch", "negotiate"]
