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

    sampled     a sampled session's expanded nodes (the root, and each frontier node) draw their FIRST child
                from the draft's own q (sampling.py's draft_q: tempered, top-k/top-p, cut to top_n), with the
                uniform the chain's draft at that depth uses (DraftSampler.uniform of the position the child
                takes; nodes of one depth share it); their other top_k - 1 children are the likeliest tokens
                besides it. Every child is scored by the tempered log-softmax as before. Each kept sampled
                child carries the q it was drawn from, so that the target accepts it by min(1, p/q) and its
                siblings by recursive rejection, losslessly; the deterministic ones carry an empty q.

Everything stays on the device (masks, positions, ranking, draws, the d2t mapping); the host reads the tree
(tokens, parents, q) once, with read_rollout, at the end. The tree nodes' KV is dropped: the next round's exact
target features replace it. The reference: EAGLE's `topK_genrate` (EAGLE-2 and EAGLE-3), whose `depth` counts
expansions after level 1; here `depth` is the tree's greatest depth, as TreeParams documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draft_server.model import DraftKV, Eagle3Draft
from draft_server.rollout import Draws
from draft_server.sampling import draft_q, draw
from tandem.params import TreeParams


@dataclass
class Tree:
    """A draft tree on the device, parents before children."""

    tokens: torch.Tensor  # [N] target ids
    parents: torch.Tensor  # [N] int64: the index of each node's parent among the N, -1 for a child of the root
    scores: torch.Tensor  # [N] float32: the cumulative log-probability of each node's path from the root
    # a sampled session's: each node's q as rollout returns a draft's, (ids [N, W] target ids, probs [N, W],
    # support [N]); a support of 0 for a node that was not drawn (None: a greedy session's tree)
    q: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def tree_shape(params: TreeParams, draft_vocab: int) -> tuple[int, int, int]:
    """(top_k, depth, nodes) as a tree over a draft vocabulary of `draft_vocab` is grown: top_k at most the
    vocabulary, no depth deeper than `nodes` can reach (a node needs its ancestors kept), and nodes at most
    the candidates there are, top_k + (depth - 1) * top_k^2."""
    k = min(params.top_k, draft_vocab)
    depth = min(params.depth, params.nodes)
    return k, depth, min(params.nodes, k + (depth - 1) * k * k)


def _children(model: Eagle3Draft, out: torch.Tensor, k: int, temperature: float | None, draws: Draws | None,
              top_n: int, level: int) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """The children of b expanded nodes, from their outputs `out` [b, H], at depth `level` -> their draft ids
    [b, k] and log-probabilities [b, k] (tempered); with `draws`, column 0 drawn from q with the uniform of
    that depth (ranked as its parent: log-probability 0), and q (draft ids [b, W], probs [b, W]) as draft_q
    gives it; else the top_k and None."""
    logits = model.draft_logits(out)
    logp = (logits.float() if temperature is None else logits.float() / temperature).log_softmax(-1)
    top = logp.topk(k)
    if draws is None:
        return top.indices, top.values, None
    ids, probs = draft_q(logits, draws.settings, top_n)  # [b, W]: as the chain's pick draws
    drawn = ids.gather(1, draw(probs, draws.uniforms[0, level - 1].expand(ids.shape[0]))[:, None])  # [b, 1]
    # its siblings: the top_k without it, or without the last of them when it is not among them (a stable
    # argsort of the dropped flag, on the device: no boolean indexing, which would sync)
    same = top.indices == drawn
    dropped = torch.where(same.any(1, keepdim=True), same, torch.arange(k, device=logp.device) == k - 1)
    rest = top.indices.gather(1, dropped.long().argsort(dim=1, stable=True)[:, : k - 1])
    children = torch.cat([drawn, rest], 1)
    # the drawn child ranks with its parent's score (log 1): the chain of drawn children, what a sampled chain
    # would verify, is always kept and expanded, so the tree accepts at least what that chain would
    ranked = logp.gather(1, children).index_fill(1, torch.zeros(1, dtype=torch.long, device=logp.device), 0.0)
    return children, ranked, (ids, probs)


def grow_tree(model: Eagle3Draft, a: torch.Tensor, kv: DraftKV, position: torch.Tensor, params: TreeParams,
              temperature: float | None = None, draws: Draws | None = None, top_n: int = 0) -> Tree:
    """The tree after a lone session's extend: `a` [1, 1, H] its last output, `kv` its committed KV, `position`
    [1, 1] where its first draft goes. A sampled session's: `temperature`, and `draws` (draws_for its one row
    from that position, at least `depth` uniforms) with the q cut `top_n` draw each expanded node's first
    child. The nodes' KV is cropped off `kv` again before this returns."""
    k, depth, n = tree_shape(params, model.config.draft_vocab_size)
    device, committed = a.device, kv.length
    ids, logp, q = _children(model, a[0, -1:], k, temperature, draws, top_n, 1)  # level 1: [1, k]
    scores, draft_ids = [logp[0]], [ids[0]]
    parents = [torch.full((k,), -1, dtype=torch.long, device=device)]  # candidate index of each one's parent
    levels = [torch.full((k,), 1, dtype=torch.long, device=device)]
    drawn = torch.arange(k, device=device) == 0  # [k]: the candidates drawn from q (column 0 of each node's)
    q_rows, q_ids, q_probs = [torch.where(drawn, 0, -1)], [q[0]] if q else [], [q[1]] if q else []
    # the frontier: the nodes fed next, as candidate indices, with their scores, inputs and ancestry
    frontier, score = torch.arange(k, device=device), logp[0]
    hidden, tokens = a[:, -1:].expand(1, k, a.shape[-1]), model.to_target_ids(ids)  # [1, k, H], [1, k]
    self_only = torch.eye(k, dtype=torch.bool, device=device)
    ancestry = self_only  # [k, fed]: which of the tree nodes fed (this frontier included) each row descends from
    context = torch.ones(k, committed, dtype=torch.bool, device=device)  # every node sees the committed pairs
    offset = k  # candidates so far
    for level in range(2, depth + 1):
        out = model(hidden, tokens, position.expand(1, k) + (level - 2), kv, torch.cat([context, ancestry], 1))
        ids, logp, q = _children(model, out[0], k, temperature, draws, top_n, level)  # [k, k]: each node's children
        cumulative = (score[:, None] + logp).flatten()  # [k * k]
        scores.append(cumulative)
        draft_ids.append(ids.flatten())
        parents.append(frontier[:, None].expand(k, k).flatten())
        levels.append(torch.full((k * k,), level, dtype=torch.long, device=device))
        if q:  # node r's drawn child: q row (rows so far) + r
            rows_so_far = 1 + (level - 2) * k
            q_rows.append(torch.where(drawn, torch.arange(rows_so_far, rows_so_far + k, device=device)[:, None],
                                      -1).flatten())
            q_ids.append(q[0])
            q_probs.append(q[1])
        if level < depth:  # the next frontier: the best k children, fed after their parents
            best = cumulative.topk(k)
            rows = best.indices // k  # the frontier node each descends from
            frontier, score = offset + best.indices, best.values
            hidden, tokens = out[:, rows], model.to_target_ids(ids.flatten()[best.indices])[None]
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
    tree = Tree(model.to_target_ids(torch.cat(draft_ids)[kept]), parent, scores_[kept])
    if q_ids:  # each kept node's q row, cut to nothing where it was not drawn
        row = torch.cat(q_rows)[kept]  # [n]
        probs = torch.cat(q_probs)[row.clamp(min=0)]  # [n, W]
        tree.q = (model.to_target_ids(torch.cat(q_ids)[row.clamp(min=0)]), probs,
                  torch.where(row >= 0, (probs > 0).sum(-1), 0))
    return tree
