"""The draft engine: per-session KV of committed positions, extend with exact target features, K-step rollout.

Per round the engine gets the new committed pairs (F_i, x_{i+1}) — a+1 of them after a verify, n after
a prefill — appends them to its KV at RoPE positions i, then rolls out K steps from the last one:
d_1 comes from the last extend output; step k>1 feeds (a_{k-1}, d_{k-1}) at the next position.
The rollout's KV is dropped at the end, so the next round's exact target features replace it.

Concurrent sessions are batched (tandem/batching.py) as in the target engine: their KV stacked
left-padded, their new pairs right-padded, one extend forward and one forward per rollout step for
all of them; each session keeps the KV of its committed pairs only.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draft_server.checkpoint import load_draft, read_config
from draft_server.model import DraftKV, Eagle3Draft
from tandem.batching import Batcher
from tandem.pairing import DraftShape, TargetShape, check_pair
from tandem.sessions import InvalidRequest, SessionOwner, SessionTable
from target_server.engine import DTYPES


@dataclass
class _Session:
    kv: DraftKV = field(default_factory=DraftKV)
    length: int = 0  # committed pairs in the KV
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class _Step:
    session: _Session
    features: torch.Tensor  # [m, 3Ht]
    next_tokens: list[int]  # [m]
    k: int


class DraftEngine(SessionOwner):
    def __init__(
        self,
        draft_dir: str | Path,
        target_dir: str | Path | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        max_batch_size: int = 32,
        max_batch_tokens: int = 4096,
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
        # one forward at a time, batched across sessions
        self.batcher: Batcher[_Step] = Batcher(self._run_batch, max_batch_size, max_batch_tokens)

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
        step = _Step(session, features, list(next_tokens), num_draft_tokens)
        drafts = self.batcher.submit(step, m + num_draft_tokens, key=session_id)
        session.last_used = time.monotonic()
        return drafts

    # -- one batched step -----------------------------------------------------------------------

    @torch.inference_mode()
    def _run_batch(self, steps: list[_Step]) -> list[list[int]]:
        if len(steps) == 1:
            return [self._run_one(steps[0])]
        model, device, b = self.model, self.device, len(steps)
        past = [step.session.length for step in steps]
        sizes = [len(step.next_tokens) for step in steps]
        longest, width = max(past), max(sizes)
        # the extend: every session's new pairs, right-padded, after its KV, left-padded
        fused = model.fc(torch.cat([step.features for step in steps]).to(device, self.dtype))  # [sum m, H]
        hidden = fused.new_zeros(b, width, fused.shape[-1])
        tokens = torch.zeros(b, width, dtype=torch.long)
        positions = torch.zeros(b, width, dtype=torch.long)
        valid = torch.zeros(b, longest + width, dtype=torch.bool)  # keys a sequence may attend to
        for i, (rows, step) in enumerate(zip(fused.split(sizes), steps, strict=True)):
            m = sizes[i]
            hidden[i, :m] = rows
            tokens[i, :m] = torch.tensor(step.next_tokens)
            positions[i] = torch.arange(past[i], past[i] + width)
            valid[i, longest - past[i] : longest + m] = True
        kv = DraftKV()
        if longest:
            kv.k, kv.v = self._stack_kv(steps, past, longest)
        valid = valid.to(device)
        causal = torch.ones(width, longest + width, dtype=torch.bool, device=device).tril(diagonal=longest)
        a = model(hidden, tokens.to(device), positions.to(device), kv, (causal[None] & valid[:, None])[:, None])
        for i, step in enumerate(steps):  # the committed pairs' KV is each session's to keep
            own, m = step.session.kv, sizes[i]
            k, v = kv.k[i : i + 1, :, longest : longest + m], kv.v[i : i + 1, :, longest : longest + m]
            own.append(k.clone(), v.clone()) if own.k is None else own.append(k, v)  # no view of the batch kept
            step.session.length += m
        # the rollout: one token per session per step, on top of the batch KV (dropped afterwards)
        a = torch.stack([a[i, m - 1] for i, m in enumerate(sizes)])[:, None]  # [B, 1, H]
        position = torch.tensor([[step.session.length] for step in steps], device=device)
        drafts: list[list[int]] = [[] for _ in steps]
        rounds = max(step.k for step in steps)
        for n in range(rounds):
            draft = model.to_target_ids(model.draft_logits(a[:, -1]).argmax(-1))  # [B]
            for i, token in enumerate(draft.tolist()):
                if n < steps[i].k:
                    drafts[i].append(token)
            if n + 1 < rounds:
                valid = torch.cat([valid, valid.new_ones(b, 1)], dim=1)
                a = model(a, draft.view(b, 1), position, kv, valid[:, None, None])
                position = position + 1
        return drafts

    def _run_one(self, step: _Step) -> list[int]:
        """One session alone: its own KV, no padding."""
        model, session, m = self.model, step.session, len(step.next_tokens)
        kv = session.kv
        hidden = model.fc(step.features.to(self.device, self.dtype))[None]  # [1, m, H]
        tokens = torch.tensor([step.next_tokens], device=self.device)  # [1, m]
        positions = torch.arange(session.length, session.length + m, device=self.device)[None]
        a = model(hidden, tokens, positions, kv)[:, -1:]  # [1, 1, H]
        session.length += m
        drafts: list[int] = []
        position = session.length
        for n in range(step.k):
            draft = model.to_target_ids(model.draft_logits(a[0, -1]).argmax(-1))
            drafts.append(int(draft))
            if n + 1 < step.k:
                a = model(a, draft.view(1, 1), torch.tensor([[position]], device=self.device), kv)
                position += 1
        kv.crop(session.length)  # the rollout's KV is dropped: exact target features replace it
        return drafts

    @staticmethod
    def _stack_kv(steps: list[_Step], past: list[int], longest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's committed KV, [B, kv_heads, longest, head_dim], each sequence left-padded."""
        reference = next(step.session.kv for step, n in zip(steps, past, strict=True) if n)
        k = reference.k.new_zeros(len(steps), reference.k.shape[1], longest, reference.k.shape[3])
        v = torch.zeros_like(k)
        for i, step in enumerate(steps):
            if past[i]:
                k[i, :, longest - past[i] :] = step.session.kv.k[0]
                v[i, :, longest - past[i] :] = step.session.kv.v[0]
        return k, v


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
