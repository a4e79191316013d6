"""The per-session state table both engines keep, and the two errors a step can raise."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar


class SessionNotFound(KeyError):
    """An unknown, released or evicted session id."""


class InvalidRequest(ValueError):
    """A request the model cannot take (the message names what is wrong)."""


class ResourceExhausted(RuntimeError):
    """The engine has no room for the request now (its KV budget is taken); a retry later may pass."""


class _Touchable(Protocol):
    last_used: float


S = TypeVar("S", bound=_Touchable)


class SessionTable(Generic[S]):
    """Sessions by id, with the time of their last step so that idle ones can be evicted."""

    def __init__(self, owner: str):
        self.owner = owner  # "target" or "draft", for messages
        self._sessions: dict[str, S] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def ids(self) -> list[str]:
        return list(self._sessions)

    def add(self, session_id: str, session: S) -> S:
        with self._lock:
            if session_id in self._sessions:
                raise InvalidRequest(f"{self.owner} session {session_id!r} already exists")
            self._sessions[session_id] = session
        return session

    def get(self, session_id: str) -> S:
        try:
            session = self._sessions[session_id]
        except KeyError:
            raise SessionNotFound(f"unknown {self.owner} session {session_id!r}") from None
        session.last_used = time.monotonic()
        return session

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def release(self, session_id: str) -> bool:
        return self.pop(session_id) is not None

    def pop(self, session_id: str) -> S | None:
        with self._lock:
            return self._sessions.pop(session_id, None)

    def evict_idle(self, ttl: float) -> list[str]:
        """Drop the sessions no step has touched for `ttl` seconds (their client hung or vanished)."""
        return list(self.evict_idle_items(ttl))

    def evict_idle_items(self, ttl: float) -> dict[str, S]:
        cutoff = time.monotonic() - ttl
        with self._lock:
            stale = [sid for sid, session in self._sessions.items() if session.last_used < cutoff]
            return {sid: self._sessions.pop(sid) for sid in stale}


class SessionOwner:
    """The session surface the services use, for an engine whose table is `self.sessions`."""

    sessions: SessionTable

    @property
    def num_sessions(self) -> int:
        return len(self.sessions)

    def session_ids(self) -> list[str]:
        return self.sessions.ids()

    def release(self, session_id: str) -> bool:
        return self.sessions.release(session_id)

    def evict_idle(self, ttl: float) -> list[str]:
        return self.sessions.evict_idle(ttl)


def build_batch(steps: Sequence, build: Callable, refused: tuple[type[Exception], ...] = ()) -> tuple[list, list]:
    """An engine's batch: each step built by `build(step)`, or refused alone (InvalidRequest, SessionNotFound,
    `refused`; a second step of one session too). -> (a result per step, the refusals in place; the built
    steps as (index, built))."""
    results: list = [None] * len(steps)
    built: list = []
    seen: set[str] = set()
    for i, step in enumerate(steps):
        try:
            if step.session_id in seen:
                raise InvalidRequest(f"two steps of session {step.session_id!r} in one batch")
            seen.add(step.session_id)
            built.append((i, build(step)))
        except (InvalidRequest, SessionNotFound, *refused) as exc:
            results[i] = exc
    return results, built
