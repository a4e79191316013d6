"""EAGLE-2 draft trees in the draft engine (draft_server/tree.py): well-formed trees, every node
scored as a chain rollout along its path scores it (so the tree's masks and positions are right), the
tree's KV dropped, one host sync per tree, and a sampled session ranked at its temperature, each expanded
node's first child drawn from the draft's q (with that q) and its siblings the likeliest others."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

import draft_server.engine as engine_module
from draft_server.engine import DraftEngine
from draft_server.model import DraftKV
from draft_server.rollout import rollout
from draft_server.sampling import DraftSampler, draft_q, draw
from draft_server.steps import _Step
from draft_server.tree import TIE_BREAK, SiblingRates, grow_tree, tree_shape
from tandem.params import SamplingParams, TreeParams
from tandem.protocol import check_tree, tree_depths
from tandem.sessions import InvalidRequest
from tandem_tools.opcount import OpCounter

SAMPLED = SamplingParams(temperature=0.6, seed=5)


@pytest.fixture(scope="module")
def module_engine(tiny_dir) -> DraftEngine:
    return DraftEngine(tiny_dir / "draft", tiny_dir / "target")


@pytest.fixture
def engine(module_engine):
    """The module's engine, every session a test opened released after it, passed or not, and its sampled
    trees' counts fresh."""
    module_engine.sibling_rates = SiblingRates()
    yield module_engine
    for name in module_engine.session_ids():
        module_engine.release(name)


@pytest.fixture
def grown(monkeypatch) -> list:
    """The trees the engine grows, as grow_tree returns them (scores included)."""
    trees, grow = [], engine_module.grow_tree

    def recording(*args, **kwargs):
        trees.append(grow(*args, **kwargs))
        return trees[-1]

    monkeypatch.setattr(engine_module, "grow_tree", recording)
    return trees


def _history(engine: DraftEngine, seed: int, sizes=(6, 3)) -> list[tuple[torch.Tensor, list[int]]]:
    """Committed pairs (features, next tokens), in the chunks the proposes carry them."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(m, engine.feature_size, generator=g), torch.randint(0, 300, (m,), generator=g).tolist())
            for m in sizes]


def _draft(engine, name, history, k=3, sampling=None, tree=None):
    """A session fed `history`, chunk by chunk (chains of k), the last propose's drafts (a tree with `tree`)."""
    for i, (features, tokens) in enumerate(history[:-1]):
        engine.propose(name, features, tokens, k, create=i == 0, sampling=sampling)
    return engine.propose(name, *history[-1], k, create=len(history) == 1, sampling=sampling, tree=tree)


class Chains:
    """The draft's log-probabilities [draft_vocab] after a path of drafts (target ids) from the root, computed
    as a chain rollout along that path computes them: a fresh KV of the history, then one step a draft."""

    def __init__(self, engine, history, temperature=None):
        self.model, self.temperature = engine.model, temperature
        ids = [t for _, chunk in history for t in chunk]
        self.n = len(ids)
        features = torch.cat([f for f, _ in history])
        with torch.inference_mode():
            kv = DraftKV()
            a = self.model(self.model.fuse(features)[None], torch.tensor([ids]), torch.arange(self.n)[None], kv)
        self.states = {(): (a[:, -1:], kv)}  # path -> its last output and KV

    @torch.inference_mode()
    def logits(self, path: tuple[int, ...]) -> torch.Tensor:
        return self.model.draft_logits(self._state(path)[0][0, -1]).float()

    def logp(self, path: tuple[int, ...]) -> torch.Tensor:
        logits = self.logits(path)
        return (logits if self.temperature is None else logits / self.temperature).log_softmax(-1)

    @torch.inference_mode()
    def _state(self, path):
        if path not in self.states:
            a, kv = self._state(path[:-1])
            own = DraftKV()  # appending makes new tensors: the parent's KV is shared, never changed
            own.k, own.v = kv.k, kv.v
            position = torch.tensor([[self.n + len(path) - 1]])
            self.states[path] = (self.model(a, torch.tensor([[path[-1]]]), position, own), own)
        return self.states[path]


def _paths(tokens, parents) -> list[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tokens, parents, strict=True):
        paths.append((*(paths[parent] if parent >= 0 else ()), token))
    return paths


def _naive_tree(engine, chains: Chains, params, sampler=None, qs=None) -> dict[tuple[int, ...], float]:
    """Every candidate of an EAGLE-2 tree, grown path by path on the host: path -> cumulative score. A sampled
    session's (`sampler`): each expanded path's children drawn from draft_q at the chain's logits without
    replacement, draw j with stream j of the position they take, each q_j (target ids, probs) put in `qs`
    under the child's path; where q runs out, the likeliest other tokens. Draw j at depth d ranks by the
    engine's measured worth of such a draw plus TIE_BREAK log p, non-increasing in draw order (tree.py)."""
    k, depth, _ = tree_shape(params, engine.draft_vocab)
    values = engine.sibling_rates.log_values(depth, k).tolist()
    to_target = engine.model.to_target_ids
    candidates, frontier = {}, [((), 0.0)]
    for d in range(depth):
        level = []
        for path, score in frontier:
            logp = chains.logp(path)
            children = logp.topk(k).indices.tolist()
            ranks = [float(logp[i]) for i in children]
            if sampler is not None:
                ids, probs = draft_q(chains.logits(path)[None], [sampler], engine.q_top_n)
                ids, probs = ids[0].tolist(), probs[0]
                children, ranks = [], []
                for j in range(k):
                    left = [(i, float(p)) for i, p in zip(ids, probs.tolist(), strict=True) if p > 0 and i not in children]
                    if left:
                        row = torch.tensor([p for _, p in left], dtype=torch.float64)
                        row = row / row.sum()
                        child = left[int(draw(row[None], [sampler.uniform(chains.n + d, j)])[0])][0]
                        qs[(*path, int(to_target(child)))] = ([int(to_target(i)) for i, _ in left], row)
                    else:  # q ran out: the likeliest other token, no q
                        child = next(i for i in logp.argsort(descending=True).tolist() if i not in children)
                    children.append(child)
                    rank = values[d][j] + TIE_BREAK * float(logp[child])
                    ranks.append(rank if j == 0 else min(ranks[-1], rank))
            level += [((*path, int(to_target(i))), score + r) for i, r in zip(children, ranks, strict=True)]
        candidates.update(level)
        frontier = level if d == 0 else sorted(level, key=lambda c: -c[1])[:k]  # level 1 all, then the best k
    return candidates


def _check(engine, history, drafts, params, scores=None, sampling=None):
    """The tree is well-formed and, with its scores, every node is what a chain along its path ranks; the
    nodes are the best of the candidates an EAGLE-2 tree grown on the host has. A sampled session's
    (`sampling`): ranked at its temperature, the drawn nodes (a q) drawn and their q as the host draws them."""
    k, depth, n = tree_shape(params, engine.draft_vocab)
    parents = drafts.parents
    sampler = DraftSampler.for_request(sampling) if sampling is not None else None
    assert len(drafts) == n == min(params.nodes, k + (depth - 1) * k * k)
    assert drafts.q is None if sampler is None else len(drafts.q) == n
    assert check_tree(parents, len(drafts)) is None
    depths = tree_depths(parents)
    assert max(depths) <= params.depth and depths == sorted(depths)
    children: dict[int, list[int]] = {}
    for token, parent in zip(drafts, parents, strict=True):
        children.setdefault(parent, []).append(token)
    assert all(len(set(c)) == len(c) <= k for c in children.values()), children
    chains = Chains(engine, history, sampler and sampler.temperature)
    values = engine.sibling_rates.log_values(depth, k).tolist()  # as the tree was grown: no propose since
    paths = _paths(list(drafts), parents)
    qs: dict[tuple[int, ...], tuple[list[int], torch.Tensor]] = {}
    candidates = _naive_tree(engine, chains, params, sampler, qs)
    expected, last_rank = [], {}  # the last sibling's rank, per parent: ranks fall in draw order
    for i, (path, parent) in enumerate(zip(paths, parents, strict=True)):
        logp = chains.logp(path[:-1])
        draft_id = int(engine._draft_id[path[-1]])
        assert draft_id >= 0
        q = drafts.q[i] if sampler is not None else None
        assert (path in qs) == bool(q and q.ids)  # drawn here iff drawn on the host
        if q and q.ids:  # drawn from q, which is draft_q's at its parent: tempered, top-k/top-p, cut
            assert path[-1] in q.ids and abs(sum(q.probs) - 1) < 1e-5
            assert q.ids == qs[path][0] and torch.tensor(q.probs) == pytest.approx(qs[path][1], abs=1e-5)
        else:  # the likeliest: among its parent's top_k (a sampled node's whose q ran out: among the top 2k)
            assert logp[draft_id] >= logp.topk(k if sampler is None else 2 * k).values[-1] - 1e-5
        first = parent not in last_rank
        rank = float(logp[draft_id])
        if sampler is not None:  # draw j (its place among its kept siblings) at its depth: its measured worth
            j = sum(p == parent for p in parents[:i])
            rank = values[depths[i] - 1][j] + TIE_BREAK * rank
        last_rank[parent] = rank = rank if first else min(rank, last_rank[parent])
        expected.append((expected[parent] if parent >= 0 else 0.0) + rank)
    if scores is not None:
        assert max(abs(x - y) for x, y in zip(scores, expected, strict=True)) < 1e-4
        assert all(scores[i] <= scores[p] + 1e-6 for i, p in enumerate(parents) if p >= 0)
    ranked = sorted(candidates.values(), reverse=True)
    assert len(candidates) >= n and all(path in candidates for path in paths)
    if n == len(ranked) or ranked[n - 1] - ranked[n] > 1e-4:  # no near-tie at the cut: the kept set is certain
        assert min(candidates[path] for path in paths) >= ranked[n - 1] - 1e-4


@pytest.mark.parametrize("params", [TreeParams(), TreeParams(nodes=20, depth=4, top_k=3), TreeParams(nodes=1),
                                    TreeParams(nodes=62, depth=3, top_k=2), TreeParams(nodes=8, depth=1, top_k=5)],
                         ids=["default", "20-4-3", "one-node", "all-of-2-3", "level-1"])
def test_the_tree_is_well_formed_and_scored_as_chains_along_its_paths(engine, grown, params):
    history = _history(engine, 1)
    drafts = _draft(engine, "shape", history, tree=params)
    _check(engine, history, drafts, params, grown[-1].scores.tolist())


def test_a_tree_of_top_1_is_the_greedy_chain(engine):
    history = _history(engine, 2)
    chain = _draft(engine, "chain", history, k=6)
    tree = _draft(engine, "tree", history, tree=TreeParams(nodes=6, depth=6, top_k=1))
    assert list(tree) == list(chain) and tree.parents == [-1, 0, 1, 2, 3, 4]
    # and with branching, the greedy chain's first drafts head their levels' ranking
    wide = _draft(engine, "wide", history, tree=TreeParams(nodes=62, depth=3, top_k=4))
    first = wide.index(chain[0])
    assert wide.parents[first] == -1 and chain[1] in [t for t, p in zip(wide, wide.parents, strict=True) if p == first]


def test_the_tree_kv_is_dropped(engine):
    """After a tree the session holds its committed pairs only: the next chain is a never-tree session's."""
    history = _history(engine, 3, sizes=(5, 2, 3))
    for sampling in (None, SAMPLED):
        tree_session = _draft(engine, f"with-tree-{sampling}", history[:2], sampling=sampling, tree=TreeParams())
        assert tree_session.parents is not None
        session = engine.sessions.get(f"with-tree-{sampling}")
        assert session.length == session.kv.length == 7 and session.proposed == []
        plain = _draft(engine, f"plain-{sampling}", history[:2], sampling=sampling)
        assert plain.parents is None
        after_tree = engine.propose(f"with-tree-{sampling}", *history[2], 5)
        after_chain = engine.propose(f"plain-{sampling}", *history[2], 5)
        assert list(after_tree) == list(after_chain)
        if sampling is not None:
            assert [q.ids for q in after_tree.q] == [q.ids for q in after_chain.q]


def test_an_ahead_after_a_tree_is_refused_and_a_chain_after_it_is_not(engine):
    history = _history(engine, 4, sizes=(4, 2, 2))
    _draft(engine, "ahead", history[:2], tree=TreeParams(nodes=10))
    with pytest.raises(InvalidRequest):
        engine.prepare("ahead", None, [], [1, 2], 3, branches=2)
    chain = engine.propose("ahead", *history[2], 3)
    assert len(engine.prepare("ahead", None, [], list(chain[:2]), 3, branches=2)) == 2


def test_a_sampled_session_ranks_at_its_temperature(engine, grown):
    history = _history(engine, 5)
    params = TreeParams(nodes=30, depth=4, top_k=4)
    drafts = _draft(engine, "sampled", history, sampling=SAMPLED, tree=params)
    _check(engine, history, drafts, params, grown[-1].scores.tolist(), sampling=SAMPLED)
    # a greedy session's tree of the same history: its level 1 has the sampled one's likeliest, not their scores
    sampled_scores = grown[-1].scores.tolist()
    plain = _draft(engine, "greedy", history, tree=params)
    _check(engine, history, plain, params, grown[-1].scores.tolist())
    greedy_scores = grown[-1].scores.tolist()
    assert all(q.ids for p, q in zip(drafts.parents, drafts.q, strict=True) if p < 0)  # every root child drawn
    assert sampled_scores != greedy_scores


@pytest.mark.parametrize("sampling, top_n", [(SAMPLED, 256), (SamplingParams(temperature=1.0, top_k=20, top_p=0.9,
                                                                              seed=8), 256),
                                             (SamplingParams(temperature=1.2, seed=9), 8)],
                         ids=["t0.6", "top-k-top-p", "cut-to-8"])
def test_each_expanded_node_draws_its_first_child_from_q(engine, grown, monkeypatch, sampling, top_n):
    """Each node drawn from q as the host draws it, with that q_j (_check); the drawn children of a node come
    first (those without q only where q ran out), siblings distinct."""
    monkeypatch.setattr(engine, "q_top_n", top_n)
    history = _history(engine, 12)
    params = TreeParams(nodes=40, depth=5, top_k=3)
    drafts = _draft(engine, "sampled", history, sampling=sampling, tree=params)
    _check(engine, history, drafts, params, grown[-1].scores.tolist(), sampling=sampling)
    assert all(len(q.ids) <= top_n for q in drafts.q) and sum(bool(q.ids) for q in drafts.q) >= 3
    children: dict[int, list[tuple[int, bool]]] = {}
    for token, parent, q in zip(drafts, drafts.parents, drafts.q, strict=True):
        children.setdefault(parent, []).append((token, bool(q.ids)))
    for siblings in children.values():
        flags = [has_q for _, has_q in siblings]
        assert flags == sorted(flags, reverse=True) and len({t for t, _ in siblings}) == len(siblings)
    assert any(has_q for _, has_q in children[-1])  # the root's drawn child is kept here


def test_the_drawn_child_follows_q_over_seeds(engine):
    """The root's drawn child over 400 seeds: its frequencies are q's (chi-square, 4 degrees of freedom)."""
    history = _history(engine, 13, sizes=(6,))
    counts: Counter[int] = Counter()
    first = None
    for seed in range(400):
        drafts = _draft(engine, f"seed-{seed}", history, sampling=SamplingParams(temperature=1.0, top_k=5, seed=seed),
                        tree=TreeParams(nodes=2, depth=1, top_k=2))
        engine.release(f"seed-{seed}")
        drawn = next((t, q) for t, q in zip(drafts, drafts.q, strict=True) if q.ids)  # the first draw
        first = first or drawn[1]
        assert drawn[1].ids == first.ids and drawn[1].probs == pytest.approx(first.probs, abs=1e-6)
        counts[drawn[0]] += 1
    assert len(first.ids) == 5 and max(first.probs) < 0.8  # a q worth the test
    expected = [400 * p for p in first.probs]
    chi2 = sum((counts[t] - e) ** 2 / e for t, e in zip(first.ids, expected, strict=True))
    assert set(counts) <= set(first.ids) and chi2 < 18.47, (counts, first)  # p = 0.001


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_tree_syncs_once_and_uploads_do_not_grow_with_depth(engine, sampled):
    uploads = {}
    for depth in (2, 6):
        history = _history(engine, 6)
        _draft(engine, f"syncs-{depth}", history[:1], sampling=SAMPLED if sampled else None)
        with OpCounter() as ops:
            drafts = engine.propose(f"syncs-{depth}", *history[1], 0, tree=TreeParams(nodes=40, depth=depth, top_k=4))
        assert ops.reads <= 1, dict(ops.sync_ops)  # uploads: tests/test_host_syncs.py
        assert len(drafts) == min(40, 4 + (depth - 1) * 16)
        assert (len(drafts.q) == len(drafts) and any(q.ids for q in drafts.q)) if sampled else drafts.q is None
        assert max(tree_depths(drafts.parents)) <= depth
        uploads[depth] = ops.op_names.get("detach_", 0)  # tensors made from host data
    assert uploads[2] == uploads[6], uploads


def test_trees_and_chains_in_one_batch(engine):
    """What the batcher runs when trees and chains are queued together: chains batched, trees one by one,
    each the same as alone."""
    histories = [_history(engine, 10 + i) for i in range(4)]
    params = [None, TreeParams(nodes=12, depth=3, top_k=3), None, TreeParams(nodes=5, depth=5, top_k=2)]
    alone = [_draft(engine, f"alone-{i}", h, k=4, tree=p) for i, (h, p) in enumerate(zip(histories, params,
                                                                                           strict=True))]
    for i, h in enumerate(histories):
        _draft(engine, f"batch-{i}", h[:1], k=4)
    steps = [_Step(engine.sessions.get(f"batch-{i}"), *h[1], 4, p)
             for i, (h, p) in enumerate(zip(histories, params, strict=True))]
    batched = engine._run_steps(steps)
    for one, other in zip(alone, batched, strict=True):
        assert list(one) == list(other) and one.parents == other.parents


def test_ties_never_drop_a_parent(engine):
    """A draft so sure that its argmax has probability 1 in float32: the argmax path's nodes all score 0, more
    of them than the tree keeps. The kept ones are the shallowest, so every kept node's parent is kept."""
    model = copy.deepcopy(engine.model)
    with torch.no_grad():
        model.lm_head.weight.mul_(1e4)
    features, tokens = _history(engine, 7, sizes=(5,))[0]
    with torch.inference_mode():
        kv = DraftKV()
        a = model(model.fuse(features)[None], torch.tensor([tokens]), torch.arange(5)[None], kv)[:, -1:]
        tree = grow_tree(model, a, kv, torch.tensor([[5]]), TreeParams(nodes=3, depth=6, top_k=2))
        assert kv.length == 5  # the tree's KV dropped
        chain, _, _ = rollout(model, 0, a, kv, torch.tensor([[5]]), 3, None)
    assert tree.scores.tolist() == [0.0, 0.0, 0.0]
    assert tree.tokens.tolist() == chain[0].tolist() and tree.parents.tolist() == [-1, 0, 1]


class _Table:
    """A stand-in draft whose output after token t is row t of a table of logits (its hidden state is its
    logits): ties as exact as wanted."""

    def __init__(self, rows):
        self.table = torch.tensor(rows)
        self.config = type("Config", (), {"draft_vocab_size": self.table.shape[1]})

    def __call__(self, hidden, tokens, positions, kv, mask):
        assert mask.shape == (tokens.shape[1], kv.length + tokens.shape[1])
        return self.table[tokens]

    def draft_logits(self, a):
        return a

    def to_target_ids(self, ids):
        return ids


def test_exact_ties_at_the_cut_keep_the_parents():
    """Level 1: tokens 0 and 1 tie at log 1/2; each has a child of probability 1, so four candidates score
    log 1/2 and two are kept: the two parents, never a child without its parent."""
    big = 1e4
    model = _Table([[big, -big, -big, -big], [-big, -big, big, -big], [0.0] * 4, [0.0] * 4])
    root = torch.tensor([[[0.0, 0.0, -big, -big]]])
    for nodes in (2, 3, 4):
        tree = grow_tree(model, root, DraftKV(), torch.tensor([[3]]), TreeParams(nodes=nodes, depth=2, top_k=2))
        paths = set(_paths(tree.tokens.tolist(), tree.parents.tolist()))
        assert {(0,), (1,)} <= paths <= {(0,), (1,), (0, 0), (1, 2)} and len(paths) == nodes
        assert tree.scores.tolist() == pytest.approx([-0.6931] * nodes, abs=1e-4)


def test_sibling_rates_count_the_path_the_target_took():
    """Draw j at depth d is tried when draws 0..j-1 there were rejected; its worth is P(those rejected) times
    its own rate, each rate with a prior of 1 accepted in 2."""
    rates, tokens, parents = SiblingRates(), [10, 11, 12, 13], [-1, -1, 0, 0]
    rates.count(tokens, parents, [11, 5])  # the root's second child, then the recovered token at a leaf
    rates.count(tokens, parents, [10, 13, 7])  # the first child, then its second
    rates.count(tokens, parents, [9])  # both of the root's children rejected
    assert rates.tried == {(1, 0): 3, (1, 1): 2, (2, 0): 1, (2, 1): 1}
    assert rates.accepted == {(1, 1): 1, (1, 0): 1, (2, 1): 1}
    worth = rates.log_values(2, 2).exp()
    assert worth.flatten().tolist() == pytest.approx([2 / 5, 3 / 5 * 2 / 4, 1 / 3, 2 / 3 * 2 / 3])


def test_a_sampled_tree_is_counted_at_the_next_propose(engine):
    history = _history(engine, 6, sizes=(5, 2, 3))
    tree = _draft(engine, "counted", history[:2], sampling=SAMPLED, tree=TreeParams(nodes=8, depth=3, top_k=2))
    assert engine.sibling_rates.tried == {}
    engine.propose("counted", history[2][0][:2], [tree[0], 7], 3)  # the first child taken, then a recovered token
    assert engine.sibling_rates.accepted == {(1, 0): 1} and engine.sibling_rates.tried[(1, 0)] == 1
    assert engine.sessions.get("counted").last_tree is None  # a chain came next: nothing more to count
