"""Continuous batching in both engines: concurrent sessions share forward passes, and no request's
output changes because of it; the KV budget queues and then refuses instead of running out of memory."""

from __future__ import annotations

import gc
import threading
import types
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_core import assert_same_or_tie, hf_greedy, make_prompts

from tandem.params import GenerationRequest, SamplingParams
from tandem.protocol import Prefill, Propose, Verify
from tandem.sessions import ResourceExhausted, SessionNotFound
from tandem_tools.inprocess import InProcessGenerator
from target_server.engine import TargetEngine
from target_server.paged import bucket
from target_server.steps import Session, Step


def run_concurrently(generator: InProcessGenerator, requests: list[GenerationRequest]) -> list[list[int]]:
    start = threading.Barrier(len(requests))

    def one(request: GenerationRequest) -> list[int]:
        start.wait()
        return generator.generate(request).token_ids

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def test_concurrent_greedy_sessions_match_target_only(generator, hf_target):
    """Mixed prompt lengths, mixed K (0 = target-only), different lengths so sessions leave the batch
    at different times; every output equals transformers' greedy generate on its own."""
    prompts = make_prompts(12, generator.target.vocab_size, seed=7)
    requests = [
        GenerationRequest(prompt_ids=p, max_new_tokens=8 + 3 * i, num_draft_tokens=[0, 1, 3, 5, 8][i % 5],
                          speculate=i % 5 != 0, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    outputs = run_concurrently(generator, requests)
    for request, ours in zip(requests, outputs, strict=True):
        assert len(ours) == request.max_new_tokens
        assert_same_or_tie(hf_target, request.prompt_ids, ours, hf_greedy(hf_target, request.prompt_ids, len(ours)))
    assert generator.target.num_sessions == 0 and generator.draft.num_sessions == 0
    assert generator.target.kv_budget.used == 0


def test_concurrent_in_process_generations_share_the_schedulers_steps(generator):
    """Generations streamed at once from several threads are stepped together (one batch per engine a step),
    each with the tokens it makes alone."""
    requests = [GenerationRequest(prompt_ids=p, max_new_tokens=16, num_draft_tokens=3, ignore_eos=True)
                for p in make_prompts(6, generator.target.vocab_size, seed=11)]
    alone = [generator.generate(r) for r in requests]
    before = generator._stepper.steps
    assert run_concurrently(generator, requests) == [a.token_ids for a in alone]
    steps = generator._stepper.steps - before
    assert steps < sum(a.stats["num_rounds"] for a in alone) / 2  # alone, at least a step a round each


def test_a_dropped_in_process_generator_stops_its_scheduler_and_frees_its_engines(tiny_dir):
    """The scheduler's thread holds the engines, not the generator: once a generator that has generated is
    dropped, its scheduler stops and its models are freed (a process making many generators keeps none)."""
    dropped = InProcessGenerator(tiny_dir / "target", tiny_dir / "draft")
    request = GenerationRequest(prompt_ids=[5, 6, 7], max_new_tokens=4, num_draft_tokens=2, ignore_eos=True)
    assert len(dropped.generate(request).token_ids) == 4
    thread, target = dropped._stepper._thread, weakref.ref(dropped.target)
    assert thread.is_alive()
    del dropped
    gc.collect()
    thread.join(5.0)
    assert not thread.is_alive()
    gc.collect()
    assert target() is None


def test_the_paged_kv_pool_grows_under_load_and_gets_every_block_back(generator, hf_target):
    """From a pool of one block, concurrent sessions take blocks as they grow (the pool doubles, mid-run);
    outputs equal transformers' greedy and every block is free again afterwards."""
    target = generator.target
    saved = target.kv_pool
    target.kv_pool = type(saved)(target.num_layers, target.kv_heads, target.head_dim, target.dtype, target.device,
                                 blocks=1)
    try:
        prompts = make_prompts(6, target.vocab_size, seed=5)
        requests = [GenerationRequest(prompt_ids=p, max_new_tokens=24 + 4 * i, num_draft_tokens=3, ignore_eos=True)
                    for i, p in enumerate(prompts)]
        outputs = run_concurrently(generator, requests)
        for request, ours in zip(requests, outputs, strict=True):
            assert_same_or_tie(hf_target, request.prompt_ids, ours, hf_greedy(hf_target, request.prompt_ids, len(ours)))
        pool = target.kv_pool
        assert pool.capacity > pool.BLOCK and len(set(pool._free)) * pool.BLOCK == pool.capacity
    finally:
        target.kv_pool = saved


def test_sampled_sessions_give_the_same_tokens_batched_as_alone(generator):
    """Seeded sampling at mixed temperatures: a session's tokens depend on its seed only, not on
    which sessions shared its batches."""
    prompts = make_prompts(8, generator.target.vocab_size, seed=3)
    temperatures = [0.0, 0.7, 1.0, 1.3]
    requests = [
        GenerationRequest(prompt_ids=p, max_new_tokens=20, num_draft_tokens=1 + i % 4, ignore_eos=True,
                          sampling=SamplingParams(temperature=temperatures[i % 4], top_p=0.9 if i % 3 else 1.0,
                                                  seed=100 + i))
        for i, p in enumerate(prompts)
    ]
    alone = [generator.generate(r).token_ids for r in requests]
    assert run_concurrently(generator, requests) == alone


def test_the_kv_budget_is_taken_as_a_session_grows_and_refuses_at_once_while_taken(tiny_dir):
    """A session holds the KV it has used (its prompt and one verify's width), not its max_new_tokens, and
    grows its share as it verifies; a full budget refuses at once (the scheduler keeps a prefill waiting and
    preempts for a verify); one that could never fit is refused as such."""
    engine = TargetEngine(tiny_dir / "target", kv_cache_tokens=100)
    greedy = SamplingParams()
    with pytest.raises(ResourceExhausted, match="whole KV budget is 100"):
        engine.prefill("huge", [5] * 10, greedy, max_new_tokens=200)
    token = engine.prefill("a", [5] * 12, greedy, max_new_tokens=60).token  # 12 + 17 = 29: 32 in whole blocks
    assert engine.kv_budget.used == 32
    token = engine.verify("a", token, [8] * 3).bonus  # 12 + 4 = 16 tokens: within its 32
    engine.prefill("b", [6] * 45, greedy, max_new_tokens=20)  # 45 + 17 = 62: 64
    assert engine.kv_budget.used == 96
    with pytest.raises(ResourceExhausted, match="budget is taken"):  # a grows past its share: more than 100
        for _ in range(60):
            token = engine.verify("a", token, [8] * 3).bonus
    with pytest.raises(ResourceExhausted, match="budget is taken"):
        engine.prefill("c", [6] * 10, greedy, max_new_tokens=1)
    engine.release("b")  # once a session finishes, the others grow and new ones get in
    engine.verify("a", token, [8] * 3)
    engine.prefill("c", [6] * 10, greedy, max_new_tokens=1)
    engine.release("a")
    engine.release("c")
    assert engine.kv_budget.used == 0


def test_the_draft_kv_budget_refuses_a_propose_past_it_alone_and_a_released_session_gives_its_tokens_back(tiny_dir):
    """The draft's KV grew without a bound. Now each session's committed pairs come out of one budget: a propose
    that would pass it fails alone with ResourceExhausted naming the session, the tokens asked and those left,
    and leaves nothing behind; the batch's other steps give what they give without it; a session's tokens come
    back when it is released or evicted."""
    from draft_server.engine import DraftEngine

    reference = DraftEngine(tiny_dir / "draft", tiny_dir / "target")  # unbounded: what the steps give anyway
    engine = DraftEngine(tiny_dir / "draft", tiny_dir / "target")
    engine.kv_budget.tokens = 20
    rng = torch.Generator().manual_seed(0)
    features = {sid: torch.randn(n, engine.feature_size, generator=rng)
                for sid, n in (("a", 12), ("b", 6), ("c", 5), ("a2", 2))}
    tokens = {sid: list(range(10, 10 + len(f))) for sid, f in features.items()}
    for e in (reference, engine):
        e.propose("a", features["a"], tokens["a"], 3, create=True)  # 12 of 20
    batch = [Propose("b", features["b"], tokens["b"], 3, open=True),  # 18 of 20
             Propose("c", features["c"], tokens["c"], 3, open=True),  # 23: refused
             Propose("a", features["a2"], tokens["a2"], 3)]  # 20
    expected = reference.run([batch[0], batch[2]])
    b, c, a = engine.run(batch)
    assert isinstance(c, ResourceExhausted)
    assert "draft session 'c' asks for 5 KV tokens; 2 of the draft's KV budget of 20 are left" in str(c)
    assert [list(b), list(a)] == [list(d) for d in expected]
    assert sorted(engine.session_ids()) == ["a", "b"] and engine.kv_budget.used == 20
    with pytest.raises(ResourceExhausted, match="'b' asks for 1 KV tokens; 0 of the draft's KV budget of 20"):
        engine.propose("b", features["a2"][:1], [9], 3)
    engine.release("a")  # its 14 pairs come back: b goes on where it was, c gets in
    assert engine.kv_budget.used == 6
    assert list(engine.propose("b", features["a2"][:1], [9], 3)) == list(reference.propose("b", features["a2"][:1], [9], 3))
    engine.propose("c", features["c"], tokens["c"], 3, create=True)
    assert engine.kv_budget.used == 12
    engine.release("b")
    assert engine.evict_idle(0) == ["c"] and engine.kv_budget.used == 0


def test_a_native_targets_prefill_shares_the_batch_of_verifies(tiny_dir):
    """The native forward pads nothing, so a prefill in a batch of verifies runs with them (one forward where
    the widths are compiled: NativeRunner.parts), and gives what it gives alone."""
    engine = TargetEngine(tiny_dir / "target", engine="native")
    greedy = SamplingParams(temperature=0.0)
    alone = engine.prefill("alone", [7, 8, 9, 10], greedy, max_new_tokens=8)
    a, c = (engine.prefill(s, [5, 6], greedy, max_new_tokens=8) for s in ("a", "c"))
    held = engine.verify("a", a.token, [])
    verify, prefill = engine.run([Verify("c", c.token, []), Prefill("b", [7, 8, 9, 10], greedy, max_new_tokens=8)])
    assert prefill.token == alone.token and verify.bonus == held.bonus  # c is a's sequence
    torch.testing.assert_close(prefill.features, alone.features, rtol=1e-4, atol=1e-4)


def test_a_compiled_target_mixes_prefills_in_only_at_a_width_it_has_compiled(tiny_dir):
    """A new width would run eagerly (or compile on the requests' path), and eagerly a prompt's attention is
    dense over the pool: the verifies run on their own then, and the prefills after them."""
    engine = TargetEngine(tiny_dir / "target", engine="native")
    runner, pool = engine.runner, engine.kv_pool
    session = Session(params=SamplingParams(temperature=0.0), generator=None)
    steps = [Step("verify", session, [1], False), Step("prefill", session, [1] * 20, True),
             Step("verify", session, [2, 3], False)]
    apart = [[steps[0], steps[2]], [steps[1]]]
    runner.buckets.add((bucket(23), pool.owner.shape[0]))
    assert runner.parts(steps, None, pool) == apart  # eager: dense attention, a batch of prompts alone is cheaper
    runner.compiled = True
    assert runner.parts(steps, None, pool) == [steps]
    runner.buckets.clear()
    assert runner.parts(steps, None, pool) == apart
    assert runner.parts(steps[1:2], None, pool) == [steps[1:2]] and runner.parts(steps[::2], None, pool) == [steps[::2]]


@pytest.mark.parametrize("engine", ["native", "hf"])
def test_a_session_released_while_its_step_is_queued_or_running_fails_that_step_alone(tiny_dir, engine):
    """A client's deadline ends its session whenever it falls: a step of it still queued fails alone (NOT_FOUND),
    and a release that falls while the batch runs waits for it to end (a release mid-batch emptied the block
    table the batch's plan then read, and every step in the batch failed with an IndexError); the other sessions'
    steps give what they give without it, and no block is lost."""
    target = TargetEngine(tiny_dir / "target", engine=engine)
    greedy = SamplingParams(temperature=0.0)
    free = len(target.kv_pool._free)
    firsts = {s: target.prefill(s, [5, 6, 7], greedy, max_new_tokens=16).token for s in ("a", "b", "c")}
    alone = target.verify("c", firsts["c"], [3, 4])  # b's step below, without a beside it
    target.release("c")
    steps = {s: target._verify_step(Verify(s, firsts[s], [3, 4], True)) for s in ("a", "b")}
    target.release("a")  # queued, then released: its step fails alone
    gone, kept = target._run_batch([steps["a"], steps["b"]])
    assert isinstance(gone, SessionNotFound) and "ended before its verify ran" in str(gone)
    assert kept.bonus == alone.bonus and kept.accepted == alone.accepted
    assert torch.equal(kept.features, alone.features)
    target.release("b")
    late = {s: target.prefill(s, [5, 6, 7], greedy, max_new_tokens=16).token for s in ("d", "e")}
    forward, releases = target.runner.forward, []

    def releasing(*args):  # "d" released from another thread while the batch's forward runs
        releases.append(threading.Thread(target=target.release, args=("d",)))
        releases[-1].start()
        releases[-1].join(0.2)
        assert releases[-1].is_alive(), "a release ran in the middle of a batch"
        return forward(*args)

    target.runner.forward = releasing
    results = target._run_batch([target._verify_step(Verify(s, late[s], [3, 4], True)) for s in ("d", "e")])
    target.runner.forward = forward
    releases[0].join(5)
    assert not releases[0].is_alive() and "d" not in target.sessions
    assert [r.bonus for r in results] == [alone.bonus] * 2
    target.release("e")
    assert len(target.kv_pool._free) == free


@torch.inference_mode()
def test_memory_does_not_grow_over_a_long_batched_run(generator):
    """Many rounds of 8 concurrent sessions: the number of live tensors returns to where it was."""
    import gc

    def live_tensors() -> int:
        gc.collect()
        with warnings.catch_warnings():  # isinstance() on every object touches deprecated torch attributes
            warnings.simplefilter("ignore")
            return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))

    prompts = make_prompts(8, generator.target.vocab_size, seed=11)
    requests = [GenerationRequest(prompt_ids=p, max_new_tokens=30, num_draft_tokens=4, ignore_eos=True) for p in prompts]
    run_concurrently(generator, requests)  # warm up
    before = live_tensors()
    for _ in range(3):
        run_concurrently(generator, requests)
    assert live_tensors() <= before
    assert generator.target.num_sessions == 0 and generator.draft.num_sessions == 0


def test_adaptive_k_shrinks_with_load_and_sheds_the_draft(generator, hf_target):
    from tandem.policy import Speculation, adaptive_k
    from tandem_tools.inprocess import run_rounds

    running = [1]
    k_for = adaptive_k(64, lambda: running[0])
    assert [k_for(5) for running[0] in (1, 8, 16, 32, 64)] == [5, 5, 3, 1, 0]

    running[0] = 1
    prompt = make_prompts(1, generator.target.vocab_size, seed=5)[0]
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=30, num_draft_tokens=5, ignore_eos=True)
    tokens, ks, event = [], [], None
    budgeted = adaptive_k(64, lambda: running[0])

    def k_for_round(k: int) -> int:
        ks.append(budgeted(k))
        if len(ks) == 3:
            running[0] = 64  # the server got busy: drafting stops for the rest of the generation
        return ks[-1]

    for event in run_rounds(generator.target, generator.draft, request, speculation=Speculation(k_for=k_for_round)):
        tokens.extend(event.new_tokens)
    assert ks[:3] == [5, 5, 5] and ks[3] == 0  # asked once before the prefill, then per round
    assert event.stats.num_rounds_load_shed == event.stats.num_rounds - 2 > 0
    assert generator.draft.num_sessions == 0  # released when shed
    assert_same_or_tie(hf_target, prompt, tokens, hf_greedy(hf_target, prompt, len(tokens)))


def test_a_request_waits_while_the_kv_budget_is_taken_and_runs_once_it_is_free(tiny_dir, tmp_path):
    """Through the three processes: one long generation holds most of the target's KV budget; the next waits
    in the coordinator's queue (the target refused its prefill: vLLM's admission, not a 429), the first carries
    on untouched, and once it is gone the second runs to its end. One that could never fit is refused."""
    from processes import start_stack, stop_stack

    from coordinator.client import TandemClient, TandemError

    engine = TargetEngine(tiny_dir / "target")
    gib = 1100 * engine.kv_bytes_per_token / (1 << 30)  # 1100 tokens: one generation of 5 + 1000 (+17)
    procs = start_stack(tiny_dir, tmp_path, target_args=["--kv-cache-gib", f"{gib:.12f}"])
    try:
        with TandemClient(procs["coordinator"].address, timeout=120) as client:
            with pytest.raises(TandemError) as refused:
                client.generate(prompt_ids=[5, 6, 7, 8, 9], max_new_tokens=2000)
            assert refused.value.code.name == "RESOURCE_EXHAUSTED" and "whole KV budget" in refused.value.details
            stream = client.generate_stream(prompt_ids=[5, 6, 7, 8, 9], max_new_tokens=1000, ignore_eos=True)
            next(stream)  # it holds 1022 of the 1100 tokens
            with ThreadPoolExecutor(1) as pool:
                second = pool.submit(client.generate, prompt_ids=[5, 6, 7, 8, 9], max_new_tokens=100, ignore_eos=True)
                for _ in range(20):
                    assert next(stream).token_ids  # the first one is untouched
                assert not second.done()  # it waits for KV
                stream.close()  # its sessions (and their reservation) are released
                assert len(second.result(60).token_ids) == 100
    finally:
        stop_stack(procs)


def test_a_request_whose_draft_runs_out_of_its_kv_budget_goes_on_target_only_and_the_draft_serves_the_next(
        tiny_dir, tmp_path):
    """Through the three processes, with a draft KV budget of 60 pairs: a 40-token prompt's draft runs out of it
    after a few rounds; its propose is refused (RESOURCE_EXHAUSTED), the request goes on target-only with the
    same greedy output, the draft stays attached, and the next request drafts every round in the tokens the
    first gave back."""
    from processes import start_stack, stop_stack

    from coordinator.client import TandemClient
    from draft_server.budget import kv_bytes_per_token
    from draft_server.engine import DraftEngine

    gib = 60.5 * kv_bytes_per_token(DraftEngine(tiny_dir / "draft", tiny_dir / "target")) / (1 << 30)
    procs = start_stack(tiny_dir, tmp_path, draft_args=["--kv-cache-gib", f"{gib:.12f}"])
    long = {"prompt_ids": list(range(5, 45)), "max_new_tokens": 80, "ignore_eos": True, "num_draft_tokens": 3}
    short = {"prompt_ids": [5, 6, 7], "max_new_tokens": 20, "ignore_eos": True, "num_draft_tokens": 3}
    try:
        with TandemClient(procs["coordinator"].address, timeout=120) as client:
            target_only = client.generate(**long, speculate=False).token_ids
            ran_out = client.generate(**long)
            assert ran_out.token_ids == target_only
            assert ran_out.stats["num_draft_tokens"] > 0 and ran_out.stats["num_rounds_without_draft"] > 0
            assert client.server_info().draft_attached
            next_one = client.generate(**short)
            assert next_one.token_ids == client.generate(**short, speculate=False).token_ids
            assert next_one.stats["num_draft_tokens"] > 0 and next_one.stats["num_rounds_without_draft"] == 0
        log = (tmp_path / "coordinator.1.log").read_text()
        assert "the draft is lost" in log and "the draft's KV budget of 60 are left" in log
    finally:
        stop_stack(procs)


def test_a_generation_that_starts_under_full_load_never_opens_a_draft_session(generator):
    from helpers import RecordingDraft

    from tandem.policy import Speculation
    from tandem_tools.inprocess import run_rounds

    draft = RecordingDraft(generator.draft)
    request = GenerationRequest(prompt_ids=[5, 6, 7, 8], max_new_tokens=10, num_draft_tokens=4, ignore_eos=True)
    events = list(run_rounds(generator.target, draft, request, speculation=Speculation(k_for=lambda k: 0)))
    assert draft.calls == [] and generator.draft.num_sessions == 0
    stats = events[-1].stats
    assert stats.num_rounds_load_shed == stats.num_rounds == 9 and stats.num_draft_tokens == 0


def test_the_acceptance_gate_keeps_the_k_that_pays():
    from tandem.gates import AcceptanceGate

    gate = AcceptanceGate(0.3)
    assert gate.best_k(True, 5) == 5  # nothing seen yet: speculate
    for accepted in [3] * 8 + [2] * 4 + [1] * 2 + [0] * 2:  # a head the target usually agrees with
        gate.record(True, 3, accepted)
    assert gate.best_k(True, 3) == 3
    for _ in range(40):  # sampled requests are counted apart: this head fails them
        gate.record(False, 3, 0)
    assert gate.best_k(False, 3) == 0 and gate.best_k(True, 3) == 3
    probes = [gate.probe() for _ in range(2 * AcceptanceGate.PROBE_EVERY)]
    assert probes.count(AcceptanceGate.PROBE_ROUNDS) == 2 and probes.count(0) == len(probes) - 2


def test_the_gate_sheds_where_the_server_runs_faster_target_only():
    """The whole server's tokens per second, counted only while it all runs one way (prefills and gaps
    included): target-only faster than drafting sheds; the cost per draft token is the measured one."""
    from tandem.gates import AcceptanceGate, load_bucket

    assert [load_bucket(n) for n in (0, 1, 2, 3, 4, 5, 16, 17)] == [1, 1, 2, 4, 4, 8, 16, 32]
    clock = types.SimpleNamespace(now=0.0)
    gate = AcceptanceGate(0.3, clock=lambda: clock.now)

    def steps(n: int, kind: str, tokens: list[int], seconds: float, gap: float = 0.0, greedy: bool = False):
        """n batched steps of `seconds`, session i committing tokens[i] each, `gap` seconds idle after each."""
        for _ in range(n):
            clock.now += seconds
            for t in tokens:
                gate.record_round(greedy, kind, t, 3 if kind == "chain" else 0, seconds)
            clock.now += gap

    enough = AcceptanceGate.SERVED_TOKENS  # tokens per generation running, before a rate counts
    for _ in range(4):
        gate.enter(False, greedy=False)
    # 4 target-only generations, 100 tokens/s each a round, but 10 ms of prefill after each 10 ms step:
    # the server makes 4 tokens in 20 ms, 200 tokens/s
    steps(enough, "target", [1] * 4, 0.010, gap=0.010)
    gate.enter(True, greedy=False)  # a mixed batch: neither kind says what the server would do all one way
    steps(enough, "chain", [4] * 5, 0.001)
    assert not gate.outpaced(False)  # no drafting rate at load 8
    gate.leave(True, greedy=False)
    for _ in range(4):
        gate.leave(False, greedy=False)
    for _ in range(4):
        gate.enter(True, greedy=False)
    assert gate.round_costs(False, 3) == pytest.approx([1, 1.3, 1.6, 1.9])  # nothing measured at load 4: the prior
    # 4 drafting generations: 2.5 tokens in 40 ms each, 62 tokens/s a session where a target-only round
    # made 100, but the server makes 10 tokens in 40 ms, 250 tokens/s against 200: no shed
    steps(enough, "chain", [3, 2, 3, 2], 0.040)
    # K=3 measured: under it a draft fewer saves the prior's 0.3 (a round's fixed share stays), past it costs 0.3
    assert gate.round_costs(False, 5) == pytest.approx([1, 3.4, 3.7, 4, 4.3, 4.6])
    assert gate.outpaced(False) is False
    steps(4 * enough, "chain", [1, 1, 1, 1], 0.040)  # now 100 tokens/s: target-only is twice as fast
    assert gate.outpaced(False)
    starts = [gate.outpaced(False, starting=True) for _ in range(2 * AcceptanceGate.EXPLORE_EVERY)]
    assert all(starts)  # no explorer under load: its rounds would be mixed, never counted
    assert not gate.outpaced(True)  # nothing greedy measured: nothing to compare with
    gate.enter(True, greedy=False)  # load 5 -> bucket 8: nothing measured there
    assert not gate.outpaced(False) and gate.round_costs(False, 1) == pytest.approx([1, 1.3])
    gate.enter(True, greedy=True)  # greedy and sampled together: nothing the server does counts
    steps(enough, "chain", [1] * 6, 0.030)
    assert gate._served[False, 8, "drafting"].tokens == 0 and (True, 8, "drafting") not in gate._served
    for drafting, greedy in [(True, False)] * 5 + [(True, True)]:
        gate.leave(drafting, greedy)
    gate.enter(False, greedy=False)  # alone: the starts that would shed explore now and then (the next test)
    steps(enough, "target", [1], 0.010)
    gate.leave(False, greedy=False)
    gate.enter(True, greedy=False)
    steps(enough, "chain", [1], 0.020)
    gate.leave(True, greedy=False)
    starts = [gate.outpaced(False, starting=True) for _ in range(AcceptanceGate.EXPLORE_EVERY)]
    assert starts.count(None) == 1 and set(starts[starts.index(None) + 1:]) <= {False}  # then: no drafting rate
    for _ in range(4):  # back at load 4, target-only: the drafting rate there grows old and is measured again
        gate.enter(False, greedy=False)
    assert gate.outpaced(False)
    steps(AcceptanceGate.REOPEN_TOKENS + 1, "target", [1] * 4, 0.010)
    assert gate.outpaced(False) is False and (False, 4, "drafting") not in gate._served
    for _ in range(4):
        gate.leave(False, greedy=False)
    for drafting in [True] * 15 + [False]:  # a burst's first generation shed alone: the other 15 still count
        gate.enter(drafting, greedy=False)
    steps(1, "chain", [2] * 15 + [1], 0.040)
    assert gate._served[False, 16, "drafting"].tokens == 31
    for _ in range(2):
        gate.enter(False, greedy=False)  # 3 of 18: mixed (2 of 17 would not be)
    steps(1, "chain", [2] * 15 + [1] * 3, 0.040)
    assert gate._served[False, 16, "drafting"].tokens == 31 and gate._served[False, 32, "drafting"].tokens == 0


def test_alone_an_explorer_measures_drafting_afresh():
    """A server's first drafting generations are its slowest (the draft's first calls): alone on the server,
    the first start that would shed drafts instead and the rate is measured again from its rounds only, not
    averaged with the cold ones (which had shed a bench's warm EAGLE-3 case for 55% of its rounds); one
    start in EXPLORE_EVERY that would shed after it does the same."""
    from tandem.gates import AcceptanceGate

    clock = types.SimpleNamespace(now=0.0)
    gate = AcceptanceGate(0.3, clock=lambda: clock.now)
    n = AcceptanceGate.SERVED_TOKENS

    def alone(drafting: bool, tokens: int, seconds: float) -> None:
        """One generation alone: n rounds of `seconds`, committing `tokens` each."""
        gate.enter(drafting, greedy=True)
        for _ in range(n):
            clock.now += seconds
            gate.record_round(True, "chain" if drafting else "target", tokens, 3 if drafting else 0, seconds)
        gate.leave(drafting, greedy=True)

    for _ in range(4):
        alone(True, 1, 0.020)  # cold: 50 tokens/s
    for _ in range(4):
        alone(False, 1, 0.010)  # target-only: 100 tokens/s
    assert gate.outpaced(True) is True
    assert gate.outpaced(True, starting=True) is None  # the first that would shed explores ...
    assert (True, 1, "drafting") not in gate._served  # ... and the cold generations are forgotten
    assert gate.outpaced(True, starting=True) is False  # nothing to compare with until it has run
    alone(True, 3, 0.020)  # warm: 150 tokens/s
    assert gate.outpaced(True, starting=True) is False
    for _ in range(8):
        alone(True, 1, 0.020)  # the head stops paying: 50 tokens/s
    starts = [gate.outpaced(True, starting=True) for _ in range(AcceptanceGate.EXPLORE_EVERY)]
    assert starts == [True] * (AcceptanceGate.EXPLORE_EVERY - 1) + [None]


def test_a_generations_first_drafting_round_is_not_timed():
    """The first drafting round takes the prompt's features into the draft (its prefill; target-only rounds
    are timed without the target's): a server's first one took 484 ms where its K=5 rounds took 10."""
    from tandem.gates import AcceptanceGate
    from tandem.policy import KPolicy, Speculation

    gate = AcceptanceGate(0.3)
    request = GenerationRequest(prompt_ids=[1, 2], max_new_tokens=64, num_draft_tokens=3)
    policy = KPolicy(request, Speculation(gate=gate), limit=64, has_draft=True)
    assert policy.k_for_round(0, 0, True) == 3
    policy.record(3, 3, 0.5)
    assert (True, 1, "chain", 3) not in gate._rates and gate._tried[True][1] == 1  # counted, not timed
    assert policy.k_for_round(4, 1, True) == 3
    policy.record(3, 2, 0.010)
    assert gate._rates[True, 1, "chain", 3].rounds == 1 and gate._rates[True, 1, "chain", 3].seconds == 0.010


def test_under_load_target_only_is_the_server_rates_choice_once_measured():
    """A head that is never accepted sheds at any load by the counts; under load, once the server has run
    target-only there, drafting ends only by the server's rates (round rates under load mislead)."""
    from tandem.gates import AcceptanceGate

    clock = types.SimpleNamespace(now=0.0)
    gate = AcceptanceGate(0.3, clock=lambda: clock.now)
    for _ in range(4 * AcceptanceGate.MIN_ROUNDS):
        gate.record(False, 3, 0)
    for _ in range(4):
        gate.enter(True, greedy=False)
    assert gate.best_k(False, 3) == 0  # load 4, never run target-only there: the counts decide
    for _ in range(4):
        gate.leave(True, greedy=False)
        gate.enter(False, greedy=False)
    for _ in range(AcceptanceGate.SERVED_TOKENS):
        clock.now += 0.010
        for _ in range(4):
            gate.record_round(False, "target", 1, 0, 0.010)
    assert gate.best_k(False, 3) > 0 and not gate.outpaced(False)  # the drafting rate is still to measure


def _time_target_only(gate, greedy: bool) -> None:
    """One generation alone, target-only rounds of 10 ms until the gate has timed them."""
    gate.enter(False, greedy=greedy)
    for _ in range(gate.RATE_ROUNDS):
        gate.record_round(greedy, "target", 1, 0, 0.010)
    gate.leave(False, greedy=greedy)


def test_the_gate_costs_each_k_as_measured():
    """A drafting round pays a fixed share besides its drafts: K=1 measured at 1.8 target-only rounds does not
    make K=3 cost 1 + 3 x 0.8 (that shed chains running 1.08x target-only at temperature 1)."""
    from tandem.gates import AcceptanceGate

    gate = AcceptanceGate(0.3)
    _time_target_only(gate, greedy=False)
    gate.enter(True, greedy=False)
    for accepted, times in ((0, 30), (1, 32), (2, 9), (3, 29)):  # p = 0.70, 0.54, 0.76
        for _ in range(times):
            gate.record(False, 3, accepted)
    for _ in range(AcceptanceGate.K_ROUNDS):
        gate.record_round(False, "chain", 2, 1, 0.018)
    assert gate.round_costs(False, 3) == pytest.approx([1, 1.8, 2.1, 2.4])  # past K=1: the prior per draft
    for _ in range(AcceptanceGate.K_ROUNDS):
        gate.record_round(False, "chain", 3, 3, 0.022)
    assert gate.round_costs(False, 3) == pytest.approx([1, 1.8, 2.0, 2.2])
    assert gate.best_k(False, 3) == 3  # 2.37 tokens for 2.2 rounds (K=1: 1.7 for 1.8)


def test_without_target_only_rounds_the_gate_prices_the_ks_it_timed_against_each_other():
    """A server whose requests all draft never times a target-only round. Its K=2 rounds timed at 20 ms and
    its K=5 rounds at 21 (a P-EAGLE head: one forward whatever K) make K=5 cost 1.6 x 21/20 = 1.68 rounds,
    not the prior's 2.5, so drafts accepted as 0.74, 0.45, 0.33, 0.25, 0.22 of rounds keep K=5 (2.99 tokens
    for 1.68 against K=2's 2.19 for 1.6), where the prior alone cut it to K=2 (1.37 against 1.20). Nothing
    timed, the request's K=5 runs first (cut by the prior it would never be timed); beside a generation
    that does not draft (its rounds would not be timed) or while the target compiles, the prior decides."""
    from tandem.gates import AcceptanceGate

    gate = AcceptanceGate(0.3)
    gate.enter(True, greedy=True)
    reach = [1.0, 0.74, 0.45, 0.33, 0.25, 0.22]
    for accepted in range(6):  # of 1000 rounds of K=5, how many accepted exactly `accepted` drafts
        for _ in range(round(1000 * (reach[accepted] - (reach[accepted + 1] if accepted < 5 else 0)))):
            gate.record(True, 5, accepted)
    assert gate.best_k(True, 5) == 5  # nothing timed: K=5 runs to be timed
    gate.enter(False, greedy=True)
    assert gate.best_k(True, 5) == 2  # a target-only generation beside it: no round is timed, the prior
    gate.leave(False, greedy=True)
    gate.record_round(True, "target", 1, 0, 0.01, warming=True)
    assert gate.best_k(True, 5) == 2  # the target compiles: no round is timed
    for _ in range(AcceptanceGate.K_ROUNDS):
        gate.record_round(True, "chain", 3, 5, 0.021)
    assert gate.round_costs(True, 5)[5] == pytest.approx(2.5) and gate.best_k(True, 5) == 2  # one K: the prior
    for _ in range(AcceptanceGate.K_ROUNDS):
        gate.record_round(True, "chain", 2, 2, 0.020)
    assert gate.round_costs(True, 5)[2] == pytest.approx(1.6) and gate.round_costs(True, 5)[5] == pytest.approx(1.68)
    assert gate.best_k(True, 5) == 5
    gate.leave(True, greedy=True)
    _time_target_only(gate, greedy=True)  # once target-only is timed (10 ms), it prices every K
    assert gate.round_costs(True, 5)[2::3] == pytest.approx([2.0, 2.1])


def test_the_gate_prices_drafting_rounds_against_a_target_only_token_not_a_round_of_many():
    """A target-only round decodes up to DECODE_STEPS tokens on the target before answering: 16 tokens in
    60 ms is 3.75 ms a token, and a K=5 round of 13 ms costs 3.47 of them. Taken per round it cost 0.22, drafting
    looked nearly free, and the gate kept a head drafting that ran below target-only (through the services, a
    P-EAGLE head at 0.95x)."""
    from tandem.gates import AcceptanceGate

    gate = AcceptanceGate(0.3)
    gate.enter(False, greedy=True)
    for _ in range(AcceptanceGate.RATE_ROUNDS):
        gate.record_round(True, "target", 16, 0, 0.060)
    gate.leave(False, greedy=True)
    for _ in range(40):
        gate.record(True, 5, 1)  # the first draft accepted, never the second: 2 tokens a round
    gate.enter(True, greedy=True)
    for _ in range(AcceptanceGate.K_ROUNDS):
        gate.record_round(True, "chain", 2, 5, 0.013)
    assert gate.round_costs(True, 5)[5] == pytest.approx(0.013 / 0.00375)
    assert gate.best_k(True, 5) == 0  # 2 tokens for 3.47 target-only tokens' time
    gate.leave(True, greedy=True)


def test_a_drafting_generation_alone_times_target_only_rounds_and_sheds_a_head_that_loses():
    """Where every request drafts no target-only round is timed, and by the prior a K=5 round costs 2.5 of
    them (its K=2, which costs about what its K=5 does, anchored there): a P-EAGLE head's 2.88 tokens a round
    looked like a win where its rounds took 12.9 ms against 4.1 a
    target-only token (0.90x). Alone, a drafting generation runs one round in TIMING_EVERY target-only (the
    draft kept: not a shed) until TIMING_ROUNDS of them are timed; a target-only round of 16 tokens is priced
    per token, K=5 then costs 3.15 and the head sheds. Not beside another generation (its round would wait on
    the other's verify) and not while the target compiles."""
    from tandem.gates import AcceptanceGate
    from tandem.policy import KPolicy, Speculation

    gate = AcceptanceGate(0.3)
    reach = [1.0, 0.73, 0.45, 0.32, 0.22, 0.16]
    for accepted in range(6):  # of 1000 rounds of K=5, how many accepted exactly `accepted` drafts
        for _ in range(round(1000 * (reach[accepted] - (reach[accepted + 1] if accepted < 5 else 0)))):
            gate.record(True, 5, accepted)
    request = GenerationRequest(prompt_ids=[1, 2], max_new_tokens=4096, num_draft_tokens=5)
    policy = KPolicy(request, Speculation(gate=gate), limit=4096, has_draft=True)

    def drafting_rounds():  # K=2 and K=5 cost alike (one forward): K=5 for 1.72 rounds, K=2 at the prior's 1.6
        for k, seconds in ((2, 0.0120), (5, 0.0129)):
            for _ in range(AcceptanceGate.K_ROUNDS):
                gate.record_round(True, "chain", 3, k, seconds)

    drafting_rounds()
    assert gate.best_k(True, 5) == 5  # 2.88 tokens for 1.72 rounds, as priced
    ks, timing = [], []
    for _ in range(2 * AcceptanceGate.TIMING_EVERY):
        ks.append(policy.k_for_round(0, 10, True))
        timing.append(policy.timing)
    assert ks.count(0) == 2 and timing == [k == 0 for k in ks] and not policy.shed and policy.drafting
    gate.enter(False, greedy=True)
    assert not any(gate.times_target(True) for _ in range(2 * AcceptanceGate.TIMING_EVERY))  # beside another
    gate.leave(False, greedy=True)
    gate.record_round(True, "chain", 3, 5, 0.0129, warming=True)
    assert not any(gate.times_target(True) for _ in range(2 * AcceptanceGate.TIMING_EVERY))  # compiling
    gate.record_round(True, "chain", 3, 5, 0.0129)  # compiled: the speeds are timed again
    drafting_rounds()
    for _ in range(AcceptanceGate.TIMING_ROUNDS - 1):
        policy.record(0, 15, 16 * 0.0041)  # its target-only rounds of 16 tokens, timed though it drafts
    assert gate.round_costs(True, 5)[5] == pytest.approx(12.9 / 7.5) and gate.best_k(True, 5) == 5  # one short
    policy.record(0, 15, 16 * 0.0041)
    assert gate.round_costs(True, 5)[5] == pytest.approx(12.9 / 4.1)
    assert not gate.times_target(True) and gate.best_k(True, 5) == 0
    assert policy.k_for_round(0, 10, True) == 0 and policy.shed and not policy.timing
    policy.close()


def test_the_gate_times_drafting_again_once_target_only_has_run_long_since():
    """A slow stretch that made K=3 look too dear (its rounds timed at 4.5 target-only rounds, so the counts
    shut it: K=0) is not kept for good: after REOPEN_ROUNDS target-only rounds timed at that load since, the
    drafting round's time is forgotten, the prior stands in, drafting runs again and times itself afresh; the
    next time after twice as many (where drafting does lose, re-timing it costs less and less)."""
    from tandem.gates import AcceptanceGate

    gate = AcceptanceGate(0.3)
    _time_target_only(gate, greedy=True)
    for _ in range(40):
        gate.record(True, 3, 2)  # two of three drafts accepted: 3 tokens a round with K=2 or 3
    gate.enter(True, greedy=True)
    for _ in range(AcceptanceGate.K_ROUNDS):
        gate.record_round(True, "chain", 3, 3, 0.045)  # a slow stretch
    gate.leave(True, greedy=True)
    assert gate.round_costs(True, 3)[3] == pytest.approx(4.5) and gate.best_k(True, 3) == 0
    gate.enter(False, greedy=True)
    for _ in range(AcceptanceGate.REOPEN_ROUNDS):
        gate.record_round(True, "target", 1, 0, 0.010)
    assert gate.best_k(True, 3) == 0  # not yet
    gate.record_round(True, "target", 1, 0, 0.010)
    gate.leave(False, greedy=True)
    assert gate.round_costs(True, 3) == pytest.approx([1, 1.3, 1.6, 1.9]) and gate.best_k(True, 3) == 2
    gate.enter(True, greedy=True)
    for _ in range(AcceptanceGate.K_ROUNDS):
        gate.record_round(True, "chain", 3, 3, 0.025)  # timed again: 2.5 rounds for 3 tokens
    assert gate.round_costs(True, 3)[3] == pytest.approx(2.5) and gate.best_k(True, 3) == 2  # 3 tokens in 2.2
    gate.leave(True, greedy=True)
    gate.enter(False, greedy=True)
    for _ in range(2 * AcceptanceGate.REOPEN_ROUNDS):  # the second time, twice as long
        gate.record_round(True, "target", 1, 0, 0.010)
    assert gate.round_costs(True, 3)[3] == pytest.approx(2.5)
    gate.record_round(True, "target", 1, 0, 0.010)
    assert gate.round_costs(True, 3)[3] == pytest.approx(1.9)


def test_the_gate_forgets_its_speeds_when_the_target_compiles_and_keeps_its_counts():
    """A target that compiled its buckets (they ran eagerly while the gate timed them) is another server: rounds
    while it compiles (VerifyResult.warming) are not timed, and after them round times and server rates are
    measured again, from the prior; what the head accepts stays counted."""
    from tandem.gates import AcceptanceGate, TreeGate

    gate = AcceptanceGate(0.3)
    _time_target_only(gate, greedy=True)
    gate.enter(True, greedy=True)
    for _ in range(40):
        gate.record(True, 2, 2)
    for _ in range(AcceptanceGate.K_ROUNDS):
        gate.record_round(True, "chain", 3, 2, 0.080)  # the bucket of 3 tokens ran eagerly before its compile
    assert gate.round_costs(True, 2) == pytest.approx([1, 7.7, 8])  # K=1: 8 less the prior's 0.3
    for _ in range(AcceptanceGate.K_ROUNDS):
        gate.record_round(True, "chain", 3, 2, 0.500, timed=False, warming=True)  # while it compiled: not timed
    assert gate.round_costs(True, 2) == pytest.approx([1, 7.7, 8])
    gate.record_round(True, "chain", 3, 2, 0.012)  # compiled: the speeds before are forgotten
    assert gate.round_costs(True, 2) == pytest.approx([1, 1.3, 1.6])
    assert list(gate._served) == [(True, 1, "drafting")] and gate._served[True, 1, "drafting"].tokens == 3
    assert gate.best_k(True, 2) == 2  # the counts stayed: 3 tokens for 1.6 rounds
    trees = TreeGate()
    for _ in range(TreeGate.MIN_ROUNDS):
        trees.record(True, True, 4, 0.01, before=(False, 3, 0.01))
    trees.warming(True)
    assert trees.rate(True, True) is not None
    trees.warming(False)
    assert trees.rate(True, True) is None


def test_a_head_that_is_never_accepted_is_shed_and_the_output_stays(generator, hf_target):
    """The tiny pair's random head: once each position has been tried MIN_ROUNDS times the gate stops
    drafting, mid-request, and later requests never open a draft session; every output is still the
    target's own."""
    from tandem.gates import AcceptanceGate
    from tandem.policy import Speculation
    from tandem_tools.inprocess import run_rounds

    gate = AcceptanceGate(0.3)
    # the rounds' prices at the prior, not as timed: on a loaded machine a timed drafting round can cost so little
    # against a timed target-only token that drafts accepted by the prior alone pay, and the counts are the subject
    gate.round_costs = lambda greedy, requested: [1 + gate.cost * k for k in range(requested + 1)]
    prompts = make_prompts(4, generator.target.vocab_size, seed=9)
    stats = []
    for prompt in prompts:
        request = GenerationRequest(prompt_ids=prompt, max_new_tokens=40, num_draft_tokens=3, ignore_eos=True)
        tokens, event = [], None
        for event in run_rounds(generator.target, generator.draft, request, speculation=Speculation(gate=gate)):
            tokens.extend(event.new_tokens)
        assert_same_or_tie(hf_target, prompt, tokens, hf_greedy(hf_target, prompt, len(tokens)))
        stats.append(event.stats)
    assert stats[0].num_draft_tokens == 3 * AcceptanceGate.MIN_ROUNDS and stats[0].num_rounds_load_shed > 0
    # while it drafted alone, one round in TIMING_EVERY ran target-only for the gate (its draft fed, the output
    # the same): 40 tokens, one from the prefill, one a round, and those rounds not counted
    assert stats[0].num_rounds <= 39 - AcceptanceGate.MIN_ROUNDS // AcceptanceGate.TIMING_EVERY
    assert all(s.num_draft_tokens == 0 and s.num_rounds_load_shed == s.num_rounds for s in stats[1:])
    assert generator.draft.num_sessions == 0
    assert gate.load == (0, 0)  # every generation left the gate's count, shed or not
    gate = AcceptanceGate(0.3)
    request = GenerationRequest(prompt_ids=prompts[0], max_new_tokens=24, num_draft_tokens=3)
    rounds = run_rounds(generator.target, generator.draft, request, speculation=Speculation(gate=gate))
    next(rounds)
    assert gate.load == (1, 1)
    rounds.close()  # a client that goes away mid-generation
    assert gate.load == (0, 0)


def test_rounds_that_max_new_tokens_cuts_short_are_not_timed():
    """A generation's last rounds, whose drafts its length cuts short, say how it ends, not what drafting
    does: the gates time full rounds only (a bench's 8-token warm-ups had shed chains that ran 1.6x)."""
    from tandem.gates import AcceptanceGate, TreeGate
    from tandem.params import GenerationRequest, TreeParams
    from tandem.policy import KPolicy, Speculation

    gate = AcceptanceGate(0.3)
    request = GenerationRequest(prompt_ids=[1], max_new_tokens=14, num_draft_tokens=5)
    policy = KPolicy(request, Speculation(gate=gate), limit=14, has_draft=True)
    for produced, k in ((1, 5), (6, 5), (12, 1)):  # the first round (not timed either), a full one, one cut short
        assert policy.k_for_round(produced, 0, True) == k  # at 12, 2 tokens left: one draft and the bonus
        policy.record(k, k - 1, 0.010)
    assert gate._rates[True, 1, "chain", 5].rounds == 1 and (True, 1, "chain", 1) not in gate._rates
    tree = GenerationRequest(prompt_ids=[1], max_new_tokens=14, num_draft_tokens=5,
                             tree=TreeParams(nodes=8, depth=5, top_k=2))
    trees = TreeGate()
    policy = KPolicy(tree, Speculation(trees=trees), limit=14, has_draft=True)
    shapes = []
    for produced in (1, 3, 10):  # the first round, a tree, then a chain cut short: no pair
        k = policy.k_for_round(produced, 0, True)
        shapes.append(policy.tree_for_round(k, produced) is not None)
        policy.record(k, 1, 0.010, tree=shapes[-1])
    assert shapes == [True, True, False] and trees._seen == {}
