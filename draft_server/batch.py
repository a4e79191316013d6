"""Several sessions' chain proposes as one batch: their committed KV copied, left-padded, into the engine's
batch buffers (BatchBuffers: the same storage every step, no per-step allocation), their new pairs
right-padded after it, then one extend forward and one forward per rollout step for all of them, each writing
its columns in place. Where CUDA graphs are on (draft_server/graphs.py) a batch all greedy or all sampled is padded to a bucket of
rows and columns, lone sessions too, and its rollout replays the bucket's graph; elsewhere a lone session runs
over its own KV (draft_server/engine.py).

The columns of a batch's buffers, row i of past_i committed pairs and m_i new ones (width = the most new):

    [ padding | row i's past | its m_i pairs, padding to width | the rollout's K-1 steps ]
              ^ pairs_at - past_i  ^ pairs_at                  ^ start = pairs_at + width
"""

from __future__ import annotations

import numpy as np
import torch

from draft_server.constrained import DraftGrammars
from draft_server.graphs import RolloutGraphs, columns_bucket, rows_bucket
from draft_server.model import DraftKV, Eagle3Draft
from draft_server.rollout import draws_for, parallel_rollout, read_rollout, rollout
from draft_server.sampling import DraftSampler
from draft_server.steps import _drafts, _Step
from tandem.protocol import Drafts
from tandem.staging import to_device, upload

PADDING_SAMPLER = DraftSampler(temperature=1.0, top_k=0, top_p=1.0, key=0)


class BatchBuffers:
    """The batched propose's working memory, kept from step to step: each decoder layer's k and v
    [rows, kv_heads, columns, head_dim] and the keys each row may attend [rows, columns]. A batch takes views of
    the first rows and columns it needs; the buffers grow when a batch needs more (the columns at least doubling,
    so a growing context regrows them a few times only), and `generation` counts the growths: a graph captured
    over the old ones must go."""

    def __init__(self, model: Eagle3Draft, device: torch.device, dtype: torch.dtype):
        attention = model.midlayer.self_attn
        self.layers, self.heads, self.head_dim = model.config.num_layers, attention.num_kv_heads, attention.head_dim
        self.device, self.dtype = device, dtype
        self.rows = self.columns = self.generation = 0
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=device)

    def take(self, rows: int, columns: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Views of the first `rows` and `columns`: each layer's (k, v) and the keys each row may attend."""
        if rows > self.rows or columns > self.columns:
            self.rows = max(rows, self.rows)
            self.columns = self.columns if columns <= self.columns else max(columns, 2 * self.columns)
            self.kv, self.valid = [], self.valid.new_zeros(0, 0)  # the old buffers go before the new are made
            shape = (self.rows, self.heads, self.columns, self.head_dim)
            self.kv = [tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2))
                       for _ in range(self.layers)]
            self.valid = torch.zeros(self.rows, self.columns, dtype=torch.bool, device=self.device)
            self.generation += 1
        return [(k[:rows, :, :columns], v[:rows, :, :columns]) for k, v in self.kv], self.valid[:rows, :columns]

    def lone(self, kv: DraftKV, length: int, more: int) -> tuple[DraftKV, torch.Tensor]:
        """A lone session's KV of `length` pairs copied into row 0, left-padded to its bucket of columns, with
        `more` columns after them -> a KV over the buffers, and the row's keys [1, columns + more]: its pairs'
        and the `more`."""
        start = columns_bucket(length)
        stores, valid = self.take(1, start + more)
        valid.fill_(True)
        valid[:, : start - length] = False
        for layer, (k, v) in enumerate(stores):
            own = kv.layer(layer)
            k[0, :, start - length : start] = own.k[0]
            v[0, :, start - length : start] = own.v[0]
        return DraftKV.over(stores, start), valid


def propose_batch(model: Eagle3Draft, steps: list[_Step], grammars: DraftGrammars, q_top_n: int,
                  device: torch.device, dtype: torch.dtype, buffers: BatchBuffers,
                  graphs: RolloutGraphs | None = None) -> list[Drafts]:
    """The sessions' chain proposes: each session's drafts, its KV grown by its committed pairs only."""
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
    graphed = graphs is not None and graphs.fits(steps, config, rounds)
    # the rows (padding rows: one zero pair each) and the column the rollout starts at, a graph's bucket
    rows, start = (rows_bucket(b), columns_bucket(longest + width)) if graphed else (b, longest + width)
    pairs_at = start - width
    samplers = [step.session.sampler for step in steps]
    # a sampled graph's padding rows draw too, with settings of their own
    padding = [PADDING_SAMPLER if samplers[0] is not None else None] * (rows - b)
    draws = draws_for(samplers + padding, [p + m for p, m in zip(past, sizes, strict=True)] + [1] * (rows - b),
                      rounds, config.draft_vocab_size, device)
    # the extend's host tables (tokens, positions, the keys each row may attend, the first draft's position) in
    # one upload
    tokens = np.zeros((rows, width), dtype=np.int64)
    positions = np.zeros((rows, width), dtype=np.int64)
    valid = np.zeros((rows, start + max(rounds - 1, 0)), dtype=bool)
    valid[:, start:] = True  # the rollout's columns
    valid[b:, pairs_at] = True
    for i, step in enumerate(steps):
        m = sizes[i] + masked
        tokens[i, :m] = step.next_tokens + [config.mask_token_id] * masked
        positions[i] = np.arange(past[i], past[i] + width)
        valid[i, pairs_at - past[i] : pairs_at + m] = True
    firsts = [[p + m] for p, m in zip(past, sizes, strict=True)] + [[1]] * (rows - b)
    tokens, positions, valid_rows, position = upload(
        [(tokens, torch.long), (positions, torch.long), (valid, torch.bool), (firsts, torch.long)], device)
    stores, valid = buffers.take(rows, valid_rows.shape[1])
    valid.copy_(valid_rows)
    kv = DraftKV.over(stores, pairs_at)
    for i, step in enumerate(steps):  # the committed past, left-padded
        for layer, (k, v) in enumerate(stores):
            if past[i]:
                own = step.session.kv.layer(layer)
                k[i, :, pairs_at - past[i] : pairs_at] = own.k[0]
                v[i, :, pairs_at - past[i] : pairs_at] = own.v[0]
    # each step's features on our device: a fast path's arrive there, an inline step's on the host
    features = [to_device(step.features, device, dtype) for step in steps]
    if masked:
        mask_hidden = model.mask_hidden.view(1, -1).to(dtype).expand(masked, -1)
        features = [row for f in features for row in (f, mask_hidden)]
    fused = model.fuse(torch.cat(features))  # [sum (m + masked), H]
    hidden = fused.new_zeros(rows, width, fused.shape[-1])
    for i, part in enumerate(fused.split([m + masked for m in sizes])):
        hidden[i, : sizes[i] + masked] = part
    causal = torch.ones(width, start, dtype=torch.bool, device=device).tril(diagonal=pairs_at)
    a = model(hidden, tokens, positions, kv, (causal[None] & valid[:, None, :start])[:, None])  # [rows, width, H]
    for i, step in enumerate(steps):  # the committed pairs' KV is each session's to keep
        m = sizes[i]
        for layer, (k, v) in enumerate(stores):
            own = step.session.kv.layer(layer)
            k, v = k[i : i + 1, :, pairs_at : pairs_at + m], v[i : i + 1, :, pairs_at : pairs_at + m]
            own.append(k.clone(), v.clone()) if own.k is None else own.append(k, v)  # no view of the buffers kept
        step.session.length += m
    masks = grammars.masks(steps)
    lasts = sizes + [1] * (rows - b)  # the column of each row's last pair
    try:
        if config.parallel_drafting:  # every draft from the one forward: row i's last pair, then its masked ones
            a = torch.stack([a[i, m - 1 : m - 1 + rounds] for i, m in enumerate(sizes)])  # [B, rounds, H]
            drafts, q, outputs = parallel_rollout(model, q_top_n, a, draws, masks)
        else:  # the rollout: one token per row per step, in the buffers' columns from `start` on
            a = torch.stack([a[i, m - 1] for i, m in enumerate(lasts)])[:, None]  # [rows, 1, H]
            if graphed:
                drafts, q, outputs = graphs.rollout(a, kv, position, rounds, valid, draws)
            else:
                drafts, q, outputs = rollout(model, q_top_n, a, kv, position, rounds, draws, valid, masks=masks)
    finally:
        if masks is not None:
            masks.close()
    drafts, qs, _ = read_rollout(drafts[:b], q and tuple(t[:b] for t in q))  # [B * rounds], [b * rounds]
    out, j = [], 0
    for i, step in enumerate(steps):
        k = min(step.k, rounds)  # a P-EAGLE head drafts up to its num_depths
        mine = drafts[i * rounds : i * rounds + k]
        step.session.proposed = [(mine, outputs[i, :k])]
        if samplers[i] is None:
            out.append(_drafts(mine, None))
        else:  # the sampled rows come in batch order
            out.append(_drafts(mine, qs[j * rounds : j * rounds + k]))
            j += 1
    return out
