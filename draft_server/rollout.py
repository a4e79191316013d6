"""The K-step rollout, on the device from end to end: one host sync per rollout (issue 17).

    rollout    K steps from the last output a: pick a draft from a's logits, feed it at the next position,
               pick again... Positions are a device tensor advanced on the device; the argmax, the
               sampled draw and the d2t mapping (draft id -> target id) run there too.
    uniforms   a sampled draft is drawn with the uniform of its sequence position (sampling.py). The host
               knows the positions (or, after an ahead, the few it can be): it computes the uniforms
               before the rollout and sends them along, rather than reading positions back.
    read_back  the one sync: the drafts (and the sampled rows' q) of every row, copied to the host at the
               end in a single read.

Greedy drafts are the argmax as before, and sampled ones the same draws from the same q; only when the
host learns them has changed.
"""

from __future__ import annotations

import torch

from draft_server.model import DraftKV, Eagle3Draft
from draft_server.sampling import DraftSampler, draft_q, draw
from tandem.protocol import DraftProbs


def rollout(model: Eagle3Draft, top_n: int, a: torch.Tensor, kv: DraftKV, position: torch.Tensor, rounds: int,
            samplers: list[DraftSampler | None], uniforms: torch.Tensor | None, valid: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor]:
    """`rounds` drafts per row: each picked from the last output a [B, 1, H], then fed at `position` [B, 1]
    (the last one is not fed). uniforms [b, rounds]: the sampled rows' (uniforms_for). valid [B, S]: the
    keys each row of a padded batch KV attends to, grown by one a step (None: a lone session, causal).
    -> drafts [B, rounds] (target ids); the sampled rows' q, (ids [b, rounds, N] target ids,
    probs [b, rounds, N]), or None; the outputs whose logits proposed the drafts [B, rounds, H]."""
    drafts, ids, probs, rows = [], [], [], []
    for n in range(rounds):
        draft, q = pick(model, top_n, model.draft_logits(a[:, -1]), samplers,
                        None if uniforms is None else uniforms[:, n])  # [B]
        drafts.append(draft)
        rows.append(a[:, -1])
        if q is not None:
            ids.append(q[0])
            probs.append(q[1])
        if n + 1 < rounds:
            mask = None
            if valid is not None:
                valid = torch.cat([valid, valid.new_ones(valid.shape[0], 1)], dim=1)
                mask = valid[:, None, None]
            a = model(a, draft[:, None], position, kv, mask)
            position = position + 1
    if not drafts:  # K = 0
        return position.new_zeros(len(samplers), 0), None, a[:, :0]
    q = (torch.stack(ids, 1), torch.stack(probs, 1)) if ids else None
    return torch.stack(drafts, 1), q, torch.stack(rows, 1)


def pick(model: Eagle3Draft, top_n: int, logits: torch.Tensor, samplers: list[DraftSampler | None],
         uniforms: torch.Tensor | None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """logits [B, Vd] -> each row's draft as a target id [B]: the argmax for a greedy session, drawn from q
    with its uniform (`uniforms` [b], the sampled rows') for a sampled one; with the sampled rows' q
    (target ids [b, N], probs [b, N]), None when no row samples."""
    rows = [i for i, s in enumerate(samplers) if s is not None]
    if not rows:
        return model.to_target_ids(logits.argmax(-1)), None
    every = len(rows) == len(samplers)
    ids, probs = draft_q(logits if every else logits[rows], [samplers[i] for i in rows], top_n)  # [b, N]
    picked = ids.gather(1, draw(probs, uniforms)[:, None])[:, 0]  # [b]
    if every:
        chosen = picked
    else:
        chosen = logits.argmax(-1)
        chosen[rows] = picked
    return model.to_target_ids(chosen), (model.to_target_ids(ids), probs)


def uniforms_for(samplers: list[DraftSampler | None], first: list[int], rounds: int, device: torch.device
                 ) -> torch.Tensor | None:
    """[b, rounds] float64 on `device`: the uniforms that draw the sampled rows' drafts at sequence
    positions first[i], first[i] + 1, ...; None when no row samples."""
    rows = [(s, p) for s, p in zip(samplers, first, strict=True) if s is not None]
    if not rows:
        return None
    return torch.tensor([[s.uniform(p + n) for n in range(rounds)] for s, p in rows], dtype=torch.float64,
                        device=device)


def read_back(*tensors: torch.Tensor) -> list[list]:
    """The rollout's one host sync: device tensors -> nested lists, read in a single copy. Integer tensors
    (token ids) come back as ints, the rest as floats; packed as float64 when they mix, which is exact
    for ids below 2**53 and for float32 probabilities."""
    if all(not t.is_floating_point() for t in tensors):
        flat = torch.cat([t.reshape(-1).long() for t in tensors]).tolist()
    else:
        flat = torch.cat([t.reshape(-1).double() for t in tensors]).tolist()
    out, start = [], 0
    for t in tensors:
        part = flat[start : start + t.numel()]
        start += t.numel()
        if not t.is_floating_point():
            part = [int(x) for x in part]
        out.append(_nest(part, list(t.shape)))
    return out


def _nest(flat: list, shape: list[int]) -> list:
    if len(shape) <= 1:
        return flat
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def q_support(ids: list[list[int]], probs: list[list[float]]) -> list[DraftProbs]:
    """One row's q per draft, [K][N] each as draft_q left them, cut to the support (the non-zero prefix)."""
    out = []
    for row_ids, row_probs in zip(ids, probs, strict=True):
        support = sum(p > 0 for p in row_probs)
        out.append(DraftProbs(row_ids[:support], row_probs[:support]))
    return out
