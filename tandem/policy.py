"""How many drafts a round verifies: the one place that decides K (docs/architecture.md, "K policy").

Three things cut a request's K, each for its own reason:
  the limit        never draft past max_new_tokens: a verify commits up to K+1 tokens
  adaptive K       under load a verify of K+1 tokens for each of n sessions costs more than the drafts
                   win (vLLM's speculative_disable_by_batch_size); `adaptive_k` keeps n*(K+1) in a budget
  the gate         drafts that are rarely accepted cost more than they win (`AcceptanceGate`)
A generation that adaptive K or the gate cuts to 0 is *shed*: it runs target-only from then on (its
draft KV would fall behind otherwise). `KPolicy.k_for_round()` answers for one generation, round by round.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

from tandem.config import OVERLAP_BRANCHES, SPEC_DRAFT_COST
from tandem.params import MAX_DRAFT_TOKENS, GenerationRequest


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
    token's share, drafting and its transfer included), so K is the one that maximises
    E(K) / (1 + cost * K), and 0 (target-only) when none beats 1; the request's own K stays unless
    another is better by MARGIN. On the 2-core CPU with the demo pair a K=3 round costs about two
    target-only rounds (cost 0.3); with a random head (the tiny pair) EAGLE-3 ran at 0.55x
    target-only, and sampling at temperature 1 with the demo head at 0.59x.

    Until a position has been tried `MIN_ROUNDS` times it counts as always accepted, so a new server
    speculates at the requested K until the counts say otherwise. While the gate is shut one request
    in `PROBE_EVERY` speculates for its first `PROBE_ROUNDS` rounds anyway, so that a change of
    traffic (a prompt mix the head knows) can open it again. Old counts fade (halved past HALF_LIFE rounds).
    """

    MIN_ROUNDS = 16
    MARGIN = 1.05
    PROBE_EVERY = 32
    PROBE_ROUNDS = 4
    HALF_LIFE = 4096

    def __init__(self, cost: float = SPEC_DRAFT_COST):
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


@dataclass(frozen=True)
class Speculation:
    """How a server (or an in-process generator) speculates; shared by all its generations.

    `k_for(K)`: adaptive K from the server's load. `gate`: the acceptance gate. `overlap`: while the
    target verifies a round, the draft prepares the next one for the `branches` likeliest outcomes;
    `overlap_while()` gates it round by round (the ahead step is the draft's spare time put to use,
    and under load there is none).
    """

    k_for: Callable[[int], int] | None = None
    gate: AcceptanceGate | None = None
    overlap: bool = False
    branches: int = OVERLAP_BRANCHES
    overlap_while: Callable[[], bool] | None = None


class KPolicy:
    """One generation's K, round by round: the limit, adaptive K, the gate and its probing rounds.

    `asked`: the request wants drafts. `shed`: adaptive K or the gate took them away for good.
    """

    def __init__(self, request: GenerationRequest, speculation: Speculation, limit: int, has_draft: bool):
        self.requested = request.num_draft_tokens
        self.greedy = request.sampling.greedy
        self.limit = limit
        self.k_for, self.gate = speculation.k_for, speculation.gate
        self.asked = request.speculate and request.num_draft_tokens > 0
        self.probing = self.gate.probe() if self.gate is not None and self.asked and has_draft else 0
        self.shed = False
        if self.asked and has_draft:
            # too busy already, or the drafts have not paid lately: no features, no draft session at all
            self.shed = (self.k_for is not None and self.k_for(self.requested) == 0) or (
                self.gate is not None and not self.probing and self.gate.best_k(self.greedy, self.requested) == 0
            )

    @property
    def drafting(self) -> bool:
        """Whether this generation drafts at all (at its start: a draft session is worth opening)."""
        return self.asked and not self.shed

    def k_for_round(self, produced: int, rounds: int, draft_alive: bool) -> int:
        """The K of the next verify; 0 runs it target-only. May shed the generation (see `shed`).

        A K > 0 with no live draft means the round wanted drafts it could not have (no draft, or lost).
        """
        if not self.drafting:
            return 0
        k = min(self.requested, self.limit - produced - 1)
        if draft_alive and k > 0:
            if self.k_for is not None:
                k = self.k_for(k)
            if k > 0 and self.gate is not None and rounds >= self.probing:
                k = self.gate.best_k(self.greedy, k)
            self.shed = k == 0
        return k

    def record(self, drafted: int, accepted: int) -> None:
        if self.gate is not None and drafted:
            self.gate.record(self.greedy, drafted, accepted)
