"""The round loop (docs/architecture.md, "One request, round by round"), written once against the two
backend contracts of tandem/protocol.py: the in-process generator plugs the engines in directly, the
coordinator plugs in its gRPC streams. Features are opaque here (a tensor in-process, relayed wire
chunks in the coordinator): the loop only moves them.

    prefill                       the target: t and the prompt's features
    repeat until a stop:
      k       = policy.k_for_round()          how many drafts this round (tandem/policy.py)
      tree    = policy.tree_for_round(k)      or a draft tree instead of the chain (EAGLE-2), where it pays
      drafts  = draft.draft(k, tree)          the draft session: d_1..d_k (sampled: with their q), or a
                                              tree's nodes with their parents
      verdict = target.verify(t, drafts)      accepted d_1..d_a (a tree's: its accepted path), bonus b,
                                              features of t, d_1..d_a
      commit                                  count, feed the draft the new pairs, t := b, emit
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from tandem.params import GenerationRequest, SamplingParams, TreeParams
from tandem.policy import KPolicy, Speculation
from tandem.protocol import (
    Branch,
    DraftBackend,
    Drafts,
    DraftUnavailable,
    Features,
    OverlapDraftBackend,
    Pending,
    TargetBackend,
    TokenLogprob,
)
from tandem.stats import GenerationStats

log = logging.getLogger("tandem.rounds")

FIXED_K = Speculation()  # the request's own K, every round: no load, no gate, no overlap


@dataclass
class RoundEvent:
    """Tokens committed since the last event; `finish_reason` is set on the last one."""

    new_tokens: list[int]
    stats: GenerationStats
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the sampling asked for them


@dataclass
class Stopper:
    limit: int  # max_new_tokens, or less when the context would run out first
    stop_ids: set[int] = field(default_factory=set)
    produced: int = 0

    def take(self, tokens: list[int]) -> tuple[list[int], str | None]:
        """Cut `tokens` at the first stop id (kept, as HF generate keeps EOS) or at max_new_tokens."""
        out: list[int] = []
        for token in tokens:
            out.append(token)
            self.produced += 1
            if token in self.stop_ids:
                return out, "stop"
            if self.produced >= self.limit:
                return out, "length"
        return out, None


class DraftSession:
    """One generation's session on the draft: opened by its first propose, lost or released once.

    It keeps the committed pairs (F_i, x_{i+1}) the draft has not seen yet and sends them with the
    next propose or ahead step. With overlap it also holds the ahead step under way (`pending`) and
    the drafts it prepared for this round (`ready`). A sampled request's session is opened with its
    sampling parameters: the draft draws its drafts from its own distribution and returns each one's q.
    """

    def __init__(self, backend: DraftBackend, session_id: str, overlap: bool,
                 sampling: SamplingParams | None = None):
        self.backend = backend
        self.session_id = session_id
        self.sampling = sampling if sampling is not None and not sampling.greedy else None
        self.alive = True  # until lost or released
        self.overlap = overlap and isinstance(backend, OverlapDraftBackend)
        self._open = False  # the draft holds the session: release it
        self._features: Features = None  # not yet sent, with the tokens after them
        self._tokens: list[int] = []
        self._pending: Pending | None = None  # an ahead under way
        self._ready: Drafts | None = None  # this round's drafts, prepared during the last verify

    def feed(self, features: Features, tokens: list[int]) -> None:
        """Newly committed pairs: `tokens[i]` follows the position of `features[i]`."""
        self._features, self._tokens = features, tokens

    def draft(self, k: int, ahead_branches: int = 0, tree: TreeParams | None = None) -> Drafts:
        """This round's k drafts: prepared during the last verify when there are some, else a propose.
        With `ahead_branches`, the draft then starts preparing the next round (answered in `settle`).
        With `tree`, a draft tree of that shape instead (never with overlap: ahead steps draft chains)."""
        ready, self._ready = self._ready, None
        if ready and ahead_branches and tree is None:
            drafts = ready.head(k)
        else:
            create, self._open = not self._open, True  # released even if this first call fails
            extra = {"sampling": self.sampling} if create and self.sampling is not None else {}
            if tree is not None:
                extra["tree"] = tree
            drafts = self._call(self.backend.propose, self.session_id, self._features, self._tokens, k,
                                create=create, **extra)
            self._features, self._tokens = None, []
        if self.alive and self.overlap and ahead_branches and drafts:
            self._pending = self._call(self.backend.ahead, self.session_id, self._features, self._tokens,
                                       drafts, k, ahead_branches)
            self._features, self._tokens = None, []
        return drafts if isinstance(drafts, Drafts) else Drafts(drafts or [])  # a plain list: argmax drafts

    def settle(self, accepted: int, bonus: int) -> bool | None:
        """After a verify: whether the ahead step had prepared its outcome (None: there was none under way)."""
        if self._pending is None:
            return None
        branches = self._wait()
        if branches is None:
            self.lose("its ahead step failed")
            return None
        self._ready = next((Drafts(b.drafts, b.q) for b in branches if (b.accepted, b.bonus) == (accepted, bonus)),
                           None)
        return self._ready is not None

    def lose(self, reason: object) -> None:
        """The draft failed (DraftUnavailable): the rest of the generation runs target-only."""
        log.warning("session %s: the draft is lost (%s); going on target-only", self.session_id, reason)
        self.release()

    def release(self) -> None:
        self.alive = self.overlap = False
        if self._pending is not None:  # an ahead still in flight is the draft session's until it ends
            self._wait()
        if self._open:
            self._open = False
            self.backend.release(self.session_id)

    def _call(self, method, *args, **kwargs):
        try:
            return method(*args, **kwargs)
        except DraftUnavailable as exc:
            self.lose(exc)
            return None

    def _wait(self) -> list[Branch] | None:
        pending, self._pending = self._pending, None
        try:
            return pending.result()
        except DraftUnavailable:
            return None
        except Exception as exc:  # noqa: BLE001 - an in-process draft's own error: the same as a lost draft
            log.warning("an ahead failed: %r", exc)
            return None


def run_rounds(
    target: TargetBackend,
    draft: DraftBackend | None,
    request: GenerationRequest,
    max_context: int | None = None,
    speculation: Speculation = FIXED_K,
) -> Iterator[RoundEvent]:
    """Prefill, then verify rounds until a stop condition; yields committed tokens as they commit.

    Closing the iterator early (a client went away, a stop string matched) releases both sessions.
    A draft that fails is released and the rest of the request runs with k=0: the target alone
    decides every token, so only the speed-up is lost. With overlap, drafts only choose what the
    target checks, so the output is the same either way.
    """
    session = uuid.uuid4().hex
    stop_ids = set(request.stop_token_ids) | (set() if request.ignore_eos else set(target.eos_token_ids))
    limit = request.max_new_tokens
    if max_context is not None:
        limit = min(limit, max_context - len(request.prompt_ids))
    stopper = Stopper(limit, stop_ids)
    policy = KPolicy(request, speculation, limit, has_draft=draft is not None)
    drafter = (DraftSession(draft, session, speculation.overlaps(request), request.sampling)
               if draft is not None and policy.drafting else None)
    stats = GenerationStats(accepted_per_position=[0] * (request.num_draft_tokens if drafter else 0))

    def alive() -> bool:
        return drafter is not None and drafter.alive

    try:
        widest = 1 + policy.tree.nodes if alive() and policy.tree is not None else None  # a tree's verify
        prefill = target.prefill(session, request.prompt_ids, request.sampling, alive(), max_new_tokens=limit,
                                 verify_tokens=widest)
        token = prefill.token
        new_tokens, finish = stopper.take([token])
        yield RoundEvent(new_tokens, stats, finish, _cut(prefill.logprobs, new_tokens))
        if alive():
            drafter.feed(prefill.features, [*request.prompt_ids[1:], token])
        started = time.perf_counter()  # a round's time runs to the next round's start: the client's share too
        while finish is None:
            # draft
            k = policy.k_for_round(stopper.produced, stats.num_rounds, alive())
            if policy.shed:
                stats.num_rounds_load_shed += 1
                if drafter is not None:
                    drafter.release()
            drafts = Drafts()
            if k > 0 and alive():
                tree = policy.tree_for_round(k, stopper.produced)
                branches = _ahead_branches(speculation, drafter, k, limit - stopper.produced) if tree is None else 0
                drafts = drafter.draft(k, branches, tree)
            if k > 0 and not alive():
                stats.num_rounds_without_draft += 1
            # verify (target-only: up to decode_steps tokens in the target's own batches, target_server/decode.py)
            decode = min(speculation.decode_steps, limit - stopper.produced) if not alive() else 1
            extra = {"decode": decode, "stop_ids": sorted(stop_ids)} if decode > 1 else {}
            verdict = target.verify(session, token, drafts, alive(), drafts.q, drafts.parents, **extra)
            # commit
            accepted = len(verdict.accepted)
            stats.count_round(len(drafts), accepted if drafts else 0, drafts.parents is not None)
            now = time.perf_counter()
            policy.record(len(drafts), accepted, now - started, drafts.parents is not None, verdict.warming)
            started = now
            hit = drafter.settle(accepted, verdict.bonus) if drafter is not None else None
            if hit is not None:
                stats.num_overlap_rounds += 1
                stats.num_overlap_hits += hit
            committed = [*verdict.accepted, verdict.bonus]
            if alive():
                drafter.feed(verdict.features, committed)
            token = verdict.bonus
            new_tokens, finish = stopper.take(committed)
            yield RoundEvent(new_tokens, stats, finish, _cut(verdict.logprobs, new_tokens))
    finally:
        policy.close()
        target.release(session)
        if drafter is not None:
            drafter.release()


def _cut(logprobs: list[TokenLogprob] | None, kept: list[int]) -> list[TokenLogprob] | None:
    """The logprobs of the committed tokens the stopper kept."""
    return logprobs[: len(kept)] if logprobs is not None else None


def _ahead_branches(speculation: Speculation, drafter: DraftSession, k: int, remaining: int) -> int:
    """Branches for the draft to prepare the next round with during this verify, or 0 for none: only
    when a next round can follow (this one may commit k+1) and while the server has time to spare."""
    if not drafter.overlap or remaining <= k + 2:
        return 0
    if speculation.overlap_while is not None and not speculation.overlap_while():
        return 0
    return speculation.branches
