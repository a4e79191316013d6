"""The lossless acceptance rule of speculative decoding, for a linear chain of K drafts and for a tree.

The words (as vLLM's rejection sampler uses them):
  accepted tokens   the drafts d_1..d_a the target keeps
  recovered token   at the first rejected draft d_{a+1}: the token sampled instead, from the residual
                    norm(max(0, p - q)) at that position
  bonus token       after all K drafts were accepted: one more token, sampled from p after d_K
A verify commits the accepted tokens and then one more, the recovered or the bonus token (VerifyResult.bonus).

p_i is the target's distribution at draft position i (after temperature, top-k, top-p), q_i the one the
draft sampled d_i from. Draft d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); every committed
token is then distributed exactly as sampling the target alone would (Leviathan et al. 2023; Chen et al.
2023), for any q the draft really sampled from independently of the target's randomness: a truncated q
(draft_server/sampling.py) only lowers acceptance.

Drafts without q (the draft's argmax, or a draft that does not sample) count as q one-hot on d_i: d_i is
accepted with probability p_i(d_i), and the recovered token comes from p_i with d_i zeroed. That is
lossless too, over any draft chosen independently, but accepts less: sum_x q(x) p(x) against
sum_x min(p(x), q(x)) for a draft sampled from q. Greedy requests accept while d_i is the argmax.

A draft tree (EAGLE-2; node 0 the root t, node i + 1 the draft d_{i+1}, Drafts.parents) is accepted along
one path from the root. Greedy: move to the child whose token is the target's argmax at the current node;
the bonus is the argmax where no child matches. Sampled: sequential speculative sampling over the current
node's children, each with its own q. A sampled tree's q has one DraftProbs per node: the distribution the
draft drew that node from, or an empty one for a node it chose deterministically (its ranking's top; q
one-hot on it). With p the target's distribution at the node, its children are tried, those with a q first
and then the others, each in the drafts' order: a child c with q_c is accepted with probability
min(1, p(c) / q_c(c)), and when rejected p becomes norm(max(0, p - q_c)); a child without q is accepted with
probability p(c), and when rejected p(c) is set to 0 and p renormalised (the rule of SpecInfer, Miao et al.
2024, and of the EAGLE reference's evaluate_posterior). An accepted child becomes the current node; when
every child is rejected (or there is none) the bonus is sampled from what is left of p. Lossless, by
induction over the candidates: if c is drawn from q_c independently of the target's randomness given the
earlier candidates (c and q_c may depend on them, not on the target's draws), the step commits x with
probability min(p(x), q_c(x)) when c = x is accepted, plus (1 - sum_y min(p(y), q_c(y))) times what the
rest commits, which is norm(max(0, p - q_c))(x) by induction: p(x) in all. A deterministic candidate is the
one-hot q_c; the base is the bonus drawn from the residual. Siblings are distinct tokens (the draft draws
the first child from q and ranks the others, excluding it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tandem.params import SamplingParams
from tandem.protocol import DraftProbs, TokenLogprob, check_tree, tree_children


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> the distribution the target samples from, after temperature, min-p, top-k, top-p (vLLM's
    order). [N, V] fp32."""
    if params.min_p > 0:
        logits = logits.float() / params.temperature
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
        params = params.model_copy(update={"temperature": 1.0, "min_p": 0.0})
    if params.top_k <= 0 and params.top_p >= 1.0:  # the temperature alone: the warper's division, without its wrapping
        return torch.softmax(logits.float() / params.temperature, dim=-1)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k > 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    scores = warpers(None, logits.float())
    return torch.softmax(scores, dim=-1)


def accept_argmax(best: list[int], drafts: list[int]) -> tuple[int, int]:
    """The target's argmax at each of K+1 positions (read from the device once, for a whole batch),
    drafts [K] -> (accepted a, bonus b). Accept while d_k == argmax."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == best[accepted]:
        accepted += 1
    return accepted, best[accepted]


def accept_greedy(logits: torch.Tensor, drafts: torch.Tensor) -> tuple[int, int]:
    """logits [K+1, V], drafts [K] -> (accepted a, bonus b), in one host sync."""
    return accept_argmax(logits.argmax(dim=-1).tolist(), drafts.tolist())


def dense_q(q: list[DraftProbs], drafts: list[int], vocab_size: int) -> torch.Tensor:
    """The draft's q_1..q_K as rows over the target vocabulary, [K, V] fp32 on the CPU, each renormalised
    to sum 1 as the draft drew from it (it scales its uniform by the row's sum). ValueError unless q is
    one distribution per draft, of distinct ids in the vocabulary with finite positive probabilities,
    each draft in its support.

    numpy reads the ids and probabilities (lists, or the wire's repeated fields as the target receives
    them): a few hundred numbers a draft, faster than torch.tensor of Python lists."""
    if len(q) != len(drafts):
        raise ValueError(f"q has {len(q)} distributions for {len(drafts)} drafts")
    lengths = [len(d.ids) for d in q]
    if any(n != len(d.probs) for n, d in zip(lengths, q, strict=True)):
        raise ValueError("each q needs one probability per id")
    if not q:
        return torch.zeros(0, vocab_size)
    ids = np.concatenate([np.asarray(d.ids, dtype=np.int64) for d in q])  # [sum N]
    probs = np.concatenate([np.asarray(d.probs, dtype=np.float32) for d in q])
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"q has ids outside the vocabulary [0, {vocab_size})")
    if not (np.isfinite(probs) & (probs > 0)).all():
        raise ValueError("q has a probability that is not finite and positive")
    rows = np.repeat(np.arange(len(q)), lengths)
    dense = np.zeros((len(q), vocab_size), dtype=np.float32)
    dense[rows, ids] = probs
    if np.count_nonzero(dense) != ids.size:
        raise ValueError("q repeats an id")
    if not (dense[np.arange(len(q)), np.asarray(drafts, dtype=np.int64)] > 0).all():
        raise ValueError("a draft is outside the support of its q")
    dense /= dense.sum(-1, keepdims=True)
    return torch.from_numpy(dense)


def accept_sampled(
    probs: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator, q: torch.Tensor | None = None
) -> tuple[int, int]:
    """probs [K+1, V], drafts [K], q [K, V] (None: one-hot on the drafts) -> (accepted a, the recovered or
    bonus token), by the rule in the module docstring."""
    k = drafts.numel()
    accepted = 0
    if k:
        rows = torch.arange(k, device=probs.device)
        u = torch.rand(k, generator=generator, device=probs.device)  # [K]
        p_draft = probs[rows, drafts]  # [K]
        q_draft = q[rows, drafts] if q is not None else torch.ones_like(p_draft)  # [K]
        accepted = int((u * q_draft < p_draft).int().cumprod(0).sum())  # u < p/q: accepted w.p. min(1, p/q)
    final = probs[accepted]
    if accepted < k:  # the residual max(0, p - q) at the first rejection
        q_row = q[accepted] if q is not None else torch.nn.functional.one_hot(drafts[accepted], final.numel())
        residual = (final - q_row).clamp(min=0)
        if float(residual.sum()) > 0:  # 0 only when p = q up to rounding: then rejection had no mass
            final = residual
    return accepted, sample(final, generator)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token drawn from probs [V] (non-negative, any positive sum) by inverse CDF with one uniform of
    `generator`: torch.multinomial's law, in a fraction of its time on a CPU."""
    cdf = torch.cumsum(probs, 0, dtype=torch.float64)
    u = torch.rand(1, generator=generator, device=probs.device, dtype=torch.float64) * cdf[-1]
    token = int(torch.searchsorted(cdf, u, right=True))  # the first cdf above u: a token of positive mass
    return token if token < probs.numel() else int(probs.nonzero()[-1])  # u rounded up to the sum


def tree_problem(drafts: list[int], parents: list[int], max_nodes: int) -> str | None:
    """What is wrong with `parents` as the tree of `drafts` (None: nothing): at most `max_nodes` nodes, each
    parent an earlier draft or the root (tandem.protocol.check_tree), siblings distinct tokens."""
    if len(drafts) > max_nodes:
        return f"a draft tree has at most {max_nodes} nodes, got {len(drafts)}"
    problem = check_tree(parents, len(drafts))
    if problem is None:
        for children in tree_children(parents):
            tokens = [drafts[c - 1] for c in children]
            if len(set(tokens)) != len(tokens):
                return f"a draft tree's siblings must be distinct tokens, got {tokens}"
    return problem


def accept_tree_argmax(best: list[int], tokens: list[int], parents: list[int]) -> tuple[list[int], int]:
    """The target's argmax at each node (read from the device once, for a whole batch), the nodes' tokens
    [t, d_1..d_n] and the tree -> (the accepted path's nodes, without the root; the bonus). From the root,
    move to the child whose token is the argmax at the current node; the bonus is the argmax where none is."""
    children = tree_children(parents)
    node, path = 0, []
    while True:
        match = [c for c in children[node] if tokens[c] == best[node]]
        if not match:
            return path, best[node]
        node = match[0]
        path.append(node)


def reject_siblings(p: torch.Tensor, candidates: list[int], generator: torch.Generator,
                    q: Sequence[torch.Tensor] = ()) -> tuple[int | None, torch.Tensor]:
    """p [V] (the target's distribution at a node), its children's distinct tokens in the order they are
    tried, `q`: the q rows [V] (dense_q) of the first len(q) of them, the others deterministic -> (which
    child is accepted, None: none; the distribution left: p after every candidate's rejection, the bonus's
    law). Child j is accepted with probability min(1, p_j(c_j) / q_j(c_j)), p_j what is left of p after the
    earlier siblings' rejections (a deterministic child's q_j one-hot): one uniform per child, every p_j and
    decision computed at once on p's device, and one host sync."""
    p = p.double()
    ids = torch.tensor(candidates, dtype=torch.long, device=p.device)
    u = torch.rand(len(candidates), generator=generator, device=p.device, dtype=torch.float64)
    hits = []
    for j, q_row in enumerate(q):
        q_row = q_row.to(p.device, torch.float64, non_blocking=True)
        c = candidates[j]
        hits.append(u[j] * q_row[c] < p[c])  # u < p/q: accepted w.p. min(1, p/q)
        p = _normalised((p - q_row).clamp(min=0), p)  # 0 only when p = q up to rounding: no rejection mass
    rest = ids[len(q):]
    mass = p[rest]  # [m - len(q)]
    left = p.sum() - torch.cumsum(mass, 0) + mass  # p's mass with c_j's earlier siblings zeroed
    decided = u[len(q):] * left < mass  # u < p(c_j) / left_j; p(c_j) = 0 is never accepted
    decided = (torch.cat([torch.stack(hits), decided]) if hits else decided).tolist()
    if True in decided:
        return decided.index(True), p
    return None, _normalised(p.index_fill(0, rest, 0), p).float()  # 0: rounding lost a certain acceptance


def _normalised(residual: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """residual / its sum, or `fallback` where that sum is 0, without a host sync."""
    total = residual.sum()
    return torch.where(total > 0, residual / total, fallback)


def tree_q(q: list[DraftProbs], drafts: list[int], vocab_size: int) -> dict[int, torch.Tensor] | None:
    """A sampled tree's q (one DraftProbs per draft, empty for a node the draft chose deterministically) ->
    {node i + 1: q_i as a row over the vocabulary (dense_q)} for the drafts that have one; None: no draft
    has. ValueError as dense_q's."""
    if len(q) != len(drafts):
        raise ValueError(f"q has {len(q)} distributions for {len(drafts)} drafts")
    drawn = [i for i, d in enumerate(q) if d.ids or d.probs]
    if not drawn:
        return None
    dense = dense_q([q[i] for i in drawn], [drafts[i] for i in drawn], vocab_size)
    return {i + 1: row for i, row in zip(drawn, dense, strict=True)}


def accept_tree(logits: torch.Tensor, tokens: list[int], parents: list[int], params: SamplingParams,
                generator: torch.Generator,
                q: dict[int, torch.Tensor] | None = None) -> tuple[list[int], int]:
    """logits [n + 1, V] at the nodes, their tokens [t, d_1..d_n], the tree, a sampled request, `q` (tree_q:
    the nodes the draft drew from a q; None: none) -> (the accepted path's nodes, without the root; the
    bonus), by sequential speculative sampling over the children at each node of the path (module
    docstring). The target's distribution is computed at the nodes the path visits only."""
    children = tree_children(parents)
    q = q or {}
    node, path = 0, []
    while True:
        p = target_probs(logits[node : node + 1], params)[0]  # [V]
        if children[node]:
            order = [c for c in children[node] if c in q] + [c for c in children[node] if c not in q]
            drawn = [q[c] for c in order if c in q]
            chosen, p = reject_siblings(p, [tokens[c] for c in order], generator, drawn)
            if chosen is not None:
                node = order[chosen]
                path.append(node)
                continue
        return path, sample(p, generator)


def pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Sample one token from logits [V] (the prefill's first token)."""
    return accept(logits[None], torch.empty(0, dtype=torch.long, device=logits.device), params, generator)[1]


def accept(
    logits: torch.Tensor, drafts: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
    q: torch.Tensor | None = None,
) -> tuple[int, int]:
    """logits [K+1, V], drafts [K]; `q` [K, V] (dense_q): what the draft sampled each draft from; None:
    the drafts are argmax, q one-hot."""
    if params.greedy:
        return accept_greedy(logits, drafts)
    assert generator is not None
    if q is not None:
        q = q.to(logits.device)
    return accept_sampled(target_probs(logits, params), drafts, generator, q)


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """logits [n, V] at the positions of the n committed `tokens` -> each token's logprob under the
    target's raw distribution (before temperature, top-k, top-p: vLLM's default `raw_logprobs`) and
    the `top` likeliest alternatives. Only for requests that ask: one log_softmax over rows the
    engine already has."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()  # [n]
    top = min(top, logprobs.shape[-1])  # never past the vocabulary (SGLang's scheduler died there)
    values, ids = logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], logprobs[:, :0].long())  # [n, top]
    return [TokenLogprob(lp, i, v) for lp, i, v in zip(chosen, ids.tolist(), values.tolist(), strict=True)]
