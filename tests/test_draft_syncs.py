"""The draft's rollout waits on the device at most once: positions, argmax, sampling and the d2t
mapping stay on the device, and the K drafts (with q for a sampled request) are read back in one copy.
Counted with tandem_tools.opcount, which counts on a CPU the syncs a GPU would stall on."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import compile_eagerly

from draft_server.ahead import GreedyAhead
from draft_server.compiled import CompiledCalls
from draft_server.engine import DraftEngine
from draft_server.rollout import GreedyPropose, SampledPropose
from draft_server.steps import _Step
from tandem.defaults import OVERLAP_BRANCHES
from tandem.params import SamplingParams
from tandem_tools.opcount import OpCounter

K = 5
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=3)


@pytest.fixture(scope="module")
def engine(tiny_dir) -> DraftEngine:
    return DraftEngine(tiny_dir / "draft", tiny_dir / "target")


def _inputs(engine: DraftEngine, m: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, engine.feature_size, generator=g), torch.randint(0, 64, (m,), generator=g).tolist()


def _open(engine: DraftEngine, name: str, sampling: SamplingParams | None, seed: int = 0) -> str:
    engine.propose(name, *_inputs(engine, 6 + seed, seed), K, create=True, sampling=sampling)
    return name


def _check(drafts: list[int], q, sampled: bool, k: int = K) -> None:
    assert len(drafts) == k
    if sampled:
        assert q is not None and len(q) == k
        assert all(d in p.ids and abs(sum(p.probs) - 1) < 1e-5 for d, p in zip(drafts, q, strict=True))
    else:
        assert q is None


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_lone_propose_syncs_once(engine, sampled):
    name = _open(engine, f"alone-{sampled}", SAMPLED if sampled else None)
    features, tokens = _inputs(engine, 3, 10)
    with OpCounter() as ops:
        drafts = engine.propose(name, features, tokens, K)
    assert ops.reads <= 1, dict(ops.sync_ops)  # uploads: tests/test_host_syncs.py
    _check(drafts, drafts.q, sampled)
    engine.release(name)


@pytest.mark.parametrize("mix", ["greedy", "sampled", "mixed"])
def test_a_batched_rollout_syncs_once(engine, mix):
    """16 sessions in one batch, each K its own; greedy, sampled, or both in the one batch."""
    names = [_open(engine, f"{mix}-{i}", SAMPLED if mix == "sampled" or (mix == "mixed" and i % 2) else None, i)
             for i in range(16)]
    steps = [_Step(engine.sessions.get(name), *_inputs(engine, 1 + i % 3, 20 + i), K - i % 2)
             for i, name in enumerate(names)]
    with OpCounter() as ops:
        results = engine._run_steps(steps)  # what the batcher runs for 16 concurrent proposes
    assert ops.reads <= 1, dict(ops.sync_ops)  # uploads: tests/test_host_syncs.py
    for step, drafts in zip(steps, results, strict=True):
        _check(drafts, drafts.q, step.session.sampler is not None, step.k)
    for name in names:
        engine.release(name)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("new_pairs", [0, 2])
def test_an_ahead_syncs_once(engine, sampled, new_pairs):
    """Speculating ahead of a verify: the outcomes ranked, the bonus picked and K drafts rolled out per
    branch, all on the device, read back in one copy."""
    name = _open(engine, f"ahead-{sampled}-{new_pairs}", SAMPLED if sampled else None)
    assumed = engine.sessions.get(name).proposed[0][0][:3]
    features, tokens = _inputs(engine, new_pairs, 30) if new_pairs else (None, [])
    with OpCounter() as ops:
        branches = engine.prepare(name, features, tokens, assumed, K, branches=4)
    assert ops.reads <= 1, dict(ops.sync_ops)  # uploads: tests/test_host_syncs.py
    assert len(branches) == 4
    for branch in branches:
        assert 0 <= branch.accepted <= len(assumed)
        _check(branch.drafts, branch.q, sampled)
    engine.release(name)


def _uploads(ops: OpCounter) -> int:
    """Tensors made from host data (torch.tensor(list, device=...)): each dispatches one detach_. On a GPU
    such an upload waits for the stream like a sync, so none may happen between rollout steps."""
    return ops.op_names.get("detach_", 0)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_uploads_do_not_grow_with_k(engine, sampled):
    """What the rollout needs from the host (positions, uniforms, sampling settings) is uploaded once
    before it, not at each step: a propose and an ahead at K=8 upload what they upload at K=2."""
    uploads = {}
    for k in (2, 8):
        name = _open(engine, f"uploads-{sampled}-{k}", SAMPLED if sampled else None)
        features, tokens = _inputs(engine, 3, 40)
        with OpCounter() as propose:
            engine.propose(name, features, tokens, k)
        assumed = engine.sessions.get(name).proposed[0][0][:2]
        with OpCounter() as ahead:
            engine.prepare(name, None, [], assumed, k, branches=3)
        uploads[k] = (_uploads(propose), _uploads(ahead))
        engine.release(name)
    assert uploads[2] == uploads[8], uploads


def test_a_packed_cpu_draft_proposes_what_the_unpacked_one_does(tiny_dir, monkeypatch):
    """On a CPU in float32 the draft's big projections run over oneDNN's prepacked weights (tandem/packed.py;
    every one here, the threshold lowered): greedy drafts as the unpacked engine's, and q within rounding."""
    from tandem import packed

    plain = DraftEngine(tiny_dir / "draft", tiny_dir / "target")
    monkeypatch.setattr(packed, "PACK_MIN_WEIGHTS", 1)
    packed_engine = DraftEngine(tiny_dir / "draft", tiny_dir / "target")
    assert isinstance(packed_engine.model.lm_head, packed.PackedLinear)
    assert isinstance(packed_engine.model.fc, packed.PackedLinear)
    for engine in (plain, packed_engine):
        _open(engine, "g", None)
        _open(engine, "s", SAMPLED)
    for step in range(3):
        features, tokens = _inputs(plain, 2, 10 + step)
        assert list(packed_engine.propose("g", features, tokens, K)) == list(plain.propose("g", features, tokens, K))
        a, b = packed_engine.propose("s", features, tokens, K), plain.propose("s", features, tokens, K)
        assert list(a) == list(b)
        for pa, pb in zip(a.q, b.q, strict=True):
            assert pa.ids == pb.ids and max(abs(x - y) for x, y in zip(pa.probs, pb.probs, strict=True)) < 1e-4


@pytest.fixture(scope="module")
def compiled_and_eager(tiny_dir) -> tuple[DraftEngine, DraftEngine]:
    """A draft engine with TANDEM_COMPILE (dynamo's eager backend: the graphs, guards and recompiles, none of
    inductor's time) and one without."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        compile_eagerly(monkeypatch)
        for compiled_call in (GreedyPropose, GreedyAhead, SampledPropose):  # the Ks the tests use: ~2 s a K
            monkeypatch.setattr(compiled_call, "KS", (1, 3, K))
        monkeypatch.setenv("TANDEM_COMPILE", "1")
        torch._dynamo.reset()
        compiled = DraftEngine(tiny_dir / "draft", tiny_dir / "target")
        monkeypatch.setenv("TANDEM_COMPILE", "0")
        eager = DraftEngine(tiny_dir / "draft", tiny_dir / "target")
    assert None not in (compiled.greedy_propose, compiled.greedy_ahead, compiled.sampled_propose)
    assert (eager.greedy_propose, eager.greedy_step, eager.greedy_ahead, eager.sampled_propose) == (None,) * 4
    return compiled, eager


def test_a_compiled_greedy_propose_drafts_what_the_eager_one_does(compiled_and_eager):
    """TANDEM_COMPILE: a lone greedy session's proposes after its first run as one compiled call each
    (rollout.GreedyPropose, for K in GreedyPropose.KS), its first propose's and other Ks' rollout steps one
    compiled call a step (rollout.GreedyStep). All compiled at start-up (nothing after, whatever the new pairs'
    count or the tensors' kind), with the drafts of the eager engine, propose after propose; a sampled session
    keeps the eager path."""
    compiled, eager = compiled_and_eager
    steps, proposes = [], []
    step, propose = compiled.greedy_step._step, compiled.greedy_propose._propose
    compiled.greedy_step._step = lambda *args: steps.append(1) or step(*args)
    compiled.greedy_propose._propose = lambda *args: proposes.append(args[-1]) or propose(*args)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for engine in (compiled, eager):
        _open(engine, "g", None)
        _open(engine, "s", SAMPLED)
    ks = [K, 3, K, 7, 1]
    for i, k in enumerate(ks):
        features, tokens = _inputs(compiled, 1 + i % 3, 30 + i)
        assert list(compiled.propose("g", features, tokens, k)) == list(eager.propose("g", features, tokens, k))
        sampled = compiled.propose("s", features, tokens, k)
        assert list(sampled) == list(eager.propose("s", features, tokens, k)) and sampled.q is not None
    assert proposes == [K, 3, K, 1]  # K=7 is not compiled whole: the first propose's steps and its, one at a time
    assert len(steps) == (K - 1) + (7 - 1)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # nothing compiled after start-up


def test_a_background_compile_answers_eagerly_until_its_calls_are_in_and_a_failed_one_stays_eager(
        tiny_dir, compiled_and_eager, monkeypatch):
    """TANDEM_COMPILE=background: the engine is built at once and proposes eagerly while a thread compiles its
    calls (here the compiled engine's own, handed over when the test says); then the compiled calls run, with
    the same drafts. A compile that fails leaves the engine eager and says it is done."""
    compiled = compiled_and_eager[0]
    eager = DraftEngine(tiny_dir / "draft", tiny_dir / "target")  # its own: the module's counts its outcomes
    release = threading.Event()
    calls = CompiledCalls(compiled.greedy_step, compiled.greedy_propose, compiled.greedy_ahead,
                          compiled.sampled_propose)

    def build(unpacked, draft_id, q_top_n):
        assert release.wait(30)
        return calls

    monkeypatch.setattr(CompiledCalls, "build", build)
    monkeypatch.setenv("TANDEM_COMPILE", "background")
    engine = DraftEngine(tiny_dir / "draft", tiny_dir / "target")
    assert not engine.compiled.is_set() and engine.greedy_propose is None
    for e in (engine, eager):
        _open(e, "bg", None)
    proposes = []
    propose = compiled.greedy_propose._propose
    monkeypatch.setattr(compiled.greedy_propose, "_propose", lambda *args: proposes.append(1) or propose(*args))
    for i in range(2):
        features, tokens = _inputs(engine, 2, 50 + i)
        assert list(engine.propose("bg", features, tokens, K)) == list(eager.propose("bg", features, tokens, K))
        assert proposes == [1] * i  # eager before the calls are in, compiled after
        release.set()
        assert engine.compiled.wait(30) and engine.greedy_propose is compiled.greedy_propose

    def fail(unpacked, draft_id, q_top_n):
        raise RuntimeError("inductor is out of sorts")

    monkeypatch.setattr(CompiledCalls, "build", fail)
    broken = DraftEngine(tiny_dir / "draft", tiny_dir / "target")
    assert broken.compiled.wait(30) and broken.greedy_propose is broken.greedy_step is None
    features, tokens = _inputs(broken, 3, 60)
    assert len(broken.propose("x", features, tokens, K, create=True)) == K


def test_a_compiled_greedy_ahead_prepares_what_the_eager_one_does(compiled_and_eager):
    """TANDEM_COMPILE: overlap's ahead for a lone greedy session runs as one compiled call (ahead.GreedyAhead)
    where it assumes K drafts and prepares K, K in GreedyAhead.KS, over the default branches: right after a
    propose (no new pairs) and after a hit (1 to K+1 new pairs). The branches of the eager engine, ahead after
    ahead, nothing compiled after start-up; other shapes and a sampled session keep the eager path."""
    compiled, eager = compiled_and_eager
    calls = []
    ahead = compiled.greedy_ahead._ahead
    compiled.greedy_ahead._ahead = lambda *args: calls.append(args[-1]) or ahead(*args)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    b = OVERLAP_BRANCHES
    # (new pairs, K, branches); None: a miss, a propose of K first and then the ahead
    script = [(None, K, b), (2, K, b), (1, K, b), (K + 1, 3, b), (3, 3, b), (None, 3, 3), (2, 3, b), (None, 1, b)]

    def run(engine: DraftEngine, name: str) -> list:
        out, assumed = [], engine.sessions.get(name).proposed[0][0]
        for i, (m, k, branches) in enumerate(script):
            if m is None:
                assumed = list(engine.propose(name, *_inputs(engine, 2, 40 + i), k))
                features, tokens = None, []
            else:
                features, tokens = _inputs(engine, m, 40 + i)
            prepared = engine.prepare(name, features, tokens, assumed, k, branches)
            out.append([(p.accepted, p.bonus, p.drafts) for p in prepared])
            assumed = prepared[0].drafts
        return out

    for name, sampling in (("ahead-greedy", None), ("ahead-sampled", SAMPLED)):
        _open(compiled, name, sampling, seed=4)
        _open(eager, name, sampling, seed=4)
        assert run(compiled, name) == run(eager, name)
    assert calls == [K, K, K, 3, 3, 1]  # K+1 pairs assuming K and preparing 3: eager; 3 branches: eager
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # nothing compiled after start-up


def test_a_compiled_sampled_propose_draws_what_the_eager_one_does(compiled_and_eager):
    """TANDEM_COMPILE: a lone sampled session's proposes after its first run as one compiled call each
    (rollout.SampledPropose, K in its KS), with and without top-p: the same drafts, drawn with the same uniforms,
    and the same q as the eager engine's, nothing compiled after start-up; a top-k request and other Ks keep the
    eager path."""
    compiled, eager = compiled_and_eager
    calls = []
    propose = compiled.sampled_propose._propose
    compiled.sampled_propose._propose = lambda *args: calls.append(args[5]) or propose(*args)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    requests = {"plain": SamplingParams(temperature=0.7, seed=5), "top-p": SamplingParams(temperature=1.0, top_p=0.8,
                seed=6), "top-k": SamplingParams(temperature=1.0, top_k=5, seed=7)}
    for name, sampling in requests.items():
        for engine in (compiled, eager):
            _open(engine, f"sampled-{name}", sampling)
    for i, k in enumerate([K, 3, 7, 1, K]):
        for name in requests:
            features, tokens = _inputs(compiled, 1 + i % 3, 50 + i)
            a, b = (engine.propose(f"sampled-{name}", features, tokens, k) for engine in (compiled, eager))
            assert list(a) == list(b) and a.q == b.q
            _check(list(a), a.q, True, k)
    assert calls == [K, K, 3, 3, 1, 1, K, K]  # no top-k, K in KS: compiled; K=7 and the top-k request eagerly
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # nothing compiled after start-up
