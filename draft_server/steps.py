"""The draft engine's per-session state and batch steps, how a Propose or an Ahead becomes one (DraftSteps:
its input checked, its session opened or found, the verify before it counted, its KV taken), and what the
engine reads of the target's config."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draft_server.budget import BudgetedSessions
from draft_server.constrained import DraftGrammars
from draft_server.model import DraftKV, Eagle3Config
from draft_server.sampling import DraftSampler
from draft_server.tree import SiblingRates
from tandem.constraint import Constraint
from tandem.pairing import TargetShape
from tandem.params import TreeParams
from tandem.protocol import Ahead, DraftProbs, Drafts, Propose
from tandem.sessions import InvalidRequest


@dataclass
class _Session:
    kv: DraftKV = field(default_factory=DraftKV)
    length: int = 0  # committed pairs in the KV
    last_used: float = field(default_factory=time.monotonic)
    sampler: DraftSampler | None = None  # a sampled request: drafts are drawn from q, not the argmax
    # the drafts of the last step (one list per branch after an ahead) with the hidden states whose
    # logits proposed them, [K, H]: an ahead assuming those drafts feeds them as the drafts' inputs
    proposed: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)
    tree: bool = False  # its last propose drafted a tree: no chain for an ahead to assume, no K to count
    # a sampled session's last tree (its nodes' target ids, parents), until the next propose says which path
    # the target took (SiblingRates)
    last_tree: tuple[list[int], list[int]] | None = None
    constraint: Constraint | None = None  # a constrained request: its drafts are picked from the masked q


@dataclass
class _Step:
    session: _Session
    features: torch.Tensor  # [m, 3Ht]
    next_tokens: list[int]  # [m]
    k: int
    tree: TreeParams | None = None  # a draft tree of this shape instead of k drafts


@dataclass
class _Ahead:
    session: _Session
    features: torch.Tensor  # [m, 3Ht], m may be 0: the pairs went with the propose before
    next_tokens: list[int]  # [m]
    assumed: list[int]  # [J]: the drafts under verification
    rows: torch.Tensor  # [J, H]: the hidden states that proposed them
    k: int
    branches: int


def _drafts(tokens: list[int], q: list[DraftProbs] | None) -> Drafts:
    """The drafts of one session's rollout, with q when it sampled them."""
    return Drafts(tokens, q or None)


def read_target_shape(target_dir: str | Path) -> TargetShape:
    """The target's vocabulary, width and depth from its config.json alone."""
    config = json.loads((Path(target_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    return TargetShape(
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        num_layers=int(config["num_hidden_layers"]),
        # as TargetEngine.max_context reads it
        max_context=int(config.get("max_position_embeddings") or 1 << 30),
    )


class Outcomes:
    """(K, sampled) -> how many verifies accepted 0..K drafts, greedy and sampled sessions apart (their
    acceptance differs): acceptance runs in streaks (the draft's own probabilities are flat even where it
    is right), so aheads rank the outcomes of a verify by this."""

    def __init__(self):
        self._counts: dict[tuple[int, bool], list[int]] = {}

    def count(self, sampled: bool, k: int, accepted: int) -> None:
        """A verify's outcome, read off the pairs it committed (a accepted + the bonus)."""
        counts = self._counts.setdefault((k, sampled), [1] * (k + 1))  # a uniform prior
        counts[min(max(accepted, 0), k)] += 1

    def logprobs(self, k: int, sampled: bool = False) -> torch.Tensor:
        """[k+1]: log P(j of k drafts accepted), as verifies of this engine's drafts have gone so far."""
        counts = torch.tensor(self._counts.get((k, sampled), [1] * (k + 1)), dtype=torch.float)
        return (counts / counts.sum()).log()


class DraftSteps(BudgetedSessions):
    """The draft engine's steps from a batch's Propose and Ahead requests: each checked against the head,
    its session opened or found, what the verify before it committed counted, its new pairs' KV taken."""

    config: Eagle3Config
    feature_size: int  # 3Ht: the target features of one committed pair
    grammars: DraftGrammars
    outcomes: Outcomes
    sibling_rates: SiblingRates

    def _propose_step(self, p: Propose) -> _Step:
        """A propose's step, or InvalidRequest; the session is used (`open`: made, once the input is known good)."""
        session_id, features, next_tokens, num_draft_tokens, tree = p.session_id, p.features, p.next_tokens, p.k, p.tree
        create, sampling = p.open, p.sampling
        m = len(next_tokens)
        if m == 0 or features.shape != (m, self.feature_size):
            raise InvalidRequest(
                f"expected features [{m}, {self.feature_size}] for {m} tokens, got {list(features.shape)}"
            )
        bad = [t for t in next_tokens if not 0 <= t < self.config.vocab_size]
        if bad:
            raise InvalidRequest(f"draft tokens outside the vocabulary: {bad[:5]}")
        if create:  # only once the input is known good: a bad first request leaves nothing behind
            sampler = DraftSampler.for_request(sampling) if sampling is not None and not sampling.greedy else None
            constraint = self.grammars.open(p.constraint, next_tokens) if p.constraint is not None else None
            self.sessions.add(session_id, _Session(sampler=sampler, constraint=constraint))
        session = self.sessions.get(session_id)
        self.take_kv(session_id, m, opened=create)
        if session.constraint is not None and not create:
            session.constraint.commit(next_tokens, session.constraint.stop_ids.tolist())
        # a tree's outcome is not a chain's; more pairs than a verify of K commits came from a target-only
        # round (the acceptance gate's timing: tandem/gates.py), which says nothing of the drafts
        if not create and tree is None and not session.tree and m <= num_draft_tokens + 1:
            self.outcomes.count(session.sampler is not None, num_draft_tokens, m - 1)
        if session.last_tree is not None:  # the pairs the verify of a sampled tree committed: its path
            self.sibling_rates.count(*session.last_tree, next_tokens)
            session.last_tree = None
        session.tree = tree is not None
        session.last_used = time.monotonic()
        return _Step(session, features, list(next_tokens), num_draft_tokens, tree)

    def _ahead_step(self, a: Ahead) -> _Ahead:
        """An ahead's step, or InvalidRequest: append the new committed pairs (features [m, 3Ht], None or
        [0, 3Ht] for none), then prepare the next round's drafts for the `branches` likeliest outcomes of
        verifying `drafts` (as this session proposed them), likeliest first."""
        session_id, features, next_tokens, assumed = a.session_id, a.features, list(a.next_tokens), list(a.drafts)
        num_draft_tokens, branches = a.k, a.branches
        m = len(next_tokens)
        if features is None:
            features = torch.empty(0, self.feature_size)
        if features.shape != (m, self.feature_size):
            raise InvalidRequest(
                f"expected features [{m}, {self.feature_size}] for {m} tokens, got {list(features.shape)}"
            )
        bad = [t for t in [*next_tokens, *assumed] if not 0 <= t < self.config.vocab_size]
        if bad:
            raise InvalidRequest(f"tokens outside the vocabulary: {bad[:5]}")
        if not assumed or num_draft_tokens < 1 or branches < 1:
            raise InvalidRequest("speculating ahead needs drafts to assume, K >= 1 and at least one branch")
        session = self.sessions.get(session_id)
        if session.tree:
            raise InvalidRequest("an ahead assumes a chain of drafts: this session's last propose drafted a tree")
        if m:
            self.outcomes.count(session.sampler is not None, len(assumed), m - 1)
        rows = next((r[: len(assumed)] for drafts, r in session.proposed if drafts[: len(assumed)] == assumed), None)
        if rows is None:
            raise InvalidRequest("an ahead assumes drafts this session proposed in its last step")
        self.take_kv(session_id, m, opened=False)
        session.last_used = time.monotonic()
        if session.constraint is not None:
            session.constraint.commit(next_tokens, session.constraint.stop_ids.tolist())
        return _Ahead(session, features, list(next_tokens), list(assumed), rows, num_draft_tokens, branches)
