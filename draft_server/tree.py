"""EAGLE-2 dynamic draft trees: instead of a chain of K drafts, a tree of `nodes` drafts whose
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

    sampled     a sampled session's expanded nodes (the root, and each frontier node) draw ALL their top_k
                children from the draft's own q (sampling.py's draft_q: tempered, top-k/top-p, cut to top_n)
                without replacement: child j from q_j, q without children 0..j-1, renormalised, with
                uniform j of the position the child takes (DraftSampler.uniform(position, j); j = 0 is the
                chain's draft's; nodes of one depth share them). Each kept child carries its q_j, and the
                target tries them in draw order, each by min(1, p/q_j) with residual max(0, p - q_j):
                recursive rejection without replacement (RSD, Jeon et al. 2024), lossless. Where q runs
                out of support (a request's small top-k) the remaining children are the likeliest other
                tokens, without q.
    values      a drawn child's log-probability says little about whether the target takes it: what it is
                worth is how often the j-th drawn child at depth d has been accepted once its parent was
                reached, which the engine counts from its trees' outcomes (`SiblingRates`: child j is tried
                when children 0..j-1 were rejected; its worth u = P(0..j-1 rejected) P(j accepted)). A sampled
                node's score is its parent's plus log u of its (depth, draw), the draft's log-probability only
                breaking ties, made non-increasing in draw order, so the kept siblings are a prefix of the
                draws. The best N by these scores are the N nodes likeliest to be accepted, what the expected
                tokens a round add up from (EAGLE-2's argument, with measured rates for the draft's
                confidence, as Sequoia's trees use).

Everything stays on the device (masks, positions, ranking, draws, the d2t mapping); the host reads the tree
(tokens, parents, q) once, with read_rollout, at the end. The tree nodes' KV is dropped: the next round's exact
target features replace it. The reference: EAGLE's `topK_genrate` (EAGLE-2 and EAGLE-3), whose `depth` counts
expansions after level 1; here `depth` is the tree's greatest depth, as TreeParams documents.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from draft_server.model import DraftKV, Eagle3Draft
from draft_server.rollout import Draws
from draft_server.sampling import draft_q, draw
from tandem.params import TreeParams
from tandem.protocol import tree_children


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


class SiblingRates:
    """How often a sampled tree's j-th drawn child at depth d was accepted once tried (its parent reached
    and children 0..j-1 rejected), counted from the committed tokens that follow each tree. A prior of
    PRIOR_ACCEPTED in PRIOR_TRIED; the counts halve past HALF_LIFE tries of a first child, so they follow the
    traffic. Counted by the sessions' threads, read by the batch's."""

    PRIOR_ACCEPTED, PRIOR_TRIED = 1.0, 2.0
    HALF_LIFE = 4096

    def __init__(self):
        self.tried: dict[tuple[int, int], float] = {}
        self.accepted: dict[tuple[int, int], float] = {}
        self._lock = threading.Lock()

    def count(self, tokens: list[int], parents: list[int], committed: list[int]) -> None:
        """A tree (its nodes' target ids, parents as Tree.parents: -1 a child of the root) and the tokens
        the verify committed after its root (the accepted path, then the recovered or bonus token)."""
        children = tree_children(parents)  # node 0 the root, node i + 1 the draft tokens[i]
        tried, accepted, node = [], [], 0
        for depth, token in enumerate(committed, 1):
            kids = children[node]
            taken = next((j for j, kid in enumerate(kids) if tokens[kid - 1] == token), None)  # siblings differ
            tried += [(depth, j) for j in range(len(kids) if taken is None else taken + 1)]
            if taken is None:
                break  # every child rejected (or none): the token is the recovered one
            accepted.append((depth, taken))
            node = kids[taken]
        with self._lock:
            for counts, keys in ((self.tried, tried), (self.accepted, accepted)):
                for key in keys:
                    counts[key] = counts.get(key, 0.0) + 1
            if self.tried.get((1, 0), 0.0) > self.HALF_LIFE:
                for counts in (self.tried, self.accepted):
                    counts.update((key, n / 2) for key, n in counts.items())

    def log_values(self, depth: int, k: int) -> torch.Tensor:
        """[depth, k]: log u of the j-th drawn child at each depth, u = P(children 0..j-1 rejected) P(j
        accepted), each rate (accepted + PRIOR_ACCEPTED) / (tried + PRIOR_TRIED)."""
        with self._lock:
            rates = torch.tensor([[(self.accepted.get((d, j), 0.0) + self.PRIOR_ACCEPTED)
                                   / (self.tried.get((d, j), 0.0) + self.PRIOR_TRIED) for j in range(k)]
                                  for d in range(1, depth + 1)], dtype=torch.float64)
        rejected = torch.cumprod(1 - rates, 1)
        before = torch.cat([torch.ones(depth, 1, dtype=torch.float64), rejected[:, :-1]], 1)
        return (before * rates).clamp(min=1e-12).log().float()


TIE_BREAK = 1e-3  # a sampled node's log-probability, weighed into its score to order equal worths


def _children(model: Eagle3Draft, out: torch.Tensor, k: int, temperature: float | None, draws: Draws | None,
              top_n: int, level: int, values: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """The children of b expanded nodes, from their outputs `out` [b, H], at depth `level` -> their draft ids
    [b, k] and ranking scores [b, k]; with `draws`, all k drawn from q WITHOUT replacement, child j from q_j =
    q without children 0..j-1, renormalised (recursive rejection without replacement, as RSD: the target
    tries them in that order, each with its q_j), child j with uniform j of that depth, and their q_j (draft
    ids [b, k, W], probs [b, k, W], each row's support a prefix); a node whose q runs out of support gets its
    likeliest remaining tokens, without q. Else the top_k and None.

    Ranking: a greedy node's children by their log-probability; a sampled node's by `values` [depth, k] (log u
    of each draw at each depth: SiblingRates; None: all 0), their log-probabilities weighing TIE_BREAK, made
    non-increasing in draw order, so that the kept ones are a prefix of the draws, in draw order."""
    logits = model.draft_logits(out)
    logp = (logits.float() if temperature is None else logits.float() / temperature).log_softmax(-1)
    if draws is None:
        top = logp.topk(k)
        return top.indices, top.values, None
    ids, left = draft_q(logits, draws.settings, top_n)  # [b, W]: as the chain's pick draws
    b, columns = ids.shape[0], torch.arange(ids.shape[1], device=logp.device)
    kids: list[torch.Tensor] = []
    q_ids, q_probs = [], []
    for j in range(k):
        mass = left.sum(-1, keepdim=True)  # [b, 1]: what q_j has left to draw from
        valid = mass[:, 0] > 0
        column = draw(left, draws.uniforms[j, level - 1].expand(b)).clamp(min=0)  # [b]
        taken = logp.scatter(1, torch.stack(kids, 1), float("-inf")) if kids else logp
        kids.append(torch.where(valid, ids.gather(1, column[:, None])[:, 0], taken.argmax(-1)))
        q_ids.append(ids)
        q_probs.append(torch.where(valid[:, None], left / mass.clamp(min=1e-30), 0.0))
        # the drawn column to the end, zeroed: the support stays a prefix (draw and q_support read it so)
        order = (columns[None] == column[:, None]).long().argsort(dim=1, stable=True)
        ids, left = ids.gather(1, order), left.gather(1, order)
        left = torch.cat([left[:, :-1], torch.zeros_like(left[:, -1:])], 1)
    children = torch.stack(kids, 1)  # [b, k]
    ranked = TIE_BREAK * logp.gather(1, children)
    if values is not None:
        ranked = ranked + values[level - 1, :k]
    return children, ranked.cummin(1).values, (torch.stack(q_ids, 1), torch.stack(q_probs, 1))


def parallel_tree(model: Eagle3Draft, a: torch.Tensor, params: TreeParams) -> Tree:
    """A greedy tree from a P-EAGLE head's one forward, `a` [D, H] its outputs for depths 1..D: its first
    level the top_k tokens of depth 1, and under the likeliest of them the chain of the deeper depths'
    argmaxes (a P-EAGLE head's masked depths guess the top path; they read no token of the tree). The chain
    is kept whole within `nodes`, the first level filled with the rest."""
    logp = torch.log_softmax(model.draft_logits(a).float(), -1)  # [D, Vd]
    depth = min(a.shape[0], params.depth, params.nodes)
    width = max(1, min(params.top_k, model.config.draft_vocab_size, params.nodes - (depth - 1)))
    first = logp[0].topk(width)
    chain = logp[1:depth].max(-1)  # [depth - 1]
    tokens = torch.cat([first.indices, chain.indices])
    device = a.device
    parents = torch.cat([torch.full((width,), -1, device=device),
                         torch.tensor([0, *range(width, width + depth - 2)], device=device)[: depth - 1]])
    scores = torch.cat([first.values, first.values[0] + chain.values.cumsum(0)])
    return Tree(model.to_target_ids(tokens), parents.long(), scores)


def grow_tree(model: Eagle3Draft, a: torch.Tensor, kv: DraftKV, position: torch.Tensor, params: TreeParams,
              temperature: float | None = None, draws: Draws | None = None, top_n: int = 0,
              values: torch.Tensor | None = None, context: torch.Tensor | None = None) -> Tree:
    """The tree after a lone session's extend: `a` [1, 1, H] its last output, `kv` its committed KV, `position`
    [1, 1] where its first draft goes. A sampled session's: `temperature`, and `draws` (its settings, and
    uniforms [top_k, depth]: draw j of each depth) with the q cut `top_n` draw each expanded node's children,
    ranked by `values` (SiblingRates.log_values). `context` [committed]: the KV's columns the nodes attend (None:
    all; a left-padded copy's, draft_server/graphs.py). The nodes' KV is cropped off `kv` again before this
    returns."""
    k, depth, n = tree_shape(params, model.config.draft_vocab_size)
    device, committed = a.device, kv.length
    ids, logp, q = _children(model, a[0, -1:], k, temperature, draws, top_n, 1, values)  # level 1: [1, k]
    scores, draft_ids = [logp[0]], [ids[0]]
    parents = [torch.full((k,), -1, dtype=torch.long, device=device)]  # candidate index of each one's parent
    levels = [torch.full((k,), 1, dtype=torch.long, device=device)]
    q_ids, q_probs = ([q[0][0]], [q[1][0]]) if q else ([], [])  # each candidate's q_j, in candidate order
    # the frontier: the nodes fed next, as candidate indices, with their scores, inputs and ancestry
    frontier, score = torch.arange(k, device=device), logp[0]
    hidden, tokens = a[:, -1:].expand(1, k, a.shape[-1]), model.to_target_ids(ids)  # [1, k, H], [1, k]
    self_only = torch.eye(k, dtype=torch.bool, device=device)
    ancestry = self_only  # [k, fed]: which of the tree nodes fed (this frontier included) each row descends from
    # every node sees the committed pairs
    context = (torch.ones(k, committed, dtype=torch.bool, device=device) if context is None
               else context[None].expand(k, -1))
    offset = k  # candidates so far
    for level in range(2, depth + 1):
        out = model(hidden, tokens, position.expand(1, k) + (level - 2), kv, torch.cat([context, ancestry], 1))
        ids, logp, q = _children(model, out[0], k, temperature, draws, top_n, level, values)  # [k, k]
        cumulative = (score[:, None] + logp).flatten()  # [k * k]
        scores.append(cumulative)
        draft_ids.append(ids.flatten())
        parents.append(frontier[:, None].expand(k, k).flatten())
        levels.append(torch.full((k * k,), level, dtype=torch.long, device=device))
        if q:  # [k, k, W] -> [k * k, W]: candidate r * k + j's q_j
            q_ids.append(q[0].flatten(0, 1))
            q_probs.append(q[1].flatten(0, 1))
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
    if q_ids:  # each kept node's q_j; a support of 0 where it was not drawn (its parent's q ran out)
        probs = torch.cat(q_probs)[kept]  # [n, W]
        tree.q = (model.to_target_ids(torch.cat(q_ids)[kept]), probs, (probs > 0).sum(-1))
    return tree
