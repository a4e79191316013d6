"""Several sessions' chain proposes as one batch: their committed KV stacked left-padded, their new pairs
right-padded, one extend forward and one forward per rollout step for all of them (draft_server/engine.py
runs a lone session over its own KV instead)."""

from __future__ import annotations

import numpy as np
import torch

from draft_server.constrained import DraftGrammars
from draft_server.model import DraftKV, Eagle3Draft
from draft_server.rollout import draws_for, parallel_rollout, read_rollout, rollout
from draft_server.steps import _drafts, _Step
from tandem.protocol import Drafts
from tandem.staging import to_device, upload


def propose_batch(model: Eagle3Draft, steps: list[_Step], grammars: DraftGrammars, q_top_n: int,
                  device: torch.device, dtype: torch.dtype) -> list[Drafts]:
    """Two or more sessions' chain proposes: each session's drafts, its KV grown by its committed pairs only."""
    b, config = len(steps), model.config
    past = [step.session.length for step in steps]
    sizes = [len(step.next_tokens) for step in steps]
    # what the rollout reads from the host, uploaded before any forward: on a GPU an upload waits
    # for the stream, so after the extend it would wait for it
    rounds = max(step.k for step in steps)
    masked = 0  # a P-EAGLE head's masked positions, after each session's pairs
    if config.parallel_drafting:
        rounds = min(rounds, config.num_depths)
        masked = max(rounds, 1) - 1
    longest, width = max(past), max(sizes) + masked
    samplers = [step.session.sampler for step in steps]
    draws = draws_for(samplers, [p + m for p, m in zip(past, sizes, strict=True)], rounds, config.draft_vocab_size, device)
    # the extend: every session's new pairs, right-padded, after its KV, left-padded; the host's tables
    # (tokens, positions, the keys each row may attend to, the first draft's position) in one upload
    tokens = np.zeros((b, width), dtype=np.int64)
    positions = np.zeros((b, width), dtype=np.int64)
    valid = np.zeros((b, longest + width), dtype=bool)
    for i, step in enumerate(steps):
        m = sizes[i] + masked
        tokens[i, :m] = step.next_tokens + [config.mask_token_id] * masked
        positions[i] = np.arange(past[i], past[i] + width)
        valid[i, longest - past[i] : longest + m] = True
    tokens, positions, valid, position = upload(
        [(tokens, torch.long), (positions, torch.long), (valid, torch.bool),
         ([[p + m] for p, m in zip(past, sizes, strict=True)], torch.long)], device)  # position: [B, 1]
    # each step's features on our device: a fast path's arrive there, an inline step's on the host
    features = [to_device(step.features, device, dtype) for step in steps]
    if masked:
        mask_hidden = model.mask_hidden.view(1, -1).to(dtype).expand(masked, -1)
        features = [row for f in features for row in (f, mask_hidden)]
    fused = model.fuse(torch.cat(features))  # [sum (m + masked), H]
    hidden = fused.new_zeros(b, width, fused.shape[-1])
    for i, rows in enumerate(fused.split([m + masked for m in sizes])):
        hidden[i, : sizes[i] + masked] = rows
    kv = DraftKV()
    if longest:
        for layer in range(config.num_layers):
            kv.layer(layer).k, kv.layer(layer).v = stack_kv(steps, past, longest, layer)
    causal = torch.ones(width, longest + width, dtype=torch.bool, device=device).tril(diagonal=longest)
    a = model(hidden, tokens, positions, kv, (causal[None] & valid[:, None])[:, None])
    for i, step in enumerate(steps):  # the committed pairs' KV is each session's to keep
        m = sizes[i]
        for layer in range(config.num_layers):
            own, batch = step.session.kv.layer(layer), kv.layer(layer)
            k, v = batch.k[i : i + 1, :, longest : longest + m], batch.v[i : i + 1, :, longest : longest + m]
            own.append(k.clone(), v.clone()) if own.k is None else own.append(k, v)  # no view of the batch kept
        step.session.length += m
    masks = grammars.masks(steps)
    try:
        if config.parallel_drafting:  # every draft from the one forward: row i's last pair, then its masked ones
            a = torch.stack([a[i, m - 1 : m - 1 + rounds] for i, m in enumerate(sizes)])  # [B, rounds, H]
            drafts, q, rows = parallel_rollout(model, q_top_n, a, draws, masks)
        else:  # the rollout: one token per session per step, on top of the batch KV (dropped afterwards)
            a = torch.stack([a[i, m - 1] for i, m in enumerate(sizes)])[:, None]  # [B, 1, H]
            drafts, q, rows = rollout(model, q_top_n, a, kv, position, rounds, draws, valid, masks=masks)
    finally:
        if masks is not None:
            masks.close()
    drafts, qs, _ = read_rollout(drafts, q)  # [B * rounds], [b * rounds]
    out, j = [], 0
    for i, step in enumerate(steps):
        k = min(step.k, rounds)  # a P-EAGLE head drafts up to its num_depths
        mine = drafts[i * rounds : i * rounds + k]
        step.session.proposed = [(mine, rows[i, :k])]
        if samplers[i] is None:
            out.append(_drafts(mine, None))
        else:  # the sampled rows come in batch order
            out.append(_drafts(mine, qs[j * rounds : j * rounds + k]))
            j += 1
    return out


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
