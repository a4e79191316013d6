"""The draft engine's per-session state and batch steps, and what it reads of the target's config."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draft_server.model import DraftKV
from draft_server.sampling import DraftSampler
from tandem.constraint import Constraint
from tandem.pairing import TargetShape
from tandem.params import TreeParams
from tandem.protocol import DraftProbs, Drafts


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


def stack_kv(steps: list[_Step], past: list[int], longest: int, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's committed KV of decoder layer `layer`, [B, kv_heads, longest, head_dim], each sequence
    left-padded."""
    reference = next(step.session.kv.layer(layer) for step, n in zip(steps, past, strict=True) if n)
    k = reference.k.new_zeros(len(steps), reference.k.shape[1], longest, reference.k.shape[3])
    v = torch.zeros_like(k)
    for i, step in enumerate(steps):
        if past[i]:
            own = step.session.kv.layer(layer)
            k[i, :, longest - past[i] :] = own.k[0]
            v[i, :, longest - past[i] :] = own.v[0]
    return k, v


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
