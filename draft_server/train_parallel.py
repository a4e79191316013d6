"""Training a P-EAGLE head (parallel drafting): all K drafts of a round in one forward (arXiv 2602.01469, as
speculators and NeMo Automodel train it). `train_draft(..., parallel=ParallelDrafting(...))` runs it; the
data, the teacher and the loop are EAGLE-3's (draft_server/train.py, teacher.py, train_data.py).

Where EAGLE-3 unrolls K sequential steps (TTT), P-EAGLE flattens the depths of a sequence onto one axis.
An element is (anchor i, depth d): depth 0 is the committed pair (fc(F_i), x_{i+1}) at RoPE position i, as
the extend reads it; depth d >= 1 is the d-th masked position after it, (fc(mask_hidden), mask_token_id) at
position i+d. Element (i, d) is scored against the target at i+1+d (its logits predict x_{i+d+2}): at
inference the last new pair gives d_1 and masked position j gives d_{1+j}.

COD (conditional drop-token) sampling keeps the flat axis short: depth 0 keeps every anchor, depth d keeps
max(down_sample_ratio**d, down_sample_ratio_min) of them, drawn among the anchors whose chain reached depth
d-1 (a chain is never cut in the middle). The cross-depth mask (`cross_depth_mask`, a flex_attention
mask_mod) lets element (i, d) see the depth-0 elements of anchors <= i (the committed context) and the
depths <= d of its own chain: exactly what a causal forward over [pairs | masked positions] sees at
inference. Rows of a batch are padded to the longest; a padded element is depth 0 at an anchor past every
real one, so no real element sees it. The forward reads the mask dense (rows are a few hundred elements:
training heads the size of the demo's), built by evaluating the mask_mod over broadcast indices.

Each depth's loss is the mean soft cross entropy of its elements against the target's softmax over the
draft vocabulary; the depths count equally.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from draft_server.model import Eagle3Config, Eagle3Draft
from draft_server.train import StepStats


def cross_depth_mask(anchor: torch.Tensor, depth: torch.Tensor):
    """The P-EAGLE attention pattern as a flex_attention mask_mod over elements [B, L] (anchor, depth):
    query q sees key k when k is depth 0 of an anchor <= q's, or a depth <= q's of q's own chain."""

    def mask_mod(b, h, q, k):
        qa, ka, qd, kd = anchor[b, q], anchor[b, k], depth[b, q], depth[b, k]
        return ((kd == 0) & (ka <= qa)) | ((ka == qa) & (kd <= qd))

    return mask_mod


def dense_mask(anchor: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """cross_depth_mask evaluated for every query and key -> [B, 1, L, L] bool, True attends."""
    b, n = anchor.shape
    rows = torch.arange(b, device=anchor.device)[:, None, None]
    index = torch.arange(n, device=anchor.device)
    return cross_depth_mask(anchor, depth)(rows, None, index[None, :, None], index[None, None, :])[:, None]


def cod_sample(lengths: list[int], anchors: int, num_depths: int, ratio: float, ratio_min: float,
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """COD sampling of one batch: row b has `anchors` depth-0 elements and, at depth d, a random subset of
    the chains that reached depth d-1 whose target i+1+d is inside its length. -> (anchor, depth, real)
    [B, L], the rows padded to the longest (real False there)."""
    rows = []
    for length in lengths:
        anchor, depth = [torch.arange(anchors)], [torch.zeros(anchors, dtype=torch.long)]
        chains = torch.arange(max(0, min(anchors, length - 1)))  # anchors whose depth-0 target exists
        valid0 = len(chains)
        for d in range(1, num_depths):
            chains = chains[chains + 1 + d < length]
            size = int(max(0, valid0 - d) * max(ratio**d, ratio_min))
            if size <= 0 or not len(chains):
                break
            if len(chains) > size:
                chains = chains[torch.randperm(len(chains), generator=generator)[:size]].sort().values
            anchor.append(chains)
            depth.append(torch.full((len(chains),), d, dtype=torch.long))
        rows.append((torch.cat(anchor), torch.cat(depth)))
    width = max(len(a) for a, _ in rows)
    anchor = torch.empty(len(rows), width, dtype=torch.long)
    depth = torch.zeros(len(rows), width, dtype=torch.long)
    real = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (a, d) in enumerate(rows):
        n = len(a)
        anchor[i, :n], depth[i, :n], real[i, :n] = a, d, True
        anchor[i, n:] = anchors + torch.arange(width - n)  # past every real anchor: seen by no real element
    return anchor, depth, real


@dataclass
class ParallelDrafting:
    """What makes train_draft train a P-EAGLE head: its shape (layers, depths, the mask token) and COD."""

    num_depths: int = 5
    num_layers: int = 1
    mask_token_id: int | None = None  # None: the target's pad token, else its EOS
    down_sample_ratio: float = 0.7
    down_sample_ratio_min: float = 0.2
    seed: int = 0

    def __post_init__(self):
        if self.num_depths < 1 or self.num_layers < 1:
            raise ValueError(f"num_depths and num_layers must be >= 1, got {self.num_depths}, {self.num_layers}")
        if not 0 < self.down_sample_ratio <= 1 or not 0 <= self.down_sample_ratio_min <= 1:
            raise ValueError(f"down_sample_ratio must be in (0, 1] and down_sample_ratio_min in [0, 1], got "
                             f"{self.down_sample_ratio}, {self.down_sample_ratio_min}")
        self._generator = torch.Generator().manual_seed(self.seed)

    def head_config(self, config: Eagle3Config, target_config) -> Eagle3Config:
        """The EAGLE-3 head's config (train.draft_config_for) made a P-EAGLE head's."""
        mask = self.mask_token_id
        if mask is None:
            mask = getattr(target_config, "pad_token_id", None)
            if mask is None:
                eos = getattr(target_config, "eos_token_id", None)
                mask = (eos[0] if isinstance(eos, list) else eos) or 0
        return replace(config, num_layers=self.num_layers, parallel_drafting=True, mask_token_id=int(mask),
                       num_depths=self.num_depths, down_sample_ratio=self.down_sample_ratio,
                       down_sample_ratio_min=self.down_sample_ratio_min)

    def loss(self, draft: Eagle3Draft, ids: torch.Tensor, lengths: torch.Tensor, features: torch.Tensor,
             target_probs: torch.Tensor, target_best: torch.Tensor) -> tuple[torch.Tensor, StepStats]:
        """One batch (ids [B, T], lengths [B], features [B, T, 3Ht], target_probs [B, T, Vd], target_best
        [B, T], as train_data.Batches gives them) -> the loss and each depth's accuracy."""
        return parallel_loss(draft, ids, lengths, features, target_probs, target_best, *cod_sample(
            lengths.tolist(), ids.shape[1] - 1, self.num_depths, self.down_sample_ratio, self.down_sample_ratio_min,
            self._generator))


def parallel_forward(draft: Eagle3Draft, ids: torch.Tensor, features: torch.Tensor, anchor: torch.Tensor,
                     depth: torch.Tensor) -> torch.Tensor:
    """The flat forward over the elements (anchor, depth) [B, L] -> their outputs a [B, L, H]."""
    s = ids.shape[1] - 1
    device = ids.device
    anchor, depth = anchor.to(device), depth.to(device)
    at = anchor.clamp(max=s - 1)
    rows = torch.arange(ids.shape[0], device=device)[:, None]
    first = depth == 0
    real_features = features[rows, at]  # [B, L, 3Ht]
    mask_hidden = draft.mask_hidden.to(real_features.dtype).expand_as(real_features)
    hidden = draft.fuse(torch.where(first[..., None], real_features, mask_hidden))
    tokens = torch.where(first, ids[rows, at + 1], draft.config.mask_token_id)
    positions = torch.where(anchor < s, anchor + depth, 0)
    return draft(hidden, tokens, positions, None, dense_mask(anchor, depth))


def parallel_loss(draft: Eagle3Draft, ids, lengths, features, target_probs, target_best, anchor: torch.Tensor,
                  depth: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, StepStats]:
    device = ids.device
    anchor, depth, real = anchor.to(device), depth.to(device), real.to(device)
    a = parallel_forward(draft, ids, features, anchor, depth)
    rows = torch.arange(ids.shape[0], device=device)[:, None]
    at = (anchor + 1 + depth).clamp(max=ids.shape[1] - 1)  # the target position each element is scored at
    p, best = target_probs[rows, at], target_best[rows, at]  # [B, L, Vd], [B, L]
    valid = real & (anchor + 1 + depth < lengths.to(device)[:, None])
    logits = draft.draft_logits(a)
    ce = -(p * F.log_softmax(logits, dim=-1)).sum(-1)  # [B, L]
    scored = valid & draft.t2d[best]  # as train.ttt_loss: a target the draft cannot propose teaches nothing
    total, counted, accuracy = logits.new_zeros(()), 0, []
    with torch.no_grad():
        picks = draft.to_target_ids(logits.argmax(-1))
    for d in range(int(depth.max()) + 1):
        at_depth = depth == d
        mine = scored & at_depth
        if mine.any():
            total = total + (ce * mine).sum() / mine.sum()
            counted += 1
        here = valid & at_depth
        accuracy.append(float(((picks == best) & here).sum() / here.sum().clamp(min=1)))
    loss = total / max(counted, 1)
    return loss, StepStats(loss=loss.item(), accuracy=accuracy)
