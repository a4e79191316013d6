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

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

from tandem.config import OVERLAP_BRANCHES, SPEC_DRAFT_COST
from tandem.params import MAX_DRAFT_TOKENS, GenerationRequest, TreeParams


def adaptive_k(budget: int, running: Callable[[], int]) -> Callable[[int], int]:
    """K under load: the draft tokens of all `running()` generations together stay within `budget`
    per round, K = budget // n - 1, down to 0. Verifying K+1 tokens for each of n sessions costs a
    batched forward more as n grows, while the tokens a draft wins per round stay the same: at high
    concurrency drafting costs more than it wins (vLLM's speculative_disable_by_batch_size)."""

    def k_for(requested: int) -> int:
        return min(requested, max(0, budget // max(1, running()) - 1))

    return k_for


class RoundAverage:
    """Moving averages over one kind of round: tokens committed, seconds, drafts; the last weighs `weight`."""

    __slots__ = ("drafts", "rounds", "seconds", "tokens")

    def __init__(self):
        self.rounds = 0
        self.tokens = self.seconds = self.drafts = 0.0

    def add(self, tokens: int, seconds: float, drafts: int, weight: float) -> None:
        w = weight if self.rounds else 1.0  # the first round sets them
        self.rounds += 1
        self.tokens += w * (tokens - self.tokens)
        self.seconds += w * (seconds - self.seconds)
        self.drafts += w * (drafts - self.drafts)

    @property
    def rate(self) -> float:
        """Tokens committed per second."""
        return self.tokens / max(self.seconds, 1e-9)


def load_bucket(running: int) -> int:
    """Generations running, rounded up to a power of two: the load a measured rate belongs to."""
    return 1 << max(0, running - 1).bit_length()


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

    Measured cost. `cost` is a prior; the gate also times the rounds themselves, per kind of request and
    per load (the generations running, in powers of two: `load_bucket`), as tokens committed per second of
    round (from one round's start to the next: drafting, verify, relays and the client's share). A
    target-only round counts only while no generation drafts and a drafting one only while all do: in a
    mixed batch a target-only round waits for the others' wide verify, and neither would say what the
    server does when everyone runs that way. Where both have RATE_ROUNDS rounds at the server's present
    load, (1) target-only faster than the drafting rounds by RATE_MARGIN sheds every generation of that
    kind (on a CPU at 16 sessions a verify of 16 x (K+1) tokens costs what drafts win, and more at
    temperature 1), and (2) the cost per draft token is the one measured, (chain round / target-only
    round - 1) / K, instead of the prior. One generation in EXPLORE_EVERY that would shed at its start
    drafts instead (see `outpaced`), and one shed in REOPEN_EVERY forgets the drafting rounds' rate at that
    load, so that the next generations measure it again (the head or the traffic may have changed).
    """

    MIN_ROUNDS = 16
    MARGIN = 1.05
    PROBE_EVERY = 32
    PROBE_ROUNDS = 4
    HALF_LIFE = 4096
    RATE_ROUNDS = 64
    RATE_WEIGHT = 0.02
    RATE_MARGIN = 1.10
    REOPEN_EVERY = 256
    EXPLORE_EVERY = 8

    def __init__(self, cost: float = SPEC_DRAFT_COST):
        self.cost = cost
        self._lock = threading.Lock()
        self._running = self._drafting = 0  # generations under way; those of them that draft
        self._rates: dict[tuple[bool, int, str], RoundAverage] = {}  # (greedy, load bucket, kind of round)
        self._sheds = itertools.count(1)
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

    def enter(self, drafting: bool) -> None:
        """A generation starts (drafting or not); `leave` when it ends, `stop_drafting` when it sheds."""
        with self._lock:
            self._running += 1
            self._drafting += drafting

    def stop_drafting(self) -> None:
        with self._lock:
            self._drafting -= 1

    def leave(self, drafting: bool) -> None:
        with self._lock:
            self._running -= 1
            self._drafting -= drafting

    @property
    def load(self) -> tuple[int, int]:
        """(generations running, of them drafting), as the gate counts them."""
        with self._lock:
            return self._running, self._drafting

    def record_round(self, greedy: bool, kind: str, committed: int, drafted: int, seconds: float) -> None:
        """One round of `kind` ("target", "chain", "tree"): `committed` tokens in `seconds`. Kept only where
        the whole server runs that way (target-only: nobody drafts; chain or tree: everybody does)."""
        with self._lock:
            clean = self._drafting == 0 if kind == "target" else self._drafting == self._running
            if not clean:
                return
            key = (greedy, load_bucket(self._running), kind)
            self._rates.setdefault(key, RoundAverage()).add(committed, seconds, drafted, self.RATE_WEIGHT)

    def _rate(self, key: tuple[bool, int, str]) -> RoundAverage | None:
        seen = self._rates.get(key)
        return seen if seen is not None and seen.rounds >= self.RATE_ROUNDS else None

    def outpaced(self, greedy: bool, starting: bool = False) -> bool | None:
        """Whether target-only rounds commit tokens faster than drafting ones at the server's load, by
        RATE_MARGIN, as measured: then this generation should shed. None (only for a generation `starting`):
        it would, but this one explores instead, drafting all its life, so that the drafting rate is measured
        again (one in EXPLORE_EVERY; alone on the server its rounds count, and one noisy measurement does
        not shed drafting there for good)."""
        with self._lock:
            bucket = load_bucket(self._running)
            target = self._rate((greedy, bucket, "target"))
            drafting = [r for kind in ("chain", "tree") if (r := self._rate((greedy, bucket, kind))) is not None]
            if target is None or not drafting:
                return False
            if target.rate <= self.RATE_MARGIN * max(r.rate for r in drafting):
                return False
            sheds = next(self._sheds)
            if starting and sheds % self.EXPLORE_EVERY == 0:
                return None
            if sheds % self.REOPEN_EVERY == 0:
                for kind in ("chain", "tree"):
                    self._rates.pop((greedy, bucket, kind), None)
            return True

    def cost_now(self, greedy: bool) -> float:
        """One draft token's cost as a share of a target-only round: measured at the server's load where
        both kinds of round have been, else the prior."""
        bucket = load_bucket(self._running)
        target, chain = self._rate((greedy, bucket, "target")), self._rate((greedy, bucket, "chain"))
        if target is None or chain is None or chain.drafts < 1:
            return self.cost
        return min(4.0, max(0.0, (chain.seconds / target.seconds - 1) / chain.drafts))

    def best_k(self, greedy: bool, requested: int) -> int:
        with self._lock:
            cost = self.cost_now(greedy)
            tried, ok = self._tried[greedy], self._accepted[greedy]
            scores, expected, reach = [1.0], 1.0, 1.0  # K = 0: one token for one round
            for k in range(1, requested + 1):
                reach *= ok[k] / tried[k] if tried[k] >= self.MIN_ROUNDS else 1.0
                expected += reach
                scores.append(expected / (1 + cost * k))
        best = max(range(len(scores)), key=scores.__getitem__)
        # the cost is an estimate: a smaller K than the request's only when it is clearly better
        return requested if scores[requested] >= scores[best] / self.MARGIN else best

    def probe(self) -> int:
        """Rounds this new request speculates before the gate decides: PROBE_ROUNDS for one in PROBE_EVERY."""
        return self.PROBE_ROUNDS if next(self._requests) % self.PROBE_EVERY == 0 else 0


class TreeGate:
    """Tree or chain, round by round, by the committed tokens per second each has measured.

    Per kind of request (greedy / sampled) it keeps moving averages of the tokens a round committed and of
    the round's wall time (the draft's propose and the target's verify, with whatever batching and transfer
    they met), for trees and chains, from PAIRS of rounds: a generation's tree round next to its chain round,
    both added at once. What a round commits depends on the text far more than on its shape (the same chain
    commits 5 tokens a round on one prompt and 2 on the next), so two averages kept apart, one fed every
    round and the other one round in EXPLORE_EVERY, compared different texts: a few hard prompts under the
    chain made a slower tree look faster for hundreds of rounds. Until MIN_ROUNDS pairs the rounds
    alternate; then the better runs, and the other one round in `EXPLORE_EVERY`, each such round making a
    pair with the one before it (and the one after). Each average weighs the last pairs by `WEIGHT`.
    """

    MIN_ROUNDS = 8
    EXPLORE_EVERY = 16
    WEIGHT = 0.05

    def __init__(self):
        self._lock = threading.Lock()
        self._seen: dict[tuple[bool, bool], RoundAverage] = {}  # (greedy, tree)
        self._rounds = itertools.count()

    def record(self, greedy: bool, tree: bool, committed: int, seconds: float,
               before: tuple[bool, int, float] | None = None) -> None:
        """A drafting round of `tree` shape, and `before`, the same generation's drafting round before it
        (tree, committed, seconds): counted only as a pair of one tree and one chain round."""
        if before is None or before[0] == tree:
            return
        with self._lock:
            for shape, tokens, time in ((tree, committed, seconds), before):
                self._seen.setdefault((greedy, shape), RoundAverage()).add(tokens, time, 0, self.WEIGHT)

    def rate(self, greedy: bool, tree: bool) -> float | None:
        """Tokens per second measured for that shape (None: not enough pairs yet)."""
        with self._lock:
            seen = self._seen.get((greedy, tree))
        return seen.rate if seen is not None and seen.rounds >= self.MIN_ROUNDS else None

    def use_tree(self, greedy: bool, last: bool | None = None) -> bool:
        """Whether this round of a generation is a tree; `last`: the shape of its last drafting round."""
        n = next(self._rounds)
        tree, chain = self.rate(greedy, True), self.rate(greedy, False)
        if tree is None or chain is None:  # still measuring: each generation alternates, making pairs
            return not last if last is not None else True
        better = tree > chain
        return better != (n % self.EXPLORE_EVERY == 0)


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
    trees: TreeGate | None = None  # tree or chain each round (None: a request's tree, every drafting round)
    # whether a verify this wide fits the server's load (adaptive K's budget: n running x width <= budget)
    fits: Callable[[int], bool] | None = None
    default_tree: TreeParams | None = None  # the tree of a request that names none (None: chains)


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
        # overlap's ahead step drafts chains: a generation that overlaps runs chains
        self.tree = None if speculation.overlap else (request.tree or speculation.default_tree)
        self.asked = request.speculate and request.num_draft_tokens > 0
        self.probing = self.gate.probe() if self.gate is not None and self.asked and has_draft else 0
        self.shed = self.exploring = False
        self._before: tuple[bool, int, float] | None = None  # its last drafting round, for the tree gate's pairs
        self._tail = False  # this round's drafts are cut short by max_new_tokens (`record` does not time it)
        if self.asked and has_draft:
            # too busy already, or the drafts have not paid lately: no features, no draft session at all
            busy = self.k_for is not None and self.k_for(self.requested) == 0
            gated = self.gate is not None and not self.probing and not busy
            shut = gated and self.gate.best_k(self.greedy, self.requested) == 0
            # asked only of a generation nothing else sheds: the gate counts its sheds and explorers
            rates = self.gate.outpaced(self.greedy, starting=True) if gated and not shut else False
            self.exploring = rates is None  # drafts all its life: the gate measures drafting again
            self.shed = busy or shut or rates is True
        self._counted = self.drafting and self.gate is not None  # as the gate counts it: drafting or not
        if self.gate is not None:
            self.gate.enter(self._counted)

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
        self._tail = k < self.requested  # the generation's end cuts its drafts: not a round to time
        if draft_alive and k > 0:
            if self.k_for is not None:
                k = self.k_for(k)
            if k > 0 and self.gate is not None and rounds >= self.probing:
                k = 0 if not self.exploring and self.gate.outpaced(self.greedy) else self.gate.best_k(self.greedy, k)
            self.shed = k == 0
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

    def record(self, drafted: int, accepted: int, seconds: float, tree: bool = False) -> None:
        """A round: `accepted` of `drafted` drafts (a tree's: the accepted path; none: target-only); `seconds`
        from this round's start to the next's. The gates time it unless max_new_tokens cut its drafts short:
        such rounds say how a generation ends, not what drafting does (a bench's short warm-up generations
        are nearly all such rounds, and timed they shed greedy chains that ran 1.6x target-only)."""
        if self.gate is not None:
            if drafted and not tree:  # the gate's counts are per chain position
                self.gate.record(self.greedy, drafted, accepted)
            kind = "tree" if tree else "chain" if drafted else "target"
            if not self._tail:
                self.gate.record_round(self.greedy, kind, accepted + 1, drafted, seconds)
        if self.trees is not None and drafted and self.tree is not None:
            if not self._tail:
                self.trees.record(self.greedy, tree, accepted + 1, seconds, self._before)
            self._before = None if self._tail else (tree, accepted + 1, seconds)

    def close(self) -> None:
        """The generation ended: the gate stops counting it."""
        if self.gate is not None:
            self.gate.leave(self._counted)
            self._counted = False
