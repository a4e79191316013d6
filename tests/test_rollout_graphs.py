"""The draft's batched propose runs in buffers kept from step to step, and a greedy batch's rollout as a
graph over them (draft_server/graphs.py). On a CPU the graphs are a stand-in whose replay runs the captured
call again over what it closed over, the capture-time tensors, as a CUDA graph replays the kernels over the
capture-time memory: whatever the rollout read that was not static would be read stale, and its drafts would
differ from the eager engine's."""

from __future__ import annotations

import pytest
import torch

from draft_server.engine import DraftEngine
from draft_server.graphs import ROWS, RolloutGraphs, columns_bucket, rows_bucket
from draft_server.steps import _Step
from tandem.params import SamplingParams, TreeParams

K = 4


class _Replay:
    def __init__(self, call, outputs):
        self.call, self.outputs = call, outputs

    def replay(self) -> None:
        for out, fresh in zip(self.outputs, self.call(), strict=True):
            out.copy_(fresh)


def cpu_capture(call, device, pool):
    """tandem.compiling.capture's contract on a CPU: the outputs' tensors, written again at each replay."""
    outputs = tuple(t.clone() for t in call())
    return _Replay(call, outputs), outputs


@pytest.fixture(scope="module")
def engines(tiny_dir) -> tuple[DraftEngine, DraftEngine]:
    eager = DraftEngine(tiny_dir / "draft", tiny_dir / "target")
    graphed = DraftEngine(tiny_dir / "draft", tiny_dir / "target")
    graphed.rollout_graphs = RolloutGraphs(graphed.model, graphed.batch_buffers, graphed.device, graphed.q_top_n,
                                           capture=cpu_capture)
    return eager, graphed


def _pairs(engine: DraftEngine, m: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, engine.feature_size, generator=g), torch.randint(0, 64, (m,), generator=g).tolist()


def _seen(drafts) -> tuple:
    """A propose's drafts, with their q where sampled."""
    return list(drafts), drafts.q and [(p.ids, p.probs) for p in drafts.q]


def _rounds(engine: DraftEngine, names: list[str], rounds: int, sampled=lambda i: None) -> list[tuple]:
    """Each session opened with a prompt of its own (and `sampled(i)`'s sampling), then `rounds` batched
    proposes of 1-3 new pairs -> every session's drafts and q, round after round."""
    drafts = []
    for i, name in enumerate(names):
        drafts.append(_seen(engine.propose(name, *_pairs(engine, 5 + 3 * i, i), K, create=True, sampling=sampled(i))))
    for r in range(rounds):
        steps = [_Step(engine.sessions.get(name), *_pairs(engine, 1 + (r + i) % 3, 100 * r + i), K - (r + i) % 2)
                 for i, name in enumerate(names)]
        with torch.inference_mode():
            drafts += [_seen(d) for d in engine._run_steps(steps)]
    for name in names:
        engine.release(name)
    return drafts


def _same(seen: list[tuple], expected: list[tuple]) -> None:
    """The same drafts, each drawn from the same q but for rounding (a padded batch's softmax sums its columns
    in another order, which can swap two near-equal tokens at the top_n cut): total variation under 1e-4."""
    assert [drafts for drafts, _ in seen] == [drafts for drafts, _ in expected]
    for (_, q), (_, want) in zip(seen, expected, strict=True):
        assert (q is None) == (want is None)
        for (ids, probs), (want_ids, want_probs) in zip(q or (), want or (), strict=True):
            p, w = dict(zip(ids, probs, strict=True)), dict(zip(want_ids, want_probs, strict=True))
            assert sum(abs(p.get(i, 0.0) - w.get(i, 0.0)) for i in p.keys() | w.keys()) / 2 < 1e-4


def test_rows_and_columns_go_up_to_their_buckets():
    assert [rows_bucket(n) for n in (1, 3, 5, 9, 17, 64, 65)] == [1, 4, 8, 16, 24, 64, 80]
    assert all(rows_bucket(n) in ROWS for n in range(1, 65))
    assert [columns_bucket(n) for n in (1, 64, 65, 300, 1000, 1025, 3000)] == [64, 64, 128, 320, 1024, 1280, 3072]
    assert all(n <= columns_bucket(n) < max(n + 64, 1.25 * n) for n in range(1, 5000))  # a quarter more at most


def test_a_batch_of_proposes_reuses_the_buffers_of_the_last(engines):
    eager, _ = engines
    names = [f"reuse-{i}" for i in range(3)]
    _rounds(eager, names, 12)
    buffers = eager.batch_buffers
    generation, storage = buffers.generation, buffers.kv[0][0].data_ptr()
    _rounds(eager, names, 12)  # the same prompts: no longer than the buffers have held
    assert buffers.generation == generation and buffers.kv[0][0].data_ptr() == storage


@pytest.mark.parametrize("batch", [1, 3, 6])
def test_a_graphed_greedy_rollout_drafts_what_the_eager_one_does(engines, batch):
    """Lone sessions too run as a batch of one bucket when graphs are on; the padded rows and columns change
    no real row's drafts, and a bucket's graph serves every batch that meets it."""
    eager, graphed = engines
    names = [f"graphed-{batch}-{i}" for i in range(batch)]
    captures = graphed.rollout_graphs.captures
    expected = _rounds(eager, names, 10)
    assert _rounds(graphed, names, 10) == expected
    captured = graphed.rollout_graphs.captures - captures
    assert 0 < captured < 10 * 2, captured  # at most a bucket of columns a few rounds, each of two Ks


def test_a_graphed_greedy_tree_is_the_eager_one(engines):
    """A lone session's tree from its bucket's graph, over a left-padded copy of its KV: the same nodes and
    parents as grown eagerly over the session's own, round after round, and its KV as long as before."""
    eager, graphed = engines
    captures = graphed.rollout_graphs.captures
    tree = TreeParams(nodes=8, depth=3, top_k=3)
    trees = []
    for engine in (eager, graphed):
        engine.propose("tree", *_pairs(engine, 9, 1), 0, create=True)
        for r in range(8):
            drafts = engine.propose("tree", *_pairs(engine, 1 + r % 3, 50 + r), 0, tree=tree)
            trees.append((list(drafts), drafts.parents, engine.sessions.get("tree").kv.length))
        engine.release("tree")
    assert trees[8:] == trees[:8]
    assert 0 < graphed.rollout_graphs.captures - captures < 8


def test_a_graphed_sampled_rollout_draws_what_the_eager_one_does_and_a_mixed_batch_stays_eager(engines):
    """Sampled batches replay graphs of their own, the rows' settings and uniforms copied in (top-k and top-p
    rows, one cut only); a batch of greedy and sampled sessions together runs eagerly."""
    eager, graphed = engines
    settings = [SamplingParams(temperature=0.8, seed=5), SamplingParams(temperature=1.0, top_k=8, seed=6),
                SamplingParams(temperature=0.7, top_p=0.9, seed=7)]
    for sampled in (lambda i: settings[i], lambda i: settings[0]):
        names = [f"sampled-{i}" for i in range(3)]
        captures = graphed.rollout_graphs.captures
        _same(_rounds(graphed, names, 5, sampled), _rounds(eager, names, 5, sampled))
        assert graphed.rollout_graphs.captures > captures
    mixed = [f"mixed-{i}" for i in range(3)]

    def half(i: int) -> SamplingParams | None:
        return settings[0] if i % 2 else None

    _same(_rounds(graphed, mixed, 4, half), _rounds(eager, mixed, 4, half))
    captures = graphed.rollout_graphs.captures  # the lone first proposes' buckets, captured
    _rounds(graphed, mixed, 4, half)
    assert graphed.rollout_graphs.captures == captures


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_graphed_rollout_drafts_what_the_eager_one_does(tiny_dir, monkeypatch):
    eager = DraftEngine(tiny_dir / "draft", tiny_dir / "target", device="cuda")
    monkeypatch.setenv("TANDEM_CUDA_GRAPHS", "1")
    graphed = DraftEngine(tiny_dir / "draft", tiny_dir / "target", device="cuda")
    assert graphed.rollout_graphs is not None
    for batch in (1, 5):
        names = [f"cuda-{batch}-{i}" for i in range(batch)]
        assert _rounds(graphed, names, 6) == _rounds(eager, names, 6)

        def sampled(i: int) -> SamplingParams:
            return SamplingParams(temperature=0.8, top_p=0.9, seed=i)

        _same(_rounds(graphed, names, 6, sampled), _rounds(eager, names, 6, sampled))
    trees = []
    for engine in (eager, graphed):
        engine.propose("tree", *_pairs(engine, 9, 1), 0, create=True)
        trees.append([engine.propose("tree", *_pairs(engine, 2, 50 + r), 0, tree=TreeParams(nodes=8, depth=3,
                                                                                           top_k=3)).parents
                      for r in range(4)])
        engine.release("tree")
    assert trees[0] == trees[1]
    assert graphed.rollout_graphs.captures > 0
