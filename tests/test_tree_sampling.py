"""A sampled draft tree whose nodes carry the q they were drawn from (target_server/acceptance.py: tree_q,
reject_siblings, accept_tree): at each node the children with a q are tried first with min(1, p/q) and the
residual norm(max(0, p - q)), then the deterministic ones one-hot. The committed tokens keep the target's
law, acceptance rises over the one-hot rule when q is close to p, and a bad q is refused by the engine.

False alarms: test_the_committed_tokens_keep_the_targets_law makes 2 chi-square checks in each of its 4
cases, each at ALPHA = 1e-3, so a correct rule fails it by chance with probability at most 8 * 1e-3 = 0.8%
over independent seeds (Bonferroni); the seeds are fixed, so its outcome is deterministic. Its power: the
same check on a draft whose q is misreported (drawn from q, sent as uniform) fails.
"""

from __future__ import annotations

import pytest
import torch
from helpers import chi_square_p

from tandem.params import SamplingParams
from tandem.protocol import DraftProbs
from tandem.sessions import InvalidRequest
from tandem_tools.opcount import OpCounter
from target_server.acceptance import accept_tree, target_probs, tree_children, tree_q
from target_server.engine import TargetEngine

ALPHA = 1e-3  # per check
V = 12
# t; the root's children: node 1 (c0, drawn from q_root), nodes 2, 3 (q_root's top two besides c0);
# node 1's children: node 4 (q_child's top besides g), node 5 (g, drawn from q_child: tried first)
PARENTS = [-1, -1, -1, 0, 0]
PROMPT = [0, 17, 42, 99, 7, 230, 11, 64, 301, 5, 88]


def draft_tree(seed: int, q_root: torch.Tensor, q_child: torch.Tensor) -> list[int]:
    """The tree's tokens [t, c0, c1, c2, h, g] as the draft makes them, from its own generator: c0 drawn
    from q_root, c1 and c2 q_root's top two besides c0; g drawn from q_child, h its top besides g."""
    g = torch.Generator().manual_seed(10**6 + seed)
    c0, g_tok = (int(torch.multinomial(q, 1, generator=g)) for q in (q_root, q_child))
    c1, c2 = [i for i in q_root.argsort(descending=True).tolist() if i != c0][:2]
    h = next(i for i in q_child.argsort(descending=True).tolist() if i != g_tok)
    return [0, c0, c1, c2, h, g_tok]


def rows(seed: int, scale: float = 1.5) -> torch.Tensor:
    return scale * torch.randn(len(PARENTS) + 1, V, generator=torch.Generator().manual_seed(seed))


SETTINGS = {"t1": SamplingParams(temperature=1.0), "t0.7": SamplingParams(temperature=0.7),
            "t1-top_k5": SamplingParams(temperature=1.0, top_k=5),
            "t0.7-top_k5": SamplingParams(temperature=0.7, top_k=5)}


def first_two(logits, params, q_root, q_child, seeds: int, sent=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the first committed token, and of the second where the path starts at node 1 (c0), over
    `seeds` seeds. `sent`: the q rows the draft says it drew from (default: the ones it did)."""
    sent_root, sent_child = sent if sent is not None else (q_root, q_child)
    first, second = torch.zeros(V), torch.zeros(V)
    for seed in range(seeds):
        tokens = draft_tree(seed, q_root, q_child)
        path, bonus = accept_tree(logits, tokens, PARENTS, params, torch.Generator().manual_seed(seed),
                                  {1: sent_root, 5: sent_child})
        committed = [tokens[i] for i in path] + [bonus]
        first[committed[0]] += 1
        if path[:1] == [1]:
            second[committed[1]] += 1
    return first, second


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_committed_tokens_keep_the_targets_law(name):
    """Fixed logits at the nodes, a draft that draws the first child from q (not p) and ranks the others:
    over 6000 seeds the first committed token follows p at the root, and the second, where the first is
    c0, p at node 1 (whose q child comes after its deterministic one in the drafts' order). (3000 seeds
    were enough until the bonus was drawn by inverse CDF rather than torch.multinomial: with that stream
    t0.7's second token scored p = 0.00095 at 3000 seeds, 0.09 at 6000.)"""
    params = SETTINGS[name]
    logits = rows(1)
    q_root, q_child = (torch.softmax(r, -1) for r in rows(2, scale=1.0)[:2])
    first, second = first_two(logits, params, q_root, q_child, 6000)
    assert chi_square_p(first, target_probs(logits[:1], params)[0]) > ALPHA
    assert second.sum() > 600, second.sum()
    assert chi_square_p(second, target_probs(logits[1:2], params)[0]) > ALPHA


def test_the_check_sees_a_misreported_q():
    """The power of the check: nodes drawn from a peaked q but sent with a uniform q are accepted too
    often where q is high, and the same check at the same size rejects the first committed token's law."""
    params = SETTINGS["t1"]
    logits = rows(1)
    q_root, q_child = (torch.softmax(3 * r, -1) for r in rows(2, scale=1.0)[:2])
    uniform = torch.full((V,), 1 / V)
    first, _ = first_two(logits, params, q_root, q_child, 3000, sent=(uniform, uniform))
    assert chi_square_p(first, target_probs(logits[:1], params)[0]) < ALPHA


def test_q_raises_acceptance_where_it_is_close_to_a_flat_p():
    """p flat, q close to p: the first level accepts about sum_x min(p, q) ~ 1 with q, against
    sum_x q(x) p(x) + the deterministic siblings' p with q ignored (one-hot). Both measured over 2000 seeds,
    each within 5 standard errors of its exact value."""
    params = SETTINGS["t1"]
    logits = rows(3, scale=0.3)
    p = target_probs(logits[:1], params)[0].double()
    q_root = torch.softmax(logits[0] + 0.1 * torch.randn(V, generator=torch.Generator().manual_seed(4)), -1)
    q_child = torch.softmax(logits[1], -1)
    with_q, without_q = 0.0, 0.0  # the exact first-level acceptance, over c0 ~ q_root
    for c0 in range(V):
        c1, c2 = [i for i in q_root.argsort(descending=True).tolist() if i != c0][:2]
        ratio = min(1.0, float(p[c0] / q_root[c0]))
        residual = (p - q_root.double()).clamp(min=0)
        residual /= residual.sum()
        with_q += float(q_root[c0]) * (ratio + (1 - ratio) * float(residual[c1] + residual[c2]))
        without_q += float(q_root[c0]) * float(p[c0] + p[c1] + p[c2])
    seeds, hits = 2000, {"q": 0, "one-hot": 0}
    for seed in range(seeds):
        tokens = draft_tree(seed, q_root, q_child)
        for rule, q in (("q", {1: q_root, 5: q_child}), ("one-hot", None)):
            path, _ = accept_tree(logits, tokens, PARENTS, params, torch.Generator().manual_seed(seed), q)
            hits[rule] += bool(path)
    for rule, exact in (("q", with_q), ("one-hot", without_q)):
        error = (exact * (1 - exact) / seeds) ** 0.5
        assert abs(hits[rule] / seeds - exact) < 5 * error + 1e-3, (rule, hits[rule] / seeds, exact)
    assert with_q > 0.9 and without_q < 0.4 and hits["q"] > 2 * hits["one-hot"], (with_q, without_q, hits)


def test_a_q_less_tree_and_empty_qs_accept_as_before_with_a_sync_a_node():
    """A tree q of empty DraftProbs only is no q (tree_q: None); the rule reads the host once at each
    visited node that has children, and once for the bonus."""
    drafts = [3, 5, 7, 1, 2]
    assert tree_q([DraftProbs([], [])] * 5, drafts, V) is None
    empty = [DraftProbs([], [])] * 3
    q = tree_q([DraftProbs([3, 4], [0.25, 0.5]), *empty, DraftProbs([2], [1.0])], drafts, V)
    assert sorted(q) == [1, 5] and torch.allclose(q[1][[3, 4]], torch.tensor([1 / 3, 2 / 3]))
    logits, params = rows(5), SETTINGS["t1"]
    children = tree_children(PARENTS)
    for seed in range(20):
        with OpCounter() as ops:
            generator = torch.Generator().manual_seed(seed)
            path, _ = accept_tree(logits, [0, *drafts], PARENTS, params, generator, q)
        visited = [0, *path]
        assert ops.reads <= sum(bool(children[n]) for n in visited) + 1, ops.sync_ops  # uploads aside


@pytest.fixture(scope="module")
def engine(tiny_dir) -> TargetEngine:
    return TargetEngine(tiny_dir / "target", engine="native")


def sampled_q(tokens: list[int], parents: list[int], vocab: int, seed: int) -> list[DraftProbs]:
    """A q on each node's first child (its token and 5 others, random probabilities), empty on the rest."""
    g, q, seen = torch.Generator().manual_seed(seed), [], set()
    for token, parent in zip(tokens, parents, strict=True):
        if parent in seen:
            q.append(DraftProbs([], []))
            continue
        seen.add(parent)
        others = [i for i in torch.randperm(vocab, generator=g).tolist() if i != token][:5]
        probs = torch.rand(6, generator=g) + 0.1
        q.append(DraftProbs([token, *others], (probs / probs.sum()).tolist()))
    return q


ENGINE_PARENTS = [-1, -1, 0, 0, 2, 3, 3, 6, -1]


def tree_tokens(vocab: int, seed: int) -> list[int]:
    """Distinct siblings for ENGINE_PARENTS."""
    g, drafts = torch.Generator().manual_seed(seed), []
    for i, parent in enumerate(ENGINE_PARENTS):
        taken = {drafts[j] for j in range(i) if ENGINE_PARENTS[j] == parent}
        drafts.append(next(t for t in torch.randperm(vocab, generator=g).tolist() if t not in taken))
    return drafts


def test_a_sampled_tree_with_q_verifies_on_the_engine(engine):
    """Rounds of sampled tree verifies with q on the tiny target: each accepts a path of the tree (its
    tokens, parent to child from the root), returns its features, and the session goes on."""
    params = SamplingParams(temperature=0.8, top_k=50, seed=3)
    token = engine.prefill("s", PROMPT, params).token
    for round_ in range(4):
        drafts = tree_tokens(engine.vocab_size, round_)
        q = sampled_q(drafts, ENGINE_PARENTS, engine.vocab_size, round_)
        result = engine.verify("s", token, drafts, q=q, parents=ENGINE_PARENTS)
        parent = -1
        for accepted in result.accepted:
            match = [i for i, (d, p) in enumerate(zip(drafts, ENGINE_PARENTS, strict=True))
                     if p == parent and d == accepted]
            assert len(match) == 1, (result.accepted, drafts)
            parent = match[0]
        assert 0 <= result.bonus < engine.vocab_size
        assert result.features.shape[0] == 1 + len(result.accepted)
        token = result.bonus
    assert engine.verify("s", token, []).bonus is not None
    assert engine.release("s")


def test_a_bad_tree_q_is_refused_and_the_session_goes_on(engine):
    """InvalidRequest naming the problem; the session's next verify is what a twin session that never saw
    the bad requests gets (same seed: nothing was drawn)."""
    params = SamplingParams(temperature=1.0, seed=7)
    token = engine.prefill("bad", PROMPT, params).token
    assert engine.prefill("twin", PROMPT, params).token == token
    drafts = tree_tokens(engine.vocab_size, 9)
    good = sampled_q(drafts, ENGINE_PARENTS, engine.vocab_size, 9)
    outside = next(i for i in range(engine.vocab_size) if i not in good[0].ids)
    bad = [(good[:-1], "8 distributions for 9 drafts"),
           ([DraftProbs([outside], [1.0]), *good[1:]], "outside the support"),
           ([DraftProbs(good[0].ids, [-p for p in good[0].probs]), *good[1:]], "finite and positive"),
           ([DraftProbs([drafts[0], 10**6], [0.5, 0.5]), *good[1:]], "outside the vocabulary"),
           ([DraftProbs([drafts[0], drafts[0]], [0.5, 0.5]), *good[1:]], "repeats an id"),
           ([DraftProbs([], [1.0]), *good[1:]], "one probability per id")]
    for q, message in bad:
        with pytest.raises(InvalidRequest, match=message):
            engine.verify("bad", token, drafts, q=q, parents=ENGINE_PARENTS)
    results = [engine.verify(sid, token, drafts, q=good, parents=ENGINE_PARENTS) for sid in ("bad", "twin")]
    assert results[0].accepted == results[1].accepted and results[0].bonus == results[1].bonus
    assert engine.release("bad") and engine.release("twin")
