"""The ring the ring transports (shm, cuda-ipc) share: a first-fit allocator over a preallocated
arena, what each session holds in it, and the target end that writes a step into its own range."""

from __future__ import annotations

import itertools
import logging
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING

from tandem.dtypes import name_of
from tandem.transports.contract import count
from tandem.v1 import common_pb2

if TYPE_CHECKING:
    import torch

    from tandem.traffic import Traffic

log = logging.getLogger("tandem.transports")


class Ring:
    """Byte ranges of a fixed arena, handed out first-fit and freed in any order (sessions end out of order).

    Bounded twice: by bytes, and by `max_inflight` live allocations (the CUDA events are a pool of
    that size). Thread-safe."""

    ALIGN = 256  # keeps every row block aligned for vectorized copies and the int64 stamp

    def __init__(self, size: int, max_inflight: int):
        self.size = size
        self._free: list[list[int]] = [[0, size]]  # sorted [start, length]
        self._slots = list(range(max_inflight))  # free event/slot indices
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> tuple[int, int] | None:
        """(offset, slot index), or None when no range or slot is free."""
        need = -(-max(nbytes, 1) // self.ALIGN) * self.ALIGN
        with self._lock:
            if not self._slots:
                return None
            for i, (start, length) in enumerate(self._free):
                if length >= need:
                    if length == need:
                        del self._free[i]
                    else:
                        self._free[i] = [start + need, length - need]
                    return start, self._slots.pop()
        return None

    def free(self, offset: int, nbytes: int, slot: int) -> None:
        need = -(-max(nbytes, 1) // self.ALIGN) * self.ALIGN
        with self._lock:
            self._slots.append(slot)
            self._free.append([offset, need])
            self._free.sort()
            merged = [self._free[0]]
            for start, length in self._free[1:]:
                if merged[-1][0] + merged[-1][1] == start:
                    merged[-1][1] += length
                else:
                    merged.append([start, length])
            self._free = merged

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(length for _, length in self._free)


class Held:
    """What each session holds in a ring, oldest step first, until it is freed; thread-safe."""

    def __init__(self) -> None:
        self._by_session: dict[str, list[tuple]] = {}
        self._lock = threading.Lock()

    def add(self, session_id: str, item: tuple) -> None:
        with self._lock:
            self._by_session.setdefault(session_id, []).append(item)

    def take(self, session_id: str, keep: int = 0) -> list[tuple]:
        """The session's steps but its last `keep`, which it goes on holding."""
        with self._lock:
            held = self._by_session.pop(session_id, [])
            if keep and held[-keep:]:
                self._by_session[session_id] = held[-keep:]
            return held[: max(len(held) - keep, 0)]

    def take_all(self) -> list[tuple]:
        with self._lock:
            items = [item for held in self._by_session.values() for item in held]
            self._by_session.clear()
            return items


class RingSender:
    """The target end of a ring transport (shm, cuda-ipc): each step gets its own range of the ring
    and a sequence number, held by its session until the session is two steps on, or ends.

    Why two: the draft reads step r's features either in the propose of round r+1, answered before
    verify r+1 is sent, or (overlap) in the ahead step it runs beside verify r+1, which the coordinator
    waits for before it sends verify r+2. So step r may still be read while step r+1 is sent, never
    once step r+2 is: freeing at r+1 handed a range the draft was about to read straight back to the
    next write (first fit), and cuda-ipc, which has no stamp, read the other step's rows.

    Subclasses write the rows (`_write`) and mark a freed range (`_unstamp`) so that a late reader
    can tell its rows are gone."""

    name = ""
    STAMP = 0  # bytes in front of each step's rows for its sequence number
    KEEP = 1  # steps before the newest a session goes on holding (see above)

    def __init__(self, plan: common_pb2.TransportPlan, traffic: Traffic | None):
        self.channel = plan.channel
        self.ring = Ring(plan.ring_bytes, plan.max_inflight)
        self.held = Held()
        self.traffic = traffic
        self._seq = itertools.count(1)
        self._users = 0  # sessions writing right now; close() waits for them
        self._closed = False
        self._idle = threading.Condition()
        self._timeout = plan.timeout or 10.0

    @contextmanager
    def _use(self):
        with self._idle:
            if self._closed:
                yield False
                return
            self._users += 1
        try:
            yield True
        finally:
            with self._idle:
                self._users -= 1
                self._idle.notify_all()

    def start(self, timeout: float) -> None:
        pass  # the draft mapped the ring already: nothing to wait for

    def send(self, session_id: str, features: torch.Tensor, ready=None) -> common_pb2.FeatureRef | None:
        """`ready`: a CUDA event recorded when the rows were computed (None: the caller's stream has them)."""
        with self._use() as usable:
            self._free(self.held.take(session_id, keep=self.KEEP))  # the draft is done with all but the last
            if not usable:
                return None
            rows, width = features.shape
            nbytes = self.STAMP + features.numel() * features.element_size()
            got = self.ring.alloc(nbytes)
            if got is None:
                log.debug("%s ring full (%d bytes free): step of %d rows inline", self.name, self.ring.free_bytes, rows)
                return None
            offset, slot = got
            sequence = next(self._seq)
            self.held.add(session_id, (offset, nbytes, slot))
            self._write(offset, slot, sequence, features, ready)
            count(self.traffic, "sent", self.name, features)
            return common_pb2.FeatureRef(
                transport=self.name, channel=self.channel, sequence=sequence, offset=offset, rows=rows,
                width=width, dtype=name_of(features.dtype), event=slot,
            )

    def release(self, session_id: str) -> None:
        with self._use():
            self._free(self.held.take(session_id))

    def _free(self, items: list[tuple]) -> None:
        for offset, nbytes, slot in items:
            self._unstamp(offset)
            self.ring.free(offset, nbytes, slot)

    def close(self) -> None:
        with self._idle:
            self._closed = True
            self._idle.wait_for(lambda: self._users == 0, timeout=self._timeout)
        self.held.take_all()
        self._release_ring()

    def _write(self, offset: int, slot: int, sequence: int, features: torch.Tensor, ready) -> None:
        raise NotImplementedError

    def _unstamp(self, offset: int) -> None:
        pass

    def _release_ring(self) -> None:
        pass
