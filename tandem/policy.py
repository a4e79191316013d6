"""How many drafts a round verifies: the one place that decides K (docs/architecture.md, "K policy").

Three things cut a request's K, each for its own reason:
  the limit        never draft past max_new_tokens: a verify commits up to K+1 tokens
  adaptive K       under load a verify of K+1 tokens for each of n sessions costs more than the drafts
                   win (vLLM's speculative_disable_by_batch_size); `adaptive_k` keeps n*(K+1) in a budget
  the gate         drafts that are rarely accepted cost more than they win (`AcceptanceGate`), or rounds
                   with drafts commit fewer tokens a second than target-only rounds at the same load
A generation that adaptive K or the gate cuts to 0 is *shed*: it runs target-only from then on (its
draft KV would fall behind otherwise). `KPolicy.k_for_round()` answers for one generation, round by round.

A request that asks for a draft tree (EAGLE-2) has one more choice each drafting round: a tree of N nodes
or the chain of K. A tree commits more tokens a round, but its verify is N+1 tokens wide: on a GPU that
costs about what a chain's does, on a CPU it costs N/K times as much. `TreeGate` chooses from what both
have measured on this server: tokens committed per second of round, drafting and verify included.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tandem.defaults import OVERLAP_BRANCHES

# Overlap only while at most this many generations run: ahead steps are per session, and under load the
# draft has no spare time to give (the two waves keep it busy instead).
OVERLAP_MAX_RUNNING = 1
from tandem.gates import AcceptanceGate, TreeGate
from tandem.params import GenerationRequest, TreeParams


def adaptive_k(budget: int, running: Callable[[], int]) -> Callable[[int], int]:
    """K under load: the draft tokens of all `running()` generations together stay within `budget`
    per round, K = budget // n - 1, down to 0. Verifying K+1 tokens for each of n sessions costs a
    batched forward more as n grows, while the tokens a draft wins per round stay the same: at high
    concurrency drafting costs more than it wins (vLLM's speculative_disable_by_batch_size)."""

    def k_for(requested: int) -> int:
        return min(requested, max(0, budget // max(1, running()) - 1))

    return k_for


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
    # sampled generations overlap too (else greedy ones only): a sampled verify's outcome is harder to guess
    # (the measurements above OVERLAP_SAMPLED_HELP), so the servers leave it off
    overlap_sampled: bool = False
    branches: int = OVERLAP_BRANCHES
    overlap_while: Callable[[], bool] | None = None
    trees: TreeGate | None = None  # tree or chain each round (None: a request's tree, every drafting round)
    # whether a verify this wide fits the server's load (adaptive K's budget: n running x width <= budget)
    fits: Callable[[int], bool] | None = None
    default_tree: TreeParams | None = None  # the tree of a request that names none (None: chains)
    decode_steps: int = 1  # tokens a target-only round asks the target for (Verify.decode)

    def overlaps(self, request: GenerationRequest) -> bool:
        """Whether this generation drafts with overlap (round by round still under `overlap_while`): a greedy
        one, a sampled one with `overlap_sampled`, and never one of draft trees (the ahead step drafts chains: a
        tree asked for, by the request or the server, is kept) or a constrained one (an ahead's drafts would not
        be masked by its grammar)."""
        tree = request.tree or self.default_tree
        return self.overlap and (request.sampling.greedy or self.overlap_sampled) and tree is None \
            and not request.constrained


class KPolicy:
    """One generation's K, round by round: the limit, adaptive K, the gate and its probing rounds.

    `asked`: the request wants drafts. `shed`: adaptive K or the gate took them away for good.
    """

    def __init__(self, request: GenerationRequest, speculation: Speculation, limit: int, has_draft: bool):
        self.requested = request.num_draft_tokens
        self.greedy = request.sampling.greedy
        self.limit = limit
        self.k_for, self.gate, self.trees = speculation.k_for, speculation.gate, speculation.trees
        self.fits = speculation.fits
        self.tree = request.tree or speculation.default_tree  # a tree asked for turns overlap off (overlaps)
        self.asked = request.speculate and request.num_draft_tokens > 0
        self.probing = 0  # rounds it drafts before the gate decides: a probe of a gate that its counts shut
        self.shed = self.exploring = self.timing = False  # timing: this round runs target-only to be timed
        self._before: tuple[bool, int, float] | None = None  # its last drafting round, for the tree gate's pairs
        self._tail = False  # this round's drafts are cut short by max_new_tokens (the gates do not time it)
        self._drafted = False  # a drafting round has been recorded (the first is not timed: see `record`)
        if self.asked and has_draft:
            # too busy already, or the drafts have not paid lately: no features, no draft session at all
            busy = self.k_for is not None and self.k_for(self.requested) == 0
            gated = self.gate is not None and not busy
            shut = gated and self.gate.best_k(self.greedy, self.requested) == 0
            self.probing = self.gate.probe() if shut else 0
            # asked only of a generation nothing else sheds: the gate counts its sheds and explorers
            rates = self.gate.outpaced(self.greedy, starting=True) if gated and not shut else False
            self.exploring = rates is None  # drafts all its life: the gate measures drafting again
            self.shed = busy or (shut and not self.probing) or rates is True
        self._counted = self.drafting and self.gate is not None  # as the gate counts it: drafting or not
        if self.gate is not None:
            self.gate.enter(self._counted, self.greedy)

    @property
    def drafting(self) -> bool:
        """Whether this generation drafts at all (at its start: a draft session is worth opening)."""
        return self.asked and not self.shed

    def k_for_round(self, produced: int, rounds: int, draft_alive: bool) -> int:
        """The K of the next verify; 0 runs it target-only. May shed the generation (see `shed`).

        A K > 0 with no live draft means the round wanted drafts it could not have (no draft, or lost).
        """
        self.timing = False
        if not self.drafting:
            return 0
        k = min(self.requested, self.limit - produced - 1)
        self._tail = k < self.requested  # the generation's end cuts its drafts: not a round to time
        if draft_alive and k > 0:
            if self.k_for is not None:
                k = self.k_for(k)
            if k > 0 and self.gate is not None and rounds >= self.probing:
                k = 0 if not self.exploring and self.gate.outpaced(self.greedy) else self.gate.best_k(self.greedy, k)
            self.shed = k == 0
            # this round alone target-only, the draft kept and fed: the gate times it (AcceptanceGate.times_target)
            self.timing = k > 0 and self.gate is not None and self.gate.times_target(self.greedy)
            k = 0 if self.timing else k
        if self._counted and (self.shed or not draft_alive):
            self._counted = False
            self.gate.stop_drafting()
        return k

    def tree_for_round(self, k: int, produced: int) -> TreeParams | None:
        """The tree to draft this round instead of the chain of `k` (None: the chain). Never deeper than
        the limit leaves room for (a verify commits up to depth + 1 tokens)."""
        if self.tree is None or k == 0 or (self.fits is not None and not self.fits(self.tree.nodes + 1)):
            return None  # under load a tree's wide verify slows every session's batch: chains (adaptive K)
        if self.trees is not None and not self.trees.use_tree(self.greedy, None if self._before is None else self._before[0]):
            return None
        depth = min(self.tree.depth, self.limit - produced - 1)
        self._tail = self._tail or depth < self.tree.depth
        return self.tree if depth == self.tree.depth else self.tree.model_copy(update={"depth": depth})

    def record(self, drafted: int, accepted: int, seconds: float, tree: bool = False, warming: bool = False) -> None:
        """A round: `accepted` of `drafted` drafts (a tree's: the accepted path; none: target-only); `seconds`
        from this round's start to the next's. The gates time it unless max_new_tokens cut its drafts short:
        such rounds say how a generation ends, not what drafting does (a bench's short warm-up generations
        are nearly all such rounds, and timed they shed greedy chains that beat target-only), or the
        target was `warming` (compiling a bucket: its speed changes; the gates forget what they timed once
        it is done), or it is the generation's first drafting round: the draft takes in the prompt's features
        there, its prefill, and target-only rounds are timed without theirs (a server's very first one takes
        many rounds' time, and in a plain mean it made K=5 look costly enough to shed)."""
        timed = not self._tail and not warming and (self._drafted or not drafted)
        self._drafted = self._drafted or bool(drafted)
        if self.gate is not None:
            if drafted and not tree:  # the gate's counts are per chain position
                self.gate.record(self.greedy, drafted, accepted)
            kind = "tree" if tree else "chain" if drafted else "target"
            self.gate.record_round(self.greedy, kind, accepted + 1, drafted, seconds, timed=timed, warming=warming)
        if self.trees is not None and drafted and self.tree is not None:
            if timed:
                self.trees.record(self.greedy, tree, accepted + 1, seconds, self._before)
            self.trees.warming(warming)
            self._before = (tree, accepted + 1, seconds) if timed else None

    def close(self) -> None:
        """The generation ended: the gate stops counting it."""
        if self.gate is not None:
            self.gate.leave(self._counted, self.greedy)
            self._counted = False
