"""Continuous batching in both engines: concurrent sessions share forward passes, and no request's
output changes because of it; the KV budget queues and then refuses instead of running out of memory."""

from __future__ import annotations

import threading
import time
import types
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_core import assert_same_or_tie, hf_greedy, make_prompts

from coordinator.cohorts import CohortLink, Cohorts
from tandem.batching import Batcher
from tandem.params import GenerationRequest, SamplingParams
from tandem.sessions import ResourceExhausted, SessionNotFound
from tandem.timing import StepClock
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


def batch_counts(generator: InProcessGenerator) -> tuple[int, int, int, int]:
    t, d = generator.target.batcher, generator.draft.batcher
    return t.batches, t.steps, d.batches, d.steps


def test_concurrent_greedy_sessions_match_target_only(generator, hf_target):
    """Mixed prompt lengths, mixed K (0 = target-only), different lengths so sessions leave the batch
    at different times; every output equals transformers' greedy generate on its own."""
    prompts = make_prompts(12, generator.target.vocab_size, seed=7)
    requests = [
        GenerationRequest(prompt_ids=p, max_new_tokens=8 + 3 * i, num_draft_tokens=[0, 1, 3, 5, 8][i % 5],
                          speculate=i % 5 != 0, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    before = batch_counts(generator)
    outputs = run_concurrently(generator, requests)
    after = batch_counts(generator)
    for request, ours in zip(requests, outputs, strict=True):
        assert len(ours) == request.max_new_tokens
        assert_same_or_tie(hf_target, request.prompt_ids, ours, hf_greedy(hf_target, request.prompt_ids, len(ours)))
    target_batches, target_steps = after[0] - before[0], after[1] - before[1]
    draft_batches, draft_steps = after[2] - before[2], after[3] - before[3]
    # the steps really shared forward passes (how many depends on the machine's load: any is enough)
    assert target_steps > target_batches and draft_steps > draft_batches, (target_steps, target_batches,
                                                                          draft_steps, draft_batches)
    assert generator.target.num_sessions == 0 and generator.draft.num_sessions == 0
    assert generator.target.kv_budget.used == 0


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


def test_the_kv_budget_queues_then_refuses(tiny_dir):
    engine = TargetEngine(tiny_dir / "target", kv_cache_tokens=100, queue_timeout=0.5)
    greedy = SamplingParams()
    with pytest.raises(ResourceExhausted, match="whole KV budget is 100"):
        engine.prefill("huge", [5] * 10, greedy, max_new_tokens=200)
    engine.prefill("a", [5] * 10, greedy, max_new_tokens=40)  # reserves 10 + 40 + 17 = 67: 80 in whole blocks
    started = time.monotonic()
    with pytest.raises(ResourceExhausted, match="budget is taken"):
        engine.prefill("b", [6] * 10, greedy, max_new_tokens=40)
    assert time.monotonic() - started >= 0.5  # it queued first
    # a queued request gets in as soon as a session finishes
    threading.Timer(0.2, engine.release, args=("a",)).start()
    engine.prefill("b", [6] * 10, greedy, max_new_tokens=40)
    assert engine.num_sessions == 1 and engine.kv_budget.used == 80
    engine.verify("b", 7, [8] * 3)
    engine.release("b")
    assert engine.kv_budget.used == 0


def test_a_failing_step_fails_alone():
    def run(items):
        return [ValueError(f"bad {i}") if i < 0 else i * 10 for i in items]

    batcher = Batcher(run, max_batch=8, max_tokens=100)
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(batcher.submit, i, 1) for i in (1, -1, 2, 3, -2, 4)]
    for i, future in zip((1, -1, 2, 3, -2, 4), futures, strict=True):
        if i < 0:
            with pytest.raises(ValueError, match=f"bad {i}"):
                future.result()
        else:
            assert future.result() == i * 10


def held_batches() -> tuple[Callable[[list], list], list[list], threading.Event]:
    """A batch function that records its batches and holds each until the event is set."""
    seen: list[list] = []
    gate = threading.Event()

    def run(items):
        gate.wait(5)
        seen.append(list(items))
        return items

    return run, seen, gate


def test_batches_respect_the_size_and_token_bounds():
    run, seen, gate = held_batches()
    batcher = Batcher(run, max_batch=3, max_tokens=10)
    with ThreadPoolExecutor(8) as pool:
        first = pool.submit(batcher.submit, 0, 1)
        time.sleep(0.1)  # the first runs alone; the rest queue behind it
        rest = [pool.submit(batcher.submit, i, 4) for i in range(1, 8)]
        time.sleep(0.2)
        gate.set()
        assert first.result() == 0 and [f.result() for f in rest] == list(range(1, 8))
    assert seen[0] == [0]
    assert all(len(batch) <= 3 and (len(batch) == 1 or 4 * len(batch) <= 10) for batch in seen[1:])
    assert sorted(i for batch in seen for i in batch) == list(range(8))


def test_steps_of_different_groups_never_share_a_batch():
    """A long prefill is not padded among one-token verifies; the group left behind runs next."""
    run, seen, gate = held_batches()
    batcher = Batcher(run, max_batch=16, max_tokens=1000)
    steps = [("verify", 1), ("prefill", 2), ("verify", 3), ("verify", 4), ("prefill", 5)]
    with ThreadPoolExecutor(8) as pool:
        first = pool.submit(batcher.submit, ("verify", 0), 1, "s0", "verify")
        time.sleep(0.1)  # it runs alone; the rest queue behind it
        rest = [pool.submit(batcher.submit, step, 48 if step[0] == "prefill" else 1, f"s{step[1]}", step[0])
                for step in steps]
        time.sleep(0.2)
        gate.set()
        assert first.result() == ("verify", 0) and [f.result() for f in rest] == steps
    assert seen == [[("verify", 0)], [("verify", 1), ("verify", 3), ("verify", 4)], [("prefill", 2), ("prefill", 5)]]

def test_a_native_targets_prefill_shares_the_batch_of_verifies(tiny_dir):
    """The native forward pads nothing, so a prefill joins the batch of the verifies queued beside it (one
    forward where the widths are compiled: NativeRunner.parts), and gives what it gives alone."""
    engine = TargetEngine(tiny_dir / "target", engine="native")
    greedy = SamplingParams(temperature=0.0)
    alone = engine.prefill("alone", [7, 8, 9, 10], greedy, max_new_tokens=8)
    a, c = (engine.prefill(s, [5, 6], greedy, max_new_tokens=8) for s in ("a", "c"))
    run, seen, gate = held_batches()
    steps = engine.batcher._run
    engine.batcher._run = lambda batch: run([step.kind for step in batch]) and steps(batch)
    with ThreadPoolExecutor(4) as pool:
        held = pool.submit(engine.verify, "a", a.token, [])
        time.sleep(0.1)  # it runs alone; the next two queue behind it
        queued = [pool.submit(engine.verify, "c", c.token, []),
                  pool.submit(engine.prefill, "b", [7, 8, 9, 10], greedy, max_new_tokens=8)]
        time.sleep(0.2)
        gate.set()
        verify, prefill = (f.result() for f in queued)
    assert seen == [["verify"], ["verify", "prefill"]]
    assert prefill.token == alone.token and verify.bonus == held.result().bonus  # c is a's sequence
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
    steps = {s: target._verify_step(s, firsts[s], [3, 4], True, None, None)[0] for s in ("a", "b")}
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
    results = target._run_batch([target._verify_step(s, late[s], [3, 4], True, None, None)[0] for s in ("d", "e")])
    target.runner.forward = forward
    releases[0].join(5)
    assert not releases[0].is_alive() and "d" not in target.sessions
    assert [r.bonus for r in results] == [alone.bonus] * 2
    target.release("e")
    assert len(target.kv_pool._free) == free


def test_a_batch_does_not_wait_for_a_session_that_ended():
    """The runner waits for sessions due back soon, unless the engine said they are released."""
    batcher = Batcher(lambda items: items, max_batch=8, max_tokens=100, max_wait=5.0, window=1000.0)
    batcher.submit("a1", 1, key="a")
    batcher.submit("b1", 1, key="b")
    batcher._last_seconds = 1.0  # a window far longer than the test: only `forget` ends the wait
    threading.Timer(0.3, batcher.forget, args=("a",)).start()
    started = time.monotonic()
    assert batcher.submit("b2", 1, key="b") == "b2"
    assert 0.25 < time.monotonic() - started < 3.0


def test_a_long_batch_lets_the_next_one_run_beside_it():
    """`beside`: a batch the relay marks long (a target-only decode message) does not hold back the steps
    queued after it; a plain batch does."""
    release = threading.Event()
    ran: list[list[str]] = []

    def run(items: list[str]) -> list[str]:
        ran.append(list(items))
        if "long" in items:
            release.wait(5)
        return items

    batcher = Batcher(run, max_batch=8, max_tokens=100, max_wait=0.0, beside=lambda items: "long" in items)
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(batcher.submit, "long", 1, "a")
        while not ran:
            time.sleep(0.001)
        assert batcher.submit("short", 1, key="b") == "short"  # ran while the long one still runs
        assert not long.done()
        release.set()
        assert long.result(5) == "long"
    assert ran == [["long"], ["short"]]


def cohort_step(batcher: Batcher, item, cohort: tuple[int, int] | None):
    """Submit as a service does: the step's clock carries the cohort it came with; returns the result
    and the batch (id, size) that computed it."""
    clock = StepClock()
    clock.cohort = cohort
    with clock.compute():
        result = batcher.submit(item, 1, key=item)
    return result, clock.batch


def test_a_cohort_arriving_in_pieces_runs_as_one_batch():
    """The steps of one earlier batch come back spread out; the runner waits for the rest of them,
    and tells each step the batch that computed it."""
    seen: list[list] = []
    batcher = Batcher(lambda items: seen.append(list(items)) or items, max_batch=8, max_tokens=100, max_wait=2.0)
    with ThreadPoolExecutor(4) as pool:
        futures = []
        for item in ("a", "b", "c"):
            futures.append(pool.submit(cohort_step, batcher, item, (7, 3)))
            time.sleep(0.15)  # far past the due-back window: only the cohort keeps the runner waiting
        results = [f.result() for f in futures]
    assert seen == [["a", "b", "c"]]
    assert [r for r, _ in results] == ["a", "b", "c"]
    (batch_id, size), = {batch for _, batch in results}
    assert size == 3
    # a cohort whose last step never comes is waited for max_wait, no longer
    batcher.max_wait = 0.2
    started = time.monotonic()
    assert cohort_step(batcher, "d", (8, 2))[0] == "d"
    assert 0.15 < time.monotonic() - started < 2.0
    assert cohort_step(batcher, "e", None)[1][0] != batch_id  # every batch has its own id


def test_the_coordinator_counts_who_goes_on_to_the_draft():
    """Members of a target batch that go on wait for the others to decide and all get the same count;
    one that finished does not hold them up; a member that decides after the wait goes alone."""
    cohorts = Cohorts(wait=5.0)
    links = [CohortLink(cohorts) for _ in range(4)]
    for link in links:
        link.from_target(41, 4)
    with ThreadPoolExecutor(4) as pool:
        going = [pool.submit(link.to_draft) for link in links[:2]]
        time.sleep(0.1)
        assert not any(f.done() for f in going)  # two members have not said yet
        links[2].leave()  # finished: its target session is released
        links[3].to_target()
        links[3].leave()  # a target-only round
        hints = {f.result(timeout=2) for f in going}
    assert len(hints) == 1 and next(iter(hints))[1] == 2
    cohorts.wait = 0.1
    late = [CohortLink(cohorts) for _ in range(3)]
    for link in late:
        link.from_target(42, 3)
    started = time.monotonic()
    assert late[0].to_draft()[1] == 1  # the others never said: the count is final after the wait
    assert time.monotonic() - started < 2.0
    assert late[1].to_draft() is None  # too late to join: it goes without a cohort
    solo = CohortLink(cohorts)
    solo.from_target(43, 1)
    assert solo.to_draft() is None  # a batch of one is no cohort
    solo.from_draft(9, 5)
    assert solo.to_target() == (9, 5) and solo.to_target() is None  # a draft batch goes on as it is


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
    from tandem.rounds import run_rounds

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


def test_a_service_with_a_full_kv_budget_answers_resource_exhausted(tiny_dir, tmp_path):
    """Through the three processes: one long generation holds most of the target's KV budget; the next
    queues for --queue-timeout, then gets RESOURCE_EXHAUSTED naming the budget; the first carries on,
    and once it is gone the budget is free again."""
    from processes import start_stack, stop_stack

    from coordinator.client import TandemClient, TandemError

    engine = TargetEngine(tiny_dir / "target")
    gib = 1100 * engine.kv_bytes_per_token / (1 << 30)  # 1100 tokens: one generation of 5 + 1000 (+17)
    procs = start_stack(tiny_dir, tmp_path, target_args=["--kv-cache-gib", f"{gib:.12f}", "--queue-timeout", "0.5"])
    try:
        with TandemClient(procs["coordinator"].address, timeout=120) as client:
            stream = client.generate_stream(prompt_ids=[5, 6, 7, 8, 9], max_new_tokens=1000, ignore_eos=True)
            next(stream)  # it holds 1022 of the 1100 tokens
            with pytest.raises(TandemError) as refused:
                client.generate(prompt_ids=[5, 6, 7, 8, 9], max_new_tokens=100)
            assert refused.value.code.name == "RESOURCE_EXHAUSTED" and "KV budget" in refused.value.details
            assert next(stream).token_ids  # the first one is untouched
            stream.close()  # its sessions (and their reservation) are released
            deadline = time.monotonic() + 10
            while True:
                try:
                    out = client.generate(prompt_ids=[5, 6, 7, 8, 9], max_new_tokens=100, ignore_eos=True)
                    break
                except TandemError:
                    assert time.monotonic() < deadline, "the budget was not freed"
            assert len(out.token_ids) == 100
    finally:
        stop_stack(procs)


def test_a_generation_that_starts_under_full_load_never_opens_a_draft_session(generator):
    from helpers import RecordingDraft

    from tandem.policy import Speculation
    from tandem.rounds import run_rounds

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
    from tandem.rounds import run_rounds

    gate = AcceptanceGate(0.3)
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


def test_the_read_ahead_hands_over_in_order_raises_after_and_stops_when_asked():
    """coordinator.generation.ReadAhead: the deltas of a request made in a thread of their own come in order,
    an error of the rounds is raised after what came before it, and a reader that is done stops the thread
    whether it is making the next item or waiting for room."""
    import threading
    import time

    from coordinator.generation import ReadAhead

    assert list(ReadAhead(iter(range(50)), depth=2)) == list(range(50))

    def failing():
        yield from (1, 2)
        raise ValueError("the target refused")

    got = iter(ReadAhead(failing()))
    assert [next(got), next(got)] == [1, 2]
    with pytest.raises(ValueError, match="refused"):
        next(got)

    release = threading.Event()

    def slow():
        yield 1
        release.wait(5)  # a round waiting on a service
        yield 2

    ahead = ReadAhead(slow())
    assert next(iter(ahead)) == 1
    assert not ahead.stop(0.1) and ahead.running  # still in its round: the caller cancels the streams then
    release.set()
    assert ahead.stop(5) and not ahead.running

    endless = ReadAhead(iter(range(10**9)), depth=1)  # the reader went away: the queue stays full
    time.sleep(0.1)
    started = time.monotonic()
    assert endless.stop(5) and time.monotonic() - started < 1
