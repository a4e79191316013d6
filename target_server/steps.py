"""What the target engine keeps per session, and one session's part of a batched forward."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from tandem.params import SamplingParams

_owners = itertools.count()  # a session's id in the native pool's row metadata


@dataclass
class Session:
    params: SamplingParams
    generator: torch.Generator | None
    length: int = 0  # tokens whose KV is committed
    reserved: int = 0  # KV tokens this session may grow to now (its share of the budget; verifies grow it)
    width: int = 0  # the most tokens one of its verifies adds for a moment
    limit: int = 1 << 30  # the most tokens it may grow to: prompt + max_new_tokens + one verify's width
    blocks: list[int] = field(default_factory=list)  # its KVPool blocks
    rows: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))  # pool row per position (hf)
    owner: int = field(default_factory=lambda: next(_owners))
    last_used: float = field(default_factory=time.monotonic)
    ready: torch.cuda.Event | None = None  # CUDA: recorded at the end of the batch that computed its last features
    released: bool = False  # its blocks freed (ended, cancelled, evicted): a step of it still queued fails alone
    # penalties (target_server/logits.py): the generated tokens' counts [V] and the prompt's tokens [V]
    counts: torch.Tensor | None = None
    prompt_seen: torch.Tensor | None = None


@dataclass
class Step:
    """One session's part of a batched forward."""

    kind: Literal["prefill", "verify"]
    session: Session
    ids: list[int]  # the new tokens: the prompt, or [t, d_1..d_K] (a tree's nodes: t, then the drafts)
    want_features: bool
    q: torch.Tensor | dict[int, torch.Tensor] | None = None  # sampled drafts' q: dense_q, a tree's tree_q
    parents: list[int] | None = None  # a verify of a draft tree: Drafts.parents of ids[1:]; None: a chain
    allowed: bytes | None = None  # a constrained generation's mask rows (tandem/constraint.py), one per scored row
