"""The draft engine: per-session KV of committed positions, extend with exact target features, K-step rollout.

Per round the engine gets the new committed pairs (F_i, x_{i+1}) — a+1 of them after a verify, n after
a prefill — appends them to its KV at RoPE positions i, then rolls out K steps from the last one:
d_1 comes from the last extend output; step k>1 feeds (a_{k-1}, d_{k-1}) at the next position.
The rollout's KV is dropped at the end, so the next round's exact target features replace it.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draft_server.checkpoint import load_draft, read_config
from draft_server.model import DraftKV, Eagle3Draft
from tandem.pairing import DraftShape, TargetShape, check_pair
from tandem.sessions import InvalidRequest, SessionOwner, SessionTable
from tandem.timing import engine_lock
from target_server.engine import DTYPES


@dataclass
class _Session:
    kv: DraftKV = field(default_factory=DraftKV)
    length: int = 0  # committed pairs in the KV
    last_used: float = field(default_factory=time.monotonic)


class DraftEngine(SessionOwner):
    def __init__(
        self,
        draft_dir: str | Path,
        target_dir: str | Path | None = None,
        device: str = "cpu",
        dtype: str = "float32",
    ):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.config, self.layout = read_config(draft_dir)
        # the head's trained context; RoPE is computed per position, so longer sequences still run
        self.max_context = int(getattr(self.config.layer, "max_position_embeddings", 0) or 0)
        self.target_max_context: int | None = None  # the context of the target checkpoint we were given
        if target_dir is not None:  # refuse a head made for another target before reading its weights
            check_pair(read_target_shape(target_dir), self.shape(max_target_id=0))
            self.target_max_context = read_target_shape(target_dir).max_context
        self.model: Eagle3Draft = load_draft(draft_dir, target_dir, device=device, dtype=self.dtype)
        if target_dir is not None:
            check_pair(read_target_shape(target_dir), self.shape())
        self.feature_size = 3 * self.config.target_hidden_size
        self.sessions: SessionTable[_Session] = SessionTable("draft")
        self._lock = threading.Lock()

    def shape(self, max_target_id: int | None = None) -> DraftShape:
        if max_target_id is None:
            d2t = self.model.d2t
            max_target_id = int((d2t + torch.arange(d2t.numel(), device=d2t.device)).max())
        return DraftShape(
            vocab_size=self.config.vocab_size,
            target_hidden_size=self.config.target_hidden_size,
            max_target_id=max_target_id,
            aux_layer_ids=self.config.aux_layer_ids,
        )

    @torch.inference_mode()
    def propose(
        self,
        session_id: str,
        features: torch.Tensor,  # [m, 3Ht]: F_i of the new committed positions
        next_tokens: list[int],  # [m]: x_{i+1} for each
        num_draft_tokens: int,
        create: bool = False,
    ) -> list[int]:
        """Append the m new committed pairs and return K draft tokens (target ids)."""
        m = len(next_tokens)
        if m == 0 or features.shape != (m, self.feature_size):
            raise InvalidRequest(
                f"expected features [{m}, {self.feature_size}] for {m} tokens, got {list(features.shape)}"
            )
        bad = [t for t in next_tokens if not 0 <= t < self.config.vocab_size]
        if bad:
            raise InvalidRequest(f"draft tokens outside the vocabulary: {bad[:5]}")
        if create:  # only once the input is known good: a bad first request leaves nothing behind
            self.sessions.add(session_id, _Session())
        session = self.sessions.get(session_id)
        model = self.model
        with engine_lock(self._lock):  # the wait counts as queueing in the step timing
            kv = session.kv
            hidden = model.fc(features.to(self.device, self.dtype))[None]  # [1, m, H]
            tokens = torch.tensor([next_tokens], device=self.device)  # [1, m]
            positions = torch.arange(session.length, session.length + m, device=self.device)[None]
            a = model(hidden, tokens, positions, kv)[:, -1:]  # [1, 1, H]
            session.length += m
            drafts: list[int] = []
            position = session.length
            for step in range(num_draft_tokens):
                draft = model.to_target_ids(model.draft_logits(a[0, -1]).argmax(-1))
                drafts.append(int(draft))
                if step + 1 < num_draft_tokens:
                    a = model(a, draft.view(1, 1), torch.tensor([[position]], device=self.device), kv)
                    position += 1
            kv.crop(session.length)  # the rollout's KV is dropped: exact target features replace it
        session.last_used = time.monotonic()
        return drafts


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
