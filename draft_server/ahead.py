"""Overlap's ahead step as one function of tensors (`branches`), run eagerly or, for a lone greedy session,
as one compiled call (GreedyAhead).

While the target verifies drafts d_1..d_J, the draft appends the pairs the last verify committed, feeds the
assumed drafts as a rollout would, ranks the verify's outcomes (j drafts accepted, then c: log P(j) from the
verifies so far, log P(c | j) from its logits, c != d_{j+1}) and rolls out K drafts for the best B of them,
one batch row each over the shared KV, masked to its accepted prefix. See draft_server/engine.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from draft_server.model import DraftKV, Eagle3Draft
from draft_server.rollout import Draws, plain, rollout, warm_inputs
from tandem.compiling import compile_graphs
from tandem.defaults import OVERLAP_BRANCHES

log = logging.getLogger("tandem.draft")


def branches(model: Eagle3Draft, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None, assumed: torch.Tensor,
             prefix: torch.Tensor, draft_id: torch.Tensor, per_fork: int, count: int, rounds: int,
             temperature: float | None = None, draws: Draws | None = None, top_n: int = 0) -> tuple:
    """One ahead over a session's committed KV k, v (of `start` pairs):
    features [m, 3Ht] and tokens [m] the new committed pairs at positions [m] (start..); with m = 0 (the pairs
    went with the propose before) tokens are the J assumed drafts at positions start.., fed with `rows` [J, H],
    the outputs that proposed them. assumed [J] (target ids), prefix [J+1] log P(j accepted), draft_id [vocab]
    (target id -> draft id, -1 outside); `per_fork` bonus candidates per outcome j, the best `count` outcomes;
    temperature and draws for a sampled session.
    -> drafts [B, rounds] (target ids), their q (sampled) or None, the outputs that proposed them
    [B, rounds, H], forks [B] (drafts accepted), bonus [B] (target ids), and the KV k, v grown by the m pairs
    and the J assumed drafts (the caller keeps the pairs')."""
    kv = DraftKV()
    kv.k, kv.v = k, v
    m, j_max = features.shape[0], assumed.shape[0]
    if m == 0:
        # right after a propose: the assumed drafts fed with the hidden states that proposed them, exactly what a
        # rollout computes. After a hit (m > 0) they are rolled again, one step each, from the exact new pairs
        # (J more one-token forwards, hidden behind the verify) rather than fed those stale states
        out = model(rows[None], tokens[None], positions[None], kv)[0]  # [J, H]
        fork = torch.cat([rows[:1], out])  # [J+1, H]
    else:
        a = model(model.fuse(features)[None], tokens[None], positions[None], kv)[:, -1:]  # [1, 1, H]
        forks = [a[0, 0]]
        position = positions[-1:][None]
        for j in range(j_max):
            a = model(a, assumed[j].view(1, 1), position + 1 + j, kv)
            forks.append(a[0, 0])
        fork = torch.stack(forks)  # [J+1, H]
    committed = kv.k, kv.v
    base = kv.k.shape[2] - j_max  # the committed pairs
    device = fork.device
    # fork j (j drafts accepted): the hidden state whose logits pick the token after them
    logits = model.draft_logits(fork).float()  # [J+1, draft_vocab]
    if temperature is not None:  # what the bonus is drawn from is nearer the sampled distribution
        logits = logits / temperature
    logp = logits.log_softmax(-1)
    rejected = draft_id[assumed]  # [J] draft ids, -1 outside
    ruled_out = torch.zeros_like(logp, dtype=torch.bool)
    ruled_out[torch.arange(j_max, device=device), rejected.clamp(min=0)] = rejected >= 0
    logp = logp.masked_fill(ruled_out, float("-inf")).log_softmax(-1)
    top = logp.topk(per_fork, dim=-1)  # [J+1, n]
    score = (prefix[:, None] + top.values).flatten()
    best = score.topk(count).indices  # [B], all on the device until the one read at the end
    forks = best // per_fork  # [B]: how many drafts each branch accepts
    bonus = model.to_target_ids(top.indices[forks, best % per_fork])  # [B]
    branch_kv = DraftKV()
    branch_kv.k = kv.k.expand(count, -1, -1, -1)  # [B, kv_heads, base+J, hd]
    branch_kv.v = kv.v.expand(count, -1, -1, -1)
    valid = torch.arange(base + j_max, device=device)[None] < (base + forks)[:, None]  # [B, base+J]
    valid = torch.cat([valid, valid.new_ones(count, rounds)], dim=1)  # the bonus's column, the rollout's
    position = (base + forks)[:, None]  # [B, 1]: where each branch's bonus goes
    a = model(fork[forks][:, None], bonus[:, None], position, branch_kv,
              valid[:, None, None, : base + j_max + 1])  # [B, 1, H]
    # the token after the one at `position`: keyed as a propose after that outcome would key it
    if draws is not None:
        draws = replace(draws, uniforms=draws.uniforms.gather(1, forks[:, None] + torch.arange(rounds, device=device)))
    drafts, q, rows = rollout(model, top_n, a, branch_kv, position + 1, rounds, draws, valid)
    return drafts, q, rows, forks, bonus, *committed


class GreedyAhead:
    """A lone greedy session's ahead as one compiled call: `branches` over an unpacked copy of the head (the
    one GreedyStep compiled), a graph per K of KS, per one new pair, more, or none, for BRANCHES branches
    (the coordinator's default), dynamic in the pairs and in the KV's length; compiled at start-up. Other
    shapes run eagerly."""

    KS = range(1, 6)
    BRANCHES = OVERLAP_BRANCHES

    def __init__(self, model: Eagle3Draft, draft_id: torch.Tensor):
        started = time.monotonic()
        self.model, self.draft_id = model, draft_id
        self._ahead = compile_graphs(self._branches, 4 * len(self.KS), dynamic=True)
        device, dtype = model.d2t.device, model.fc.weight.dtype
        with torch.inference_mode():  # as the engine calls it: inference tensors, a contiguous KV
            for rounds in self.KS:
                for m in (0, 1, 2):  # with none, the tokens are the assumed drafts, fed with their rows
                    rows = torch.zeros(rounds, model.config.hidden_size, device=device, dtype=dtype) if m == 0 else None
                    self(*warm_inputs(model, m, m or rounds), rows, torch.zeros(rounds, dtype=torch.long, device=device),
                         torch.zeros(rounds + 1, device=device), self.BRANCHES, rounds)
        log.info("compiled the draft's greedy ahead for K = %d..%d in %.0f s", self.KS[0], self.KS[-1],
                 time.monotonic() - started)

    def fits(self, rounds: int, assumed: int, per_fork: int, count: int) -> bool:
        """Whether an ahead of these sizes has a graph (the ints are the graphs' constants: others would compile)."""
        return rounds in self.KS and assumed == rounds and per_fork == count == self.BRANCHES

    def _branches(self, features, tokens, positions, k, v, rows, assumed, prefix, per_fork: int, rounds: int):
        return branches(self.model, features, tokens, positions, k, v, rows, assumed, prefix, self.draft_id,
                        per_fork, self.BRANCHES, rounds)

    def __call__(self, features, tokens, positions, k, v, rows, assumed, prefix, per_fork: int, rounds: int):
        if not features.is_inference():  # the graphs are guarded on it: ours were traced on inference tensors
            features = features.clone()
        if rows is not None and not rows.is_inference():
            rows = rows.clone()
        return self._ahead(features, tokens, positions, plain(k), plain(v), rows, assumed, prefix, per_fork, rounds)

