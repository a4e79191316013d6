"""The round loop of ARCHITECTURE.md, written once against two small backend contracts.

The in-process generator plugs the engines in directly; the coordinator plugs in gRPC stubs.
Features are opaque here (a tensor in-process, a wire message over gRPC): the loop only moves them.
"""

from __future__ import annotations

import itertools
import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from pydantic import BaseModel

from tandem.params import MAX_DRAFT_TOKENS, GenerationRequest
from tandem.protocol import Branch, DraftBackend, DraftUnavailable, Pending, TargetBackend

log = logging.getLogger("tandem.rounds")

# outcomes of a verify the draft prepares for while it runs (overlap), the likeliest by the verifies so
# far and the draft's bonus probabilities (tandem.config.OVERLAP_BRANCHES says why 16)
DEFAULT_BRANCHES = 16


class GenerationStats(BaseModel):
    num_rounds: int = 0  # verify forwards after the prefill
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = []  # [K]: rounds in which draft k was accepted
    # rounds that asked for drafts and ran without (no draft, or it was lost mid-request)
    num_rounds_without_draft: int = 0
    # rounds run target-only because speculation would not pay: the server was too busy (adaptive K)
    # or the drafts were rarely accepted (the acceptance gate)
    num_rounds_load_shed: int = 0
    # overlap: verify rounds during which the draft prepared the next round, and of those the ones
    # whose outcome it had prepared for (the next drafts were ready when the verify answered)
    num_overlap_rounds: int = 0
    num_overlap_hits: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per verify round, bonus included (the number vLLM/SGLang report)."""
        return 1.0 + self.num_accepted_tokens / self.num_rounds if self.num_rounds else 0.0

    @property
    def overlap_hit_rate(self) -> float:
        return self.num_overlap_hits / self.num_overlap_rounds if self.num_overlap_rounds else 0.0

    def as_dict(self) -> dict:
        return {**self.model_dump(), "mean_acceptance_length": self.mean_acceptance_length,
                "overlap_hit_rate": self.overlap_hit_rate}


@dataclass
class RoundEvent:
    """Tokens committed since the last event; `finish_reason` is set on the last one."""

    new_tokens: list[int]
    stats: GenerationStats
    finish_reason: str | None = None


@dataclass
class _Stopper:
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


def adaptive_k(budget: int, running: Callable[[], int]) -> Callable[[int], int]:
    """K under load: the draft tokens of all `running()` generations together stay within `budget`
    per round, K = budget // n - 1, down to 0. Verifying K+1 tokens for each of n sessions costs a
    batched forward more as n grows, while the tokens a draft wins per round stay the same: at high
    concurrency drafting costs more than it wins (vLLM's speculative_disable_by_batch_size)."""

    def k_for(requested: int) -> int:
        return min(requested, max(0, budget // max(1, running()) - 1))

    return k_for


class AcceptanceGate:
    """K by what the drafts win: speculation runs only where the drafts accepted pay for drafting them.

    Over the server's verify rounds (greedy and sampled requests apart: a head is accepted far more
    often at temperature 0), it counts for each draft position k how often draft k was verified after
    k-1 accepted ones, and how often it was accepted: p_k. With K drafts a round commits
    E(K) = 1 + p_1 + p_1 p_2 + ... tokens and costs 1 + cost * K verify rounds' time (`cost`: one draft
    token's share, drafting and its transfer included), so K is the one that maximises E(K) / (1 + cost * K),
    and 0 (target-only) when none beats 1; the request's own K stays unless another is better by MARGIN. On the 2-core CPU with the demo pair a K=3 round costs
    about two target-only rounds (cost 0.3); with a random head (the tiny pair) EAGLE-3 ran at 0.55x
    target-only, and sampling at temperature 1 with the demo head at 0.59x.

    Until a position has been tried `MIN_ROUNDS` times it counts as always accepted, so a new server
    speculates at the requested K until the counts say otherwise. While the gate is shut one request in `PROBE_EVERY` speculates for its
    first `PROBE_ROUNDS` rounds anyway, so that a change of traffic (a prompt mix the head knows) can
    open it again. Old counts fade (halved past HALF_LIFE rounds).
    """

    MIN_ROUNDS = 16
    MARGIN = 1.05
    PROBE_EVERY = 32
    PROBE_ROUNDS = 4
    HALF_LIFE = 4096

    def __init__(self, cost: float):
        self.cost = cost
        self._lock = threading.Lock()
        # greedy / sampled -> per position k (1-based): rounds that verified draft k, and that accepted it
        self._tried = {g: [0] * (MAX_DRAFT_TOKENS + 1) for g in (True, False)}
        self._accepted = {g: [0] * (MAX_DRAFT_TOKENS + 1) for g in (True, False)}
        self._requests = itertools.count()

    def record(self, greedy: bool, drafted: int, accepted: int) -> None:
        with self._lock:
            tried, ok = self._tried[greedy], self._accepted[greedy]
            for k in range(1, min(drafted, accepted + 1) + 1):
                tried[k] += 1
                ok[k] += k <= accepted
            if tried[1] > self.HALF_LIFE:
                for counts in (tried, ok):
                    counts[:] = [c // 2 for c in counts]

    def best_k(self, greedy: bool, requested: int) -> int:
        with self._lock:
            tried, ok = self._tried[greedy], self._accepted[greedy]
            scores, expected, reach = [1.0], 1.0, 1.0  # K = 0: one token for one round
            for k in range(1, requested + 1):
                reach *= ok[k] / tried[k] if tried[k] >= self.MIN_ROUNDS else 1.0
                expected += reach
                scores.append(expected / (1 + self.cost * k))
        best = max(range(len(scores)), key=scores.__getitem__)
        # the cost is an estimate: a smaller K than the request's only when it is clearly better
        return requested if scores[requested] >= scores[best] / self.MARGIN else best

    def probe(self) -> int:
        """Rounds this new request speculates before the gate decides: PROBE_ROUNDS for one in PROBE_EVERY."""
        return self.PROBE_ROUNDS if next(self._requests) % self.PROBE_EVERY == 0 else 0


def run_rounds(
    target: TargetBackend,
    draft: DraftBackend | None,
    request: GenerationRequest,
    max_context: int | None = None,
    k_for: Callable[[int], int] | None = None,
    overlap: bool = False,
    branches: int = DEFAULT_BRANCHES,
    overlap_while: Callable[[], bool] | None = None,
    gate: AcceptanceGate | None = None,
) -> Iterator[RoundEvent]:
    """Prefill, then verify rounds until a stop condition; yields committed tokens as they commit.

    Closing the iterator early (a client went away, a stop string matched) releases both sessions.
    A draft that fails (DraftUnavailable) is released and the rest of the request runs with k=0:
    the target alone decides every token, so only the speed-up is lost.
    `k_for(K)` (adaptive_k) sets each round's K from the server's load; when it says 0 the draft is
    released and the generation finishes target-only (its draft KV would fall behind otherwise).
    `overlap`: while the target verifies a round, the draft prepares the next one for the `branches`
    likeliest outcomes (a draft without `ahead` runs sequentially). When the outcome is one of them
    (a hit), the next verify goes out at once with those drafts; on a miss the round drafts as without
    overlap. Drafts only choose what the target checks, so the output is the same either way.
    `overlap_while()` gates it round by round: the ahead step is the draft's spare time put to use,
    and under load there is none (the coordinator: while few generations run).
    `gate` (AcceptanceGate) cuts K further to what the drafts accepted so far pay for; at 0 the
    generation goes target-only as under load.
    """
    session = uuid.uuid4().hex
    want_drafts = request.speculate and request.num_draft_tokens > 0
    speculate = want_drafts and draft is not None
    greedy = request.sampling.greedy
    probing = gate.probe() if gate is not None and speculate else 0
    if speculate and k_for is not None and k_for(request.num_draft_tokens) == 0:
        want_drafts = speculate = False  # too busy already: no features, no draft session at all
    if speculate and gate is not None and not probing and gate.best_k(greedy, request.num_draft_tokens) == 0:
        want_drafts = speculate = False  # drafts have not paid lately: the same
    stop_ids = set(request.stop_token_ids)
    if not request.ignore_eos:
        stop_ids |= set(target.eos_token_ids)
    limit = request.max_new_tokens
    if max_context is not None:
        limit = min(limit, max_context - len(request.prompt_ids))
    stopper = _Stopper(limit, stop_ids)
    stats = GenerationStats(accepted_per_position=[0] * (request.num_draft_tokens if speculate else 0))
    draft_open = False
    overlap = overlap and speculate and hasattr(draft, "ahead")
    ready: list[int] | None = None  # the next round's drafts, prepared during the last verify
    pending: Pending | None = None  # an ahead under way
    try:
        prefill = target.prefill(session, request.prompt_ids, request.sampling, speculate, max_new_tokens=limit)
        token, features = prefill.token, prefill.features
        new_tokens, finish = stopper.take([token])
        yield RoundEvent(new_tokens, stats, finish)
        # the pairs (F_i, x_{i+1}) the draft has not seen yet
        pending_tokens = [*request.prompt_ids[1:], token]
        features_pending = True  # `features` and `pending_tokens` are still to go to the draft
        while finish is None:
            # never draft past the limit: verify commits up to k+1 tokens
            k = min(request.num_draft_tokens, limit - stopper.produced - 1) if want_drafts else 0
            if speculate and k > 0:
                if k_for is not None:
                    k = k_for(k)
                if k > 0 and gate is not None and stats.num_rounds >= probing:
                    k = gate.best_k(greedy, k)
                if k == 0:  # too busy for drafts, or they do not pay: target-only from here on
                    want_drafts = speculate = False
                    if draft_open:
                        draft.release(session)
                        draft_open = False
            if not want_drafts and request.speculate and request.num_draft_tokens > 0 and draft is not None:
                stats.num_rounds_load_shed += 1
            drafts: list[int] = []
            # prepare the next round during this verify only when one can follow (it may commit k+1);
            # prepared drafts are taken only then too: the ahead carries the last round's pairs
            ahead = overlap and k > 0 and limit - stopper.produced > k + 2
            ahead = ahead and (overlap_while is None or overlap_while())
            if k > 0 and speculate and ready and ahead:
                drafts = ready[:k]
            elif k > 0 and speculate:
                try:
                    create, draft_open = not draft_open, True  # released even if this first call fails
                    drafts = draft.propose(session, features, pending_tokens, k, create=create)
                    features_pending = False
                except DraftUnavailable as exc:
                    log.warning("session %s: the draft is lost (%s); going on target-only", session, exc)
                    speculate = overlap = draft_open = False
                    draft.release(session)
            ready = None
            if k > 0 and not speculate:
                stats.num_rounds_without_draft += 1
            if ahead and overlap and drafts:
                try:
                    pending = draft.ahead(session, features if features_pending else None,
                                          pending_tokens if features_pending else [], drafts, k, branches)
                    features_pending = False
                except DraftUnavailable as exc:
                    log.warning("session %s: the draft is lost (%s); going on target-only", session, exc)
                    speculate = overlap = draft_open = False
                    draft.release(session)
            result = target.verify(session, token, drafts, speculate)
            accepted, bonus, features = result.accepted, result.bonus, result.features
            a = len(accepted)
            if gate is not None and drafts:
                gate.record(greedy, len(drafts), a)
            stats.num_rounds += 1
            stats.num_draft_tokens += len(drafts)
            stats.num_accepted_tokens += a
            for position in range(a):
                stats.accepted_per_position[position] += 1
            if pending is not None:
                prepared, pending = _settle(pending), None
                if prepared is None:
                    log.warning("session %s: the draft is lost; going on target-only", session)
                    speculate = overlap = draft_open = False
                    draft.release(session)
                else:
                    stats.num_overlap_rounds += 1
                    ready = next((b.drafts for b in prepared if (b.accepted, b.bonus) == (a, bonus)), None)
                    stats.num_overlap_hits += ready is not None
            pending_tokens = [*accepted, bonus]
            features_pending = True
            token = bonus
            new_tokens, finish = stopper.take(pending_tokens)
            yield RoundEvent(new_tokens, stats, finish)
    finally:
        if pending is not None:  # an ahead still in flight is the draft session's until it ends
            _settle(pending)
        target.release(session)
        if draft_open:
            draft.release(session)


def _settle(pending: Pending) -> list[Branch] | None:
    """The ahead's branches, or None when the draft failed it."""
    try:
        return pending.result()
    except DraftUnavailable:
        return None
    except Exception as exc:  # noqa: BLE001 - an in-process draft's own error: the same as a lost draft
        log.warning("an ahead failed: %r", exc)
        return None
