"""What the K policy measures (tandem/policy.py decides with it): the acceptance gate, which counts how often
each draft position is accepted and times the server running target-only and drafting, and the tree gate,
which times trees against chains."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

from tandem.defaults import SPEC_DRAFT_COST
from tandem.params import MAX_DRAFT_TOKENS


class RoundAverage:
    """Moving averages over one kind of round: tokens committed, seconds; the last weighs `weight`, or
    1/rounds while that is more (a plain mean over the first 1/weight rounds)."""

    __slots__ = ("rounds", "seconds", "since", "tokens")

    def __init__(self):
        self.rounds = self.since = 0  # since: target-only rounds timed at its load since its last (AcceptanceGate)
        self.tokens = self.seconds = 0.0

    def add(self, tokens: int, seconds: float, weight: float) -> None:
        self.rounds += 1
        self.since = 0
        w = max(weight, 1 / self.rounds)
        self.tokens += w * (tokens - self.tokens)
        self.seconds += w * (seconds - self.seconds)

    @property
    def rate(self) -> float:
        """Tokens committed per second."""
        return self.tokens / max(self.seconds, 1e-9)


class ServerRate:
    """Tokens the whole server committed and the seconds it ran, one way at one load (`AcceptanceGate.outpaced`);
    both halve past `horizon` tokens. `since` (drafting's): target-only tokens at that load since it last grew."""

    __slots__ = ("horizon", "seconds", "since", "tokens")

    def __init__(self, horizon: int):
        self.horizon = horizon
        self.tokens = self.since = 0
        self.seconds = 0.0

    def add(self, tokens: int) -> None:
        self.tokens += tokens
        self.since = 0
        if self.tokens > self.horizon:
            self.tokens, self.seconds = self.tokens // 2, self.seconds / 2

    @property
    def rate(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def load_bucket(running: int) -> int:
    """Generations running, rounded up to a power of two: the load a measured rate belongs to."""
    return 1 << max(0, running - 1).bit_length()


class AcceptanceGate:
    """K by what the drafts win: speculation runs only where the drafts accepted pay for drafting them.

    Over the server's verify rounds (greedy and sampled requests apart: a head is accepted far more
    often at temperature 0), it counts for each draft position k how often draft k was verified after
    k-1 accepted ones, and how often it was accepted: p_k. With K drafts a round commits
    E(K) = 1 + p_1 + p_1 p_2 + ... tokens and costs C(K) target-only rounds' time (measured, see below;
    until then the prior 1 + cost * K, `cost`: one draft token's share, its transfer included), so K is the
    one that maximises E(K) / C(K), 0 (target-only) when none beats 1; the request's own K stays unless another
    is better by MARGIN (docs/benchmarks.md, "The acceptance gate's round costs", has what was measured).

    Until a position has been tried `MIN_ROUNDS` times it counts as always accepted, so a new server
    speculates at the requested K until the counts say otherwise. While they shut it, one request in
    `PROBE_EVERY` speculates for its first `PROBE_ROUNDS` rounds anyway, so that a change of traffic can open
    it again. Old counts fade (halved past HALF_LIFE rounds).

    Measured rates. Per kind of request and per load (the generations running, in powers of two:
    `load_bucket`), the gate keeps two things, each only while the whole server runs one way (all greedy
    or all sampled; nobody drafting or everybody: a mixed batch says neither; for (1), all but 1 in ALMOST):
    (1) The whole server's tokens per second (`ServerRate`): every token committed, over all the time the
    server ran that way, prefills and the gaps between generations included. Where target-only and
    drafting both have SERVED_TOKENS tokens per generation at the present load (a few generations'
    worth, so that their prefills weigh as they do), target-only faster by RATE_MARGIN (more while
    drafting has little: FRESH_MARGIN) sheds every generation of that kind. Rounds timed one by one would
    not do here: per session under load they leave out the prefills and the gaps between generations.
    (2) Each kind of round's own time (`RoundAverage`, from one round's start to the next: drafting,
    verify, relays and the client's share), chain rounds per K: where target-only has RATE_ROUNDS tokens
    timed, a round of K drafts costs what was measured (`round_costs`), not the prior 1 + cost * K. Where
    nothing runs target-only, a drafting generation alone runs one round in TIMING_EVERY target-only to time
    it (`times_target`): a decode of several tokens, as a target-only server's, its features fed to the draft.
    The first generation that would shed at its start alone, and one in EXPLORE_EVERY after, drafts instead
    and measures drafting afresh (see `outpaced`), and the gate forgets the server's drafting rate at a load
    once target-only has committed REOPEN_TOKENS per generation running there since it was measured, so that
    the next ones measure it again (the head or the traffic may have changed).
    Likewise a drafting round's time at a load is forgotten once REOPEN_ROUNDS target-only rounds have been
    timed there since it last was (twice as many after each time, up to 16 times): one slow stretch early
    on must not shut a K for good.
    """

    MIN_ROUNDS = 32
    MARGIN = 1.05
    PROBE_EVERY = 32
    PROBE_ROUNDS = 4
    HALF_LIFE = 4096
    RATE_ROUNDS = 64
    RATE_WEIGHT = 0.02
    RATE_MARGIN = 1.10
    K_ROUNDS = 16  # chain rounds of one K before their time counts
    REOPEN_TOKENS = 4096  # per generation running: 65536 at load 16
    REOPEN_ROUNDS = 512  # 8 generations of 64 tokens at one request; 16 rounds of K re-measure it (K_ROUNDS)
    EXPLORE_EVERY = 8
    # the server's rate needs SERVED_TOKENS per generation running and follows ~16x that (`ServerRate`)
    SERVED_TOKENS = 64
    # generations starting together (a client's first wave): up to 30% more margin (benchmarks.md: fresh margin)
    FRESH_MARGIN = 0.3
    ALMOST = 8  # the server runs one way where at most 1 in 8 of its generations run the other
    TIMING_EVERY = 8  # alone with target-only untimed, one drafting round in 8 runs target-only (times_target)
    TIMING_ROUNDS = 8  # target-only rounds timed before their time counts (and RATE_ROUNDS tokens)

    def __init__(self, cost: float = SPEC_DRAFT_COST, clock: Callable[[], float] = time.perf_counter):
        self.cost = cost
        self._clock = clock
        self._lock = threading.Lock()
        self._running = self._drafting = self._greedy = 0  # generations under way; drafting; greedy
        # one round's time: (greedy, load bucket, kind of round, drafts) -> its moving averages
        self._rates: dict[tuple[bool, int, str, int], RoundAverage] = {}
        # the whole server's tokens and seconds while it runs one way: (greedy, load bucket, "target"/"drafting")
        self._served: dict[tuple[bool, int, str], ServerRate] = {}
        self._state: tuple[bool, int, str] | None = None  # how the server runs now (None: mixed, or idle)
        self._since = clock()  # ... since then
        self._sheds = itertools.count(1)  # starts alone that would shed: one in EXPLORE_EVERY explores
        # greedy / sampled -> per position k (1-based): rounds that verified draft k, and that accepted it
        self._tried = {g: [0] * (MAX_DRAFT_TOKENS + 1) for g in (True, False)}
        self._accepted = {g: [0] * (MAX_DRAFT_TOKENS + 1) for g in (True, False)}
        self._requests = itertools.count()
        self._rounds_alone = itertools.count(1)  # a lone generation's rounds while target-only is untimed
        self._warming = False  # the target is compiling (VerifyResult.warming): rounds are not timed
        self._reopened: dict[tuple[bool, int], int] = {}  # (greedy, load) -> drafting round times forgotten there

    def record(self, greedy: bool, drafted: int, accepted: int) -> None:
        with self._lock:
            tried, ok = self._tried[greedy], self._accepted[greedy]
            for k in range(1, min(drafted, accepted + 1) + 1):
                tried[k] += 1
                ok[k] += k <= accepted
            if tried[1] > self.HALF_LIFE:
                for counts in (tried, ok):
                    counts[:] = [c // 2 for c in counts]

    def _forget_speeds(self) -> None:
        """(Lock held.) The server's speed changed (the target compiled its forward): round times and server
        rates are measured again; the acceptance counts stay (the head accepts as it did)."""
        self._rates.clear()
        self._served.clear()
        self._since = self._clock()

    def enter(self, drafting: bool, greedy: bool) -> None:
        """A generation starts (drafting or not); `leave` when it ends, `stop_drafting` when it sheds."""
        self._count(1, int(drafting), int(greedy))

    def stop_drafting(self) -> None:
        self._count(0, -1, 0)

    def leave(self, drafting: bool, greedy: bool) -> None:
        self._count(-1, -int(drafting), -int(greedy))

    def _count(self, running: int, drafting: int, greedy: int) -> None:
        with self._lock:
            self._tick()
            self._running += running
            self._drafting += drafting
            self._greedy += greedy
            # all one way, or all but at most one in ALMOST (a burst's first sheds must not hide the rest)
            odd = min(self._drafting, self._running - self._drafting)
            way = "target" if self._drafting <= self._running - self._drafting else "drafting"
            kind = way if odd * self.ALMOST <= self._running else None
            alike = self._greedy in (0, self._running)  # greedy and sampled ones are timed apart
            self._state = ((self._greedy > 0, load_bucket(self._running), kind)
                           if self._running and kind and alike else None)

    def _tick(self) -> ServerRate | None:
        """The time since the last change goes to the way the server ran (under the lock): its ServerRate."""
        now = self._clock()
        served = None
        if self._state is not None:
            served = self._served.setdefault(self._state, ServerRate(16 * self.SERVED_TOKENS * self._state[1]))
            served.seconds += now - self._since
        self._since = now
        return served

    @property
    def load(self) -> tuple[int, int]:
        """(generations running, of them drafting), as the gate counts them."""
        with self._lock:
            return self._running, self._drafting

    def record_round(self, greedy: bool, kind: str, committed: int, drafted: int, seconds: float,
                     timed: bool = True, warming: bool = False) -> None:
        """One round of `kind` ("target", "chain", "tree"): `committed` tokens in `seconds` (`timed`: a full
        round, one whose drafts max_new_tokens did not cut). The server's tokens count every round; the
        round's own rate only where the whole server runs that way (target-only: nobody drafts, or a lone
        generation times its own; drafting: everybody does). `warming`: the target was compiling a bucket of its forward (not timed); the
        first round after such rounds makes the gate forget every speed it measured (the counts stay)."""
        with self._lock:
            if warming or self._warming:  # the first round after the target's compile: what was timed is stale
                self._warming = warming
                if not warming:
                    self._forget_speeds()
            served = self._tick()
            if served is not None:
                served.add(committed)
                drafting = self._served.get((*self._state[:2], "drafting")) if self._state[2] == "target" else None
                if drafting is not None:
                    drafting.since += committed  # target-only tokens since drafting was measured (`outpaced`)
            # target-only: nobody drafts, or a drafting generation alone times its own (`times_target`)
            clean = self._drafting == 0 or self._running == 1 if kind == "target" else self._drafting == self._running
            if not clean or not timed:
                return
            key = (greedy, load_bucket(self._running), kind, drafted)
            self._rates.setdefault(key, RoundAverage()).add(committed, seconds, self.RATE_WEIGHT)
            if kind == "target":  # drafting rounds timed long ago at this load are timed again
                reopened = self._reopened.get(key[:2], 0)
                for other in [k for k in self._rates if k[:2] == key[:2] and k[2] != "target"]:
                    self._rates[other].since += 1
                    if self._rates[other].since > self.REOPEN_ROUNDS << min(reopened, 4):
                        del self._rates[other]
                        self._reopened[key[:2]] = reopened + 1

    def _seconds(self, key: tuple[bool, int, str, int], rounds: int) -> float | None:
        return seen.seconds if (seen := self._rates.get(key)) is not None and seen.rounds >= rounds else None

    def _target_seconds(self, greedy: bool, bucket: int) -> float | None:
        """A target-only token's time at that load (a round decodes up to 16), once RATE_ROUNDS tokens are timed."""
        seen = self._rates.get((greedy, bucket, "target", 0))
        if seen is None or seen.rounds < self.TIMING_ROUNDS or seen.rounds * seen.tokens < self.RATE_ROUNDS:
            return None
        return seen.seconds / max(seen.tokens, 1.0)

    def times_target(self, greedy: bool) -> bool:
        """Whether a drafting generation's next round runs target-only to be timed: alone on the server (beside
        others it waits on their verifies), the target not compiling, target-only untimed, one round in
        TIMING_EVERY. Where every request drafts nothing else times it (docs/benchmarks.md, "The acceptance
        gate's round costs")."""
        with self._lock:
            if self._running != 1 or self._warming or self._target_seconds(greedy, 1) is not None:
                return False
            return next(self._rounds_alone) % self.TIMING_EVERY == 0

    def _served_rate(self, key: tuple[bool, int, str]) -> ServerRate | None:
        """The server's rate at that (greedy, load, way) once measured: target-only needs half the tokens
        (its first ones weigh against it, not for it: a rate that sheds only gets slower)."""
        seen = self._served.get(key)
        enough = self.SERVED_TOKENS * key[1] // (2 if key[2] == "target" else 1)
        return seen if seen is not None and seen.tokens >= enough else None

    def outpaced(self, greedy: bool, starting: bool = False) -> bool | None:
        """Whether the whole server commits tokens faster running target-only than drafting, by RATE_MARGIN
        and FRESH_MARGIN more while drafting has its first tokens only, at its present load, as measured:
        then this generation should shed. None (only for a generation `starting`): it would, but this one
        explores instead, drafting all its life, and the drafting rate is measured again from its rounds
        alone (the first that would shed and one in EXPLORE_EVERY after, alone on the server: under load an
        explorer's rounds are mixed and never counted; REOPEN_TOKENS measures there). Afresh, not added to
        the old rate: a server's first drafting generations are its slowest (docs/benchmarks.md, "The
        acceptance gate's round costs")."""
        with self._lock:
            bucket = load_bucket(self._running)
            target = self._served_rate((greedy, bucket, "target"))
            drafting = self._served_rate((greedy, bucket, "drafting"))
            if drafting is not None and drafting.since > self.REOPEN_TOKENS * bucket:
                del self._served[greedy, bucket, "drafting"]  # measured long ago: the next ones measure it again
                return False
            if target is None or drafting is None:
                return False
            margin = self.RATE_MARGIN + self.FRESH_MARGIN * self.SERVED_TOKENS * bucket / drafting.tokens
            if target.rate <= margin * drafting.rate:
                return False
            if starting and bucket == 1 and next(self._sheds) % self.EXPLORE_EVERY == 1:
                del self._served[greedy, bucket, "drafting"]  # the explorer measures it again, alone
                return None
            return True

    def round_costs(self, greedy: bool, requested: int) -> list[float]:
        """A round's time with k = 0..requested drafts, in target-only rounds, at the server's load: measured
        for each K that chain rounds have run (K_ROUNDS of them), linear between those, past the largest by the
        prior `cost` per draft, and under the smallest linear down to K = 0 (1 round) but saving at most the
        prior's cost a draft; the prior, 1 + cost * k, where nothing is measured. Where no target-only round has
        been timed at the load (a server whose requests all draft), the smallest K timed stands at the prior and
        the others by their seconds against it. Not linear in k from one K: a drafting round pays a fixed share
        (a propose, a relay) besides its drafts (docs/benchmarks.md, "The acceptance gate's round costs")."""
        bucket = load_bucket(self._running)
        target = self._target_seconds(greedy, bucket)  # per token: the prior's unit is one
        timed = {k: seconds for k in range(1, requested + 1)
                 if (seconds := self._seconds((greedy, bucket, "chain", k), self.K_ROUNDS)) is not None}
        if target is None and timed:  # a P-EAGLE head's K=5 costs about its K=2: the prior's 0.3 a draft cut it
            target = timed[min(timed)] / (1 + self.cost * min(timed))
        known = {0: 1.0}  # with nothing else known, the extrapolation below is the prior
        known.update((k, seconds / target) for k, seconds in timed.items())
        costs = []
        for k in range(requested + 1):
            below = max(j for j in known if j <= k)
            above = min((j for j in known if j >= k), default=None)
            if above is None:  # past the largest K measured: the prior per draft
                costs.append(known[below] + self.cost * (k - below))
                continue
            span = above - below
            cost = known[below] + (known[above] - known[below]) * (k - below) / span if span else known[k]
            if below == 0 < k:  # under the smallest K measured: a draft fewer saves the prior's cost at most
                cost = max(cost, known[above] - self.cost * (above - k))
            costs.append(cost)
        return costs

    def best_k(self, greedy: bool, requested: int) -> int:
        """The K that commits the most tokens a second by the counts and round costs. 0 (target-only) is not
        a choice under load where the server has measured itself running target-only: a session's round times
        leave out what the batch's other generations cost it; there the server's own rates decide (`outpaced`).
        Alone, or with no such rate, the counts do (a head that is never accepted sheds at any load). A K under
        the request's only once the request's is timed where it would be (all drafting, the target not
        compiling): by the prior alone a P-EAGLE head's K=5, which costs about its K=2, was never timed."""
        with self._lock:
            costs = self.round_costs(greedy, requested)
            bucket = load_bucket(self._running)
            rates = bucket > 1 and self._served_rate((greedy, bucket, "target")) is not None
            tried, ok = self._tried[greedy], self._accepted[greedy]
            scores, expected, reach = [0.0 if rates else 1.0], 1.0, 1.0  # K = 0: one token for one round
            for k in range(1, requested + 1):
                reach *= ok[k] / tried[k] if tried[k] >= self.MIN_ROUNDS else 1.0
                expected += reach
                scores.append(expected / costs[k])
            best = max(range(len(scores)), key=scores.__getitem__)
            # the request's K untimed where its rounds would be timed: it runs until timed, then the times decide
            if 0 < best < requested and self._running and self._drafting == self._running and not self._warming \
                    and self._seconds((greedy, bucket, "chain", requested), self.K_ROUNDS) is None:
                return requested
        # the cost is an estimate: a smaller K than the request's only when it is clearly better
        return requested if scores[requested] >= scores[best] / self.MARGIN else best

    def probe(self) -> int:
        """Rounds a new request that the counts shut out speculates anyway: PROBE_ROUNDS for one in PROBE_EVERY
        (only those: a probe under load, where the server's rates shed, only widened the others' verify)."""
        return self.PROBE_ROUNDS if (next(self._requests) + 1) % self.PROBE_EVERY == 0 else 0


class TreeGate:
    """Tree or chain, round by round, by the committed tokens per second each has measured.

    Per kind of request (greedy / sampled) it keeps moving averages of the tokens a round committed and of
    the round's wall time (the draft's propose and the target's verify, with whatever batching and transfer
    they met), for trees and chains, from PAIRS of rounds: a generation's tree round next to its chain round,
    both added at once: what a round commits depends on the text far more than on its shape, so averages
    fed apart compare different texts. Until MIN_ROUNDS pairs the rounds
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
        self._warming = False

    def record(self, greedy: bool, tree: bool, committed: int, seconds: float,
               before: tuple[bool, int, float] | None = None) -> None:
        """A drafting round of `tree` shape, and `before`, the same generation's drafting round before it
        (tree, committed, seconds): counted only as a pair of one tree and one chain round."""
        if before is None or before[0] == tree:
            return
        with self._lock:
            for shape, tokens, time in ((tree, committed, seconds), before):
                self._seen.setdefault((greedy, shape), RoundAverage()).add(tokens, time, self.WEIGHT)

    def warming(self, warming: bool) -> None:
        """Whether the target was compiling during the last round: once it is done, the rates are timed again."""
        with self._lock:
            if self._warming and not warming:
                self._seen.clear()
            self._warming = warming

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
