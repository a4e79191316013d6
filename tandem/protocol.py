"""What crosses between the round loop and the two engines, independent of transport.

Features are opaque to the loop: a torch tensor [n, 3H] in-process, a wire message when relayed.
Drafts are token ids; a sampled request's drafts also carry q, what the draft sampled each from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tandem.params import GrammarSpec, SamplingParams, TreeParams

Features = Any


class DraftUnavailable(Exception):
    """The draft cannot serve this generation any more: its service died, hung past its step deadline,
    or failed a step. The round loop goes on without drafts: the target alone decides every token, so
    greedy output is unchanged and only the speed-up is lost."""


@dataclass
class TokenLogprob:
    """A committed token's log-probability under the target (log_softmax of its raw logits), and the
    likeliest alternatives at its position (as many as SamplingParams.logprobs asked for)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class PrefillResult:
    token: int  # t = x_n, sampled from the logits at the last prompt position
    features: Features  # F_0..F_{n-1} [n, 3H], None when not asked for
    logprobs: list[TokenLogprob] | None = None  # [t], when the sampling asked for logprobs


@dataclass
class VerifyResult:
    accepted: list[int]  # d_1..d_a (a tree's: the tokens of the accepted path)
    bonus: int  # b, from the logits after d_a
    features: Features  # features of t, d_1..d_a [a+1, 3H]
    logprobs: list[TokenLogprob] | None = None  # [d_1..d_a, b], when the sampling asked for logprobs
    warming: bool = False  # the target was compiling a bucket of its forward: the round's time is not its speed


@dataclass
class DraftProbs:
    """q_i, the distribution the draft sampled draft d_i from: its support (target ids) and their
    probabilities, summing to 1. Truncated (draft_server/sampling.py): only what the draft could draw.
    Lists, or on the target the wire's repeated fields as they came (tandem/convert.py)."""

    ids: Sequence[int]
    probs: Sequence[float]


class Drafts(list):
    """d_1..d_K (target ids), and `q`: for each, the DraftProbs it was sampled from (a sampled request,
    speculative sampling), or None when the drafts are the draft's argmax (greedy, or a draft that does
    not sample): the target then counts q as one-hot on each draft, which is lossless too. Like features,
    q is opaque to the round loop: DraftProbs in-process, the wire messages the coordinator relays.

    `parents`: a draft tree (EAGLE-2) instead of a chain: parents[i] is the index of d_{i+1}'s parent
    among the drafts, -1 for a child of the root t, and every parent comes before its children (so a
    chain is parents [-1, 0, 1, ...]). None: a chain. A tree's siblings are distinct tokens. A greedy
    tree's are the draft's top-k (q None); a sampled tree's are drawn from the draft's q without
    replacement: q then has one entry per node, the q_j it was drawn from (an empty one for a node that
    was not drawn). The target tries the drawn children in order by min(1, p/q_j), then the others
    one-hot on what is left (target_server/acceptance.py): lossless either way."""

    def __init__(self, tokens=(), q: list[DraftProbs] | None = None, parents: list[int] | None = None):
        super().__init__(tokens)
        self.q = q
        self.parents = parents

    def head(self, k: int) -> Drafts:
        return Drafts(self[:k], self.q[:k] if self.q is not None else None)


def check_tree(parents: list[int], n: int) -> str | None:
    """What is wrong with `parents` as the tree of n drafts (None: nothing)."""
    if len(parents) != n:
        return f"the tree has {len(parents)} parents for {n} drafts"
    bad = [i for i, p in enumerate(parents) if not -1 <= p < i]
    if bad:
        return f"tree parents must each name an earlier draft or -1 (the root); draft {bad[0]} has {parents[bad[0]]}"
    return None


def tree_children(parents: list[int]) -> list[list[int]]:
    """Drafts.parents -> each node's children in the drafts' order (node 0 the root t, node i + 1 the
    draft d_{i+1})."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        children[parent + 1].append(i + 1)
    return children


def tree_depths(parents: list[int]) -> list[int]:
    """Each draft's depth in its tree: 1 for a child of the root."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


@dataclass
class Branch:
    """One outcome of a verify in flight that the draft prepared for (overlap): if the target accepts
    `accepted` of the drafts under verification and picks `bonus` after them, `drafts` are the next
    round's drafts, ready at once (with the q they were sampled from, for a sampled request)."""

    accepted: int
    bonus: int
    drafts: list[int]
    q: list[DraftProbs] | None = None


# -- the steps of a batch ------------------------------------------------------------------------
# What the round loop asks of each service, one step per session: the scheduler sends each service
# its batch of these (one message each way), the in-process driver hands them to the engines' run().


@dataclass
class Prefill:
    """Opens the target session: forwards the prompt, samples t = x_n, returns F_0..F_{n-1} if asked."""

    session_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    want_features: bool = True
    max_new_tokens: int | None = None  # sizes the session's share of the target's KV budget
    verify_tokens: int | None = None  # the widest verify it may send (a tree's); None: a chain's
    want_timing: bool = False  # every answer of the session carries its StepTiming
    allowed: bytes | None = None  # the mask of t's position (tandem/constraint.py); None: every token
    # where the generation's own tokens begin in prompt_ids (a preempted one's recompute: the prompt, then
    # what it produced), which presence and frequency penalties count as generated; None: all prompt
    output_start: int | None = None


@dataclass
class Verify:
    """One forward over [t, d_1..d_K] (or a tree), or with `decode` > 1 and no drafts up to that many
    target-only tokens in this one step (stopping after a stop id)."""

    session_id: str
    token: int
    drafts: list[int]
    want_features: bool = True
    q: list[DraftProbs] | None = None  # what each draft was sampled from; None: the drafts are argmax
    parents: list[int] | None = None  # a draft tree (Drafts.parents); None: a chain
    decode: int = 1
    stop_ids: Sequence[int] = ()
    # a constrained generation's masks (tandem/constraint.py): one row per position scored, t's first, then
    # each draft's (a tree's: each node's); None: every token allowed
    allowed: bytes | None = None


@dataclass
class DraftConstraint:
    """A constrained generation (a grammar, min_tokens) as its draft session needs it: the draft walks its
    own matcher along each rollout and picks every draft from its q masked by the row the target will
    score there (tandem/constraint.py). `output_tokens`: of the opening propose's next_tokens, how many at
    the end are the generation's own (the prefill's token, after those of a preempted run)."""

    grammar: GrammarSpec | None
    min_tokens: int = 0
    stop_ids: Sequence[int] = ()
    output_tokens: int = 1


@dataclass
class Propose:
    """The new committed pairs (F_i, x_{i+1}), then K drafts (or a tree). `open`: the session's first,
    with a sampled request's settings: the draft then draws its drafts from q and returns q; with a
    constrained request's constraint: the draft masks q with it."""

    session_id: str
    features: Features  # [m, 3H] of the new pairs
    next_tokens: list[int]  # [m]
    k: int
    open: bool = False
    sampling: SamplingParams | None = None
    tree: TreeParams | None = None
    want_timing: bool = False
    constraint: DraftConstraint | None = None


@dataclass
class Ahead:
    """Overlap: sent beside the verify of `drafts`; appends the new pairs as a propose does, then prepares
    the next round's K drafts for the `branches` likeliest outcomes of that verify."""

    session_id: str
    features: Features | None  # [m, 3H], None when m is 0
    next_tokens: list[int]
    drafts: list[int]
    k: int
    branches: int


TargetStep = Prefill | Verify
DraftStep = Propose | Ahead


class TargetBackend(Protocol):
    """`run(steps)`: one batch, a result (PrefillResult, VerifyResult) or the exception of a step that
    failed (it fails alone) per step; `release`: the session ends, its KV is freed."""

    eos_token_ids: list[int]

    def run(self, steps: Sequence[TargetStep]) -> list[Any]: ...

    def release(self, session_id: str) -> bool: ...


class DraftBackend(Protocol):
    """`run(steps)`: one batch, Drafts (a Propose's) or list[Branch] (an Ahead's) or the exception of a
    step that failed, per step."""

    def run(self, steps: Sequence[DraftStep]) -> list[Any]: ...

    def release(self, session_id: str) -> bool: ...
