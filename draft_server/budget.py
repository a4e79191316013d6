"""The draft's KV budget: the committed pairs all sessions together may keep, and what sizes it.

A session holds one token of the budget per committed pair in its KV (DraftKV: every layer's keys and values
at that position); a rollout's positions and a P-EAGLE head's masked ones are dropped at the end of their
step, so they are working memory, not the budget's. A propose or an ahead that would take a session past what
is left is refused with ResourceExhausted, that step alone (the coordinator then runs its request target-only:
the draft is lost); a session's tokens come back when it is released, evicted or its stream ends.

The budget's size (`kv_tokens`): a setting, else on a GPU what is free after loading less a margin and a
measured propose's working memory, each token counted with the copies a batched step makes of it, and on a
CPU half the host's available memory.
"""

from __future__ import annotations

import threading

import torch

from tandem.memory import GIB, GPU_MARGIN, asked_tokens, gpu_headroom, gpu_part, half_the_host, room
from tandem.params import MAX_DRAFT_TOKENS
from tandem.service import StartupError
from tandem.sessions import ResourceExhausted, SessionOwner

# Per token of the budget, the memory a batch can hold of it at once: the session's own KV, its copy in the batch
# buffers (batch.BatchBuffers, left-padded, kept from step to step and at least doubled when they grow).
KV_COPIES = 3
# The probe propose that measures a step's working memory on a GPU: a first propose of this many pairs (the
# target's default --max-batch-tokens, the longest prompt it prefills in one forward) and the most drafts.
PROBE_PAIRS = 4096


class DraftKVBudget:
    """The draft KV tokens all sessions together may hold (`tokens` None: unbounded), and each one's share."""

    def __init__(self, tokens: int | None = None):
        self.tokens = tokens
        self.used = 0
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()  # releases come from the service threads

    def take(self, session_id: str, n: int) -> None:
        """n more committed pairs for the session, or ResourceExhausted naming it, n and what is left."""
        with self._lock:
            if self.tokens is not None and self.used + n > self.tokens:
                raise ResourceExhausted(f"draft session {session_id!r} asks for {n} KV tokens; "
                                        f"{self.tokens - self.used} of the draft's KV budget of {self.tokens} are left")
            self.used += n
            self._held[session_id] = self._held.get(session_id, 0) + n

    def give_back(self, session_id: str) -> None:
        with self._lock:
            self.used -= self._held.pop(session_id, 0)

    def held(self, session_id: str) -> int:
        return self._held.get(session_id, 0)


class BudgetedSessions(SessionOwner):
    """The draft engine's session surface: a session's KV tokens go back to the budget when it ends."""

    kv_budget: DraftKVBudget

    def take_kv(self, session_id: str, n: int, opened: bool) -> None:
        """The step's n new pairs from the budget, or ResourceExhausted; a session this step opened is dropped
        with its refusal, leaving nothing behind."""
        try:
            self.kv_budget.take(session_id, n)
        except ResourceExhausted:
            if opened:
                self.sessions.pop(session_id)
            raise

    def release(self, session_id: str) -> bool:
        self.kv_budget.give_back(session_id)
        return super().release(session_id)

    def evict_idle(self, ttl: float) -> list[str]:
        evicted = super().evict_idle(ttl)
        for session_id in evicted:
            self.kv_budget.give_back(session_id)
        return evicted


def kv_bytes_per_token(engine) -> int:
    """Draft KV bytes one committed pair takes: keys and values of every decoder layer."""
    attention = engine.model.midlayer.self_attn
    itemsize = torch.empty(0, dtype=engine.dtype).element_size()
    return 2 * engine.config.num_layers * attention.num_kv_heads * attention.head_dim * itemsize


def draft_kv_budget_tokens(headroom: int, total: int, bytes_per_token: int, working_bytes: int,
                           margin: float = GPU_MARGIN) -> int:
    """The draft KV tokens that fit in `headroom`, the bytes the draft may still take on its GPU (tandem/memory.py):
    less a margin of the GPU's `total` and a step's working memory, each token KV_COPIES times."""
    usable = headroom - margin * total - working_bytes
    return max(int(usable // (bytes_per_token * KV_COPIES)), 0)


def gpu_kv_tokens(free: int, total: int, own: int, bytes_per_token: int, working_bytes: int, shared: bool,
                  asked: int | None = None) -> int:
    """The budget of a draft on a GPU from its figures: `asked` (a setting, in tokens) if it fits, else all that
    fits; StartupError naming the figures where nothing (or less than asked) fits."""
    headroom = gpu_headroom(free, total, own, gpu_part("draft", shared))
    fits = draft_kv_budget_tokens(headroom, total, bytes_per_token, working_bytes)
    if fits < 1 or (asked is not None and asked > fits):
        raise StartupError(
            f"the draft KV cache does not fit: {room('draft', free, total, own, shared)}; a propose takes "
            f"{working_bytes / GIB:.2f} GiB, {GPU_MARGIN:.0%} of the GPU is kept back, and each KV token "
            f"{bytes_per_token} bytes x {KV_COPIES}: room for "
            f"{fits} tokens" + (f", --kv-cache-gib asks for {asked}" if asked is not None else ""))
    return asked if asked is not None else fits


def measure_working_bytes(engine) -> int:
    """GPU memory one propose takes beyond the KV it keeps: a probe session's first propose of PROBE_PAIRS
    pairs and MAX_DRAFT_TOKENS drafts, measured as the target measures its forward, then released."""
    device = engine.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    n = min(PROBE_PAIRS, max(engine.max_context - MAX_DRAFT_TOKENS, 1)) if engine.max_context else PROBE_PAIRS
    probe = "\0probe"  # no client's id: the servicer's ids come from the coordinator
    engine.propose(probe, torch.zeros(n, engine.feature_size), [0] * n, MAX_DRAFT_TOKENS, create=True)
    kept = engine.kv_budget.held(probe) * kv_bytes_per_token(engine)
    engine.release(probe)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base - kept
    torch.cuda.empty_cache()
    return max(peak, 0)


def kv_tokens(engine, kv_cache_gib: float | None, shared_gpu: bool) -> int | None:
    """The draft's KV budget in tokens: `kv_cache_gib`, checked against what fits on a GPU; unset, all that fits
    on a GPU (its part of one it shares with the target), or half the host's available memory on a CPU."""
    per_token = kv_bytes_per_token(engine)
    asked = asked_tokens(kv_cache_gib, per_token)
    if engine.device.type != "cuda":
        return asked if asked is not None else half_the_host(per_token)
    working = measure_working_bytes(engine)
    free, total = torch.cuda.mem_get_info(engine.device)
    return gpu_kv_tokens(free, total, torch.cuda.memory_allocated(engine.device), per_token, working, shared_gpu,
                         asked)
