"""EAGLE-2 dynamic draft trees (issue 22): instead of a chain of K drafts, a tree of `nodes` drafts whose
shape follows the draft's own confidence, verified by the target in one forward.

    level 1     the root is the session's last committed token; its children are the top_k tokens of the
                draft's log-probabilities at the extend's last output a.
    expansion   at each further depth, the top_k nodes of the last depth by cumulative score (the sum of
                the log-probabilities along the path from the root) are fed in ONE forward of top_k tokens,
                each as a rollout step would feed it: hidden input = its parent's output (a for level 1),
                token = the node, RoPE position = the one the chain's draft at that depth gets, and a mask
                so that it attends to the committed KV and to its own ancestors among the tree nodes fed so
                far (and itself), never to another branch. Each gives its top_k children, scored
                score(parent) + log p(child).
    selection   every candidate (level 1's top_k and each depth's top_k * top_k children) competes: the
                best `nodes` by cumulative score are kept, ordered by depth and then score, so parents come
                first. A child's score is never above its parent's (log p <= 0), and ties (a probability
                that rounds to 1) go to the shallower candidate (a stable sort over candidates listed level
                by level), so the kept set is closed under ancestors.

The ranking is the log-softmax of the draft's logits (a sampled session's divided by its temperature).
Everything stays on the device (masks, positions, ranking, the d2t mapping); the host reads the tree once,
with read_back, at the end. The tree nodes' KV is dropped: the next round's exact target features replace
it. The reference: EAGLE's `topK_genrate` (EAGLE-2 and EAGLE-3), whose `depth` counts expansions after
level 1; here `depth` is the tree's greatest depth, as TreeParams documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draft_server.model import DraftKV, Eagle3Draft
from tandem.params import TreeParams


@dataclass
class Tree:
    """A draft tree on the device, parents before children."""

    tokens: torch.Tensor  # [N] target ids
    parents: torch.Tensor  # [N] int64: the index of each node's parent among the N, -1 for a child of the root
    scores: torch.Tensor  # [N] float32: the cumulative log-probability of each node's path from the root


def tree_shape(params: TreeParams, draft_vocab: int) -> tuple[int, int, int]:
    """(top_k, depth, nodes) as a tree over a draft vocabulary of `draft_vocab` is grown: top_k at most the
    vocabulary, no depth deeper than `nodes` can reach (a node needs its ancestors kept), and nodes at most
    the candidates there are, top_k + (depth - 1) * top_k^2."""
    k = min(params.top_k, draft_vocab)
    depth = min(params.depth, params.nodes)
    return k, depth, min(params.nodes, k + (depth - 1) * k * k)


def _logp(model: Eagle3Draft, a: torch.Tensor, temperature: float | None) -> torch.Tensor:
    """a [..., H] -> the draft's log-probabilities [..., draft_vocab], float32, at `temperature` (None: 1)."""
    logits = model.draft_logits(a).float()
    return (logits if temperature is None else logits / temperature).log_softmax(-1)


def grow_tree(model: Eagle3Draft, a: torch.Tensor, kv: DraftKV, position: torch.Tensor, params: TreeParams,
              temperature: float | None = None) -> Tree:
    """The tree after a lone session's extend: `a` [1, 1, H] its last output, `kv` its committed KV, `position`
    [1, 1] where its first draft goes. The nodes' KV is cropped off `kv` again before this returns."""
    k, depth, n = tree_shape(params, model.config.draft_vocab_size)
    device, committed = a.device, kv.length
    top = _logp(model, a[0, -1], temperature).topk(k)  # level 1: [k]
    scores, draft_ids = [top.values], [top.indices]
    parents = [torch.full((k,), -1, dtype=torch.long, device=device)]  # candidate index of each one's parent
    levels = [torch.full((k,), 1, dtype=torch.long, device=device)]
    # the frontier: the nodes fed next, as candidate indices, with their scores, inputs and ancestry
    frontier, score = torch.arange(k, device=device), top.values
    hidden, tokens = a[:, -1:].expand(1, k, a.shape[-1]), model.to_target_ids(top.indices)[None]  # [1, k, H], [1, k]
    self_only = torch.eye(k, dtype=torch.bool, device=device)
    ancestry = self_only  # [k, fed]: which of the tree nodes fed (this frontier included) each row descends from
    context = torch.ones(k, committed, dtype=torch.bool, device=device)  # every node sees the committed pairs
    offset = k  # candidates so far
    for level in range(2, depth + 1):
        out = model(hidden, tokens, position.expand(1, k) + (level - 2), kv, torch.cat([context, ancestry], 1))
        top = _logp(model, out[0], temperature).topk(k)  # [k, k]: each frontier node's children
        cumulative = (score[:, None] + top.values).flatten()  # [k * k]
        scores.append(cumulative)
        draft_ids.append(top.indices.flatten())
        parents.append(frontier[:, None].expand(k, k).flatten())
        levels.append(torch.full((k * k,), level, dtype=torch.long, device=device))
        if level < depth:  # the next frontier: the best k children, fed after their parents
            best = cumulative.topk(k)
            rows = best.indices // k  # the frontier node each descends from
            frontier, score = offset + best.indices, best.values
            hidden, tokens = out[:, rows], model.to_target_ids(top.indices.flatten()[best.indices])[None]
            ancestry = torch.cat([ancestry[rows], self_only], 1)
        offset += k * k
    kv.crop(committed)  # the tree's KV is dropped
    scores_, parents_, levels_ = torch.cat(scores), torch.cat(parents), torch.cat(levels)
    # the best n; ties to the earlier candidate, so never a child before its parent
    kept = torch.sort(scores_, descending=True, stable=True).indices[:n]
    kept = kept[torch.sort(levels_[kept], stable=True).indices]  # by depth, then score
    index = torch.full_like(parents_, -1)
    index[kept] = torch.arange(n, device=device)  # candidate -> its place among the kept
    parent = parents_[kept]
    parent = torch.where(parent >= 0, index[parent.clamp(min=0)], parent)
    return Tree(model.to_target_ids(torch.cat(draft_ids)[kept]), parent, scores_[kept])
