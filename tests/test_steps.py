"""The scheduler's streams (TargetService.Step, DraftService.Step): a batch of steps each way per message,
over real gRPC to real engines; and the coordinator's link that sends them (coordinator/links.py)."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from coordinator.links import BackendError, ServiceLink
from coordinator.scheduler import pack_draft, pack_target
from draft_server.engine import DraftEngine
from draft_server.service import DraftServicer
from tandem.config import DraftSettings, TargetSettings
from tandem.convert import verified_from_pb
from tandem.params import SamplingParams
from tandem.protocol import Prefill, Propose, Verify
from tandem.service import Service
from tandem.step_socket import StepSocket
from tandem.v1 import draft_pb2_grpc, target_pb2, target_pb2_grpc
from tandem.wire import decode_features, encode_features
from target_server.engine import TargetEngine
from target_server.service import TargetServicer
from tests.test_services import id_prompts

GREEDY = SamplingParams()
OWNER = "tests"  # every link here steps as one coordinator: a test's stream may still be ending at the next's start


@pytest.fixture(scope="module", params=["grpc", "unix"])
def target(tiny_dir, request):
    """The tiny target's servicer on loopback, its steps over gRPC or over its step socket (a coordinator on
    its host); (stub, engine, address, the step socket or None)."""
    service = Service("target", TargetSettings(model=tiny_dir / "target", port=0), ["tandem.v1.TargetService"])
    servicer = TargetServicer(service)
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, service.server)
    service.start()
    engine = TargetEngine(tiny_dir / "target")
    servicer.attach(engine)
    local = StepSocket("target", servicer._serve_local) if request.param == "unix" else None
    service.ready()
    channel = grpc.insecure_channel(service.address)
    yield target_pb2_grpc.TargetServiceStub(channel), engine, service.address, local
    channel.close()
    service.server.stop(None)
    if local is not None:
        local.close()


def target_link(target, owner: str = OWNER, stub=None) -> ServiceLink:
    """The scheduler's link to the fixture's target, over its step socket where it has one."""
    local = target[3].info() if target[3] is not None else None
    link = ServiceLink("target", (stub or target[0]).Step, pack_target, owner=owner, local=local,
                       answer_type=target_pb2.TargetBatchResult)
    assert link.transport == ("unix" if local is not None else "grpc")
    return link


def step(link: ServiceLink, steps, releases=()) -> list:
    link.send(steps, releases)
    return link.receive()


def decode(link: ServiceLink, sid: str, prompt: list[int], n: int, per_step: int, stop_ids=(), features=False):
    """A prefill, then target-only verifies of `per_step` tokens each (Verify.decode) until n tokens; with
    `features`, (the tokens, the features of every token the verifies read [n - 1, 3H])."""
    (prefilled,) = step(link, [Prefill(sid, prompt, GREEDY, False, max_new_tokens=n + 1)])
    out, rows = [prefilled.prefilled.token], []
    while len(out) < n and out[-1] not in stop_ids:
        k = min(per_step, n - len(out))
        (answer,) = step(link, [Verify(sid, out[-1], [], features, decode=k, stop_ids=stop_ids if k > 1 else ())])
        result = verified_from_pb(answer)
        assert (result.features is None) is not features
        if features:
            rows.append(decode_features([result.features]))
            assert rows[-1].shape[0] == 1 + len(result.accepted)
        out += [*result.accepted, result.bonus]
    step(link, [], [sid])
    return (out, torch.cat(rows)) if features else out


def test_a_batch_of_verifies_gives_what_each_gives_alone(target):
    _, engine, _, _ = target
    link = target_link(target)
    prompts = id_prompts(6, engine.vocab_size, seed=3)

    def run(sids: list[str]) -> list[list]:
        answers = step(link, [Prefill(s, p, GREEDY, True) for s, p in zip(sids, prompts, strict=True)])
        tokens = [a.prefilled.token for a in answers]
        out: list[list] = [[] for _ in sids]
        for i in range(4):
            verifies = [Verify(s, t, [t, (t + i) % 50, 3], True) for s, t in zip(sids, tokens, strict=True)]
            for j, answer in enumerate(step(link, verifies)):
                result = verified_from_pb(answer)
                assert result.features.num_rows == len(result.accepted) + 1  # features of t, d_1..d_a, inline
                out[j].append((result.accepted, result.bonus))
                tokens[j] = result.bonus
        step(link, [], sids)
        return out

    together = run([f"b{i}" for i in range(len(prompts))])
    alone = []
    for i, prompt in enumerate(prompts):
        answers = step(link, [Prefill(f"a{i}", prompt, GREEDY, True)])
        t, mine = answers[0].prefilled.token, []
        for r in range(4):
            result = verified_from_pb(step(link, [Verify(f"a{i}", t, [t, (t + r) % 50, 3], True)])[0])
            mine.append((result.accepted, result.bonus))
            t = result.bonus
        step(link, [], [f"a{i}"])
        alone.append(mine)
    assert together == alone
    assert engine.num_sessions == 0
    link.close()


def test_a_bad_step_fails_alone_and_the_others_go_on(target):
    _, engine, _, _ = target
    link = target_link(target)
    (good,) = step(link, [Prefill("good", [5, 6, 7, 8], GREEDY, False)])
    t = good.prefilled.token
    answers = step(link, [Verify("good", t, [t], False), Verify("nobody", t, [t], False),
                          Verify("good", t, [t], False), Prefill("bad", [engine.vocab_size + 5], GREEDY, False),
                          Prefill("empty", [], GREEDY, False)])
    assert not isinstance(answers[0], BackendError) and answers[0].verified.bonus >= 0
    codes = [a.code for a in answers[1:]]
    assert codes == [grpc.StatusCode.NOT_FOUND] + [grpc.StatusCode.INVALID_ARGUMENT] * 3
    assert "two steps of session 'good' in one batch" in answers[2].details
    assert "outside the vocabulary" in answers[3].details and "empty" in answers[4].details
    assert not isinstance(step(link, [Verify("good", answers[0].verified.bonus, [], False)])[0], BackendError)
    step(link, [], ["good"])
    assert engine.num_sessions == 0
    link.close()


def test_the_streams_end_frees_its_sessions_and_a_second_coordinator_is_refused(target):
    _, engine, address, _ = target
    link = target_link(target)
    step(link, [Prefill("kept", [5, 6, 7], GREEDY, False), Prefill("kept2", [8, 9], GREEDY, False)])
    assert engine.num_sessions == 2
    with grpc.insecure_channel(address) as other:  # another connection: another coordinator
        intruder = target_link(target, "other", target_pb2_grpc.TargetServiceStub(other))
        (refused,) = step(intruder, [Prefill("x", [5], GREEDY, False)])
        assert refused.code == grpc.StatusCode.FAILED_PRECONDITION and "another coordinator" in refused.details
    link.close()
    deadline = time.monotonic() + 10
    while engine.num_sessions and time.monotonic() < deadline:  # the service sees the stream end
        time.sleep(0.05)
    assert engine.num_sessions == 0


def test_a_target_only_decode_of_many_tokens_gives_what_single_tokens_give(target):
    _, engine, _, _ = target
    link = target_link(target)
    prompts = id_prompts(4, engine.vocab_size, seed=5)
    single = [decode(link, f"one{i}", p, 12, 1) for i, p in enumerate(prompts)]
    assert [decode(link, f"many{i}", p, 12, 5) for i, p in enumerate(prompts)] == single
    stop = single[0][4]  # a decode ends after a stop id: the first one it makes
    assert decode(link, "stop", prompts[0], 12, 8, stop_ids=[stop]) == single[0][: single[0].index(stop) + 1]
    # with features, those of every token a decode read, as single-token verifies give them (a draft is fed)
    tokens, rows = decode(link, "rows", prompts[1], 12, 5, features=True)
    one_tokens, one_rows = decode(link, "rows1", prompts[1], 12, 1, features=True)
    assert tokens == one_tokens == single[1]
    torch.testing.assert_close(rows, one_rows)
    # the decodes of several sessions in one step: each its own tokens
    answers = step(link, [Prefill(f"m{i}", p, GREEDY, False, max_new_tokens=13) for i, p in enumerate(prompts)])
    firsts = [a.prefilled.token for a in answers]
    results = step(link, [Verify(f"m{i}", t, [], False, decode=11) for i, t in enumerate(firsts)])
    assert [[t, *verified_from_pb(r).accepted, verified_from_pb(r).bonus] for t, r in zip(firsts, results, strict=True)] \
        == single
    step(link, [], [f"m{i}" for i in range(len(prompts))])
    assert engine.num_sessions == 0
    link.close()


def test_a_decode_with_drafts_or_too_many_tokens_is_refused_naming_why(target):
    link = target_link(target)
    (prefilled,) = step(link, [Prefill("bad-decode", [5, 6, 7], GREEDY, False, max_new_tokens=8)])
    t = prefilled.prefilled.token
    for kwargs, words in (({"drafts": [5]}, "takes no drafts"), ({"decode": 65}, "at most 64"),
                          ({"decode": 30}, "past the")):
        call = {"drafts": [], "want_features": False, "decode": 4, **kwargs}
        (refused,) = step(link, [Verify("bad-decode", t, call["drafts"], call["want_features"], decode=call["decode"])])
        assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and words in refused.details
    (ok,) = step(link, [Verify("bad-decode", t, [], False, decode=4)])
    assert len(ok.verified.accepted) == 3
    step(link, [], ["bad-decode"])
    link.close()


def test_proposes_share_a_batch_and_a_bad_one_fails_alone(tiny_dir):
    service = Service("draft", DraftSettings(model=tiny_dir / "draft", target=tiny_dir / "target", port=0),
                      ["tandem.v1.DraftService"])
    servicer = DraftServicer(service)
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, service.server)
    service.start()
    engine = DraftEngine(tiny_dir / "draft", tiny_dir / "target")
    servicer.attach(engine)
    service.ready()
    width = engine.feature_size

    def features(n: int):
        return encode_features(torch.randn(n, width))[0]

    try:
        with grpc.insecure_channel(service.address) as channel:
            link = ServiceLink("draft", draft_pb2_grpc.DraftServiceStub(channel).Step, pack_draft, step_timeout=30)
            opened = step(link, [Propose(s, features(3), [3, 4, 5], 2, open=True) for s in ("a", "b")])
            assert [len(a.drafts) for a in opened] == [2, 2]
            answers = step(link, [Propose("a", features(2), [6, 7], 3), Propose("b", features(2), [6, 7], 4),
                                  Propose("nobody", features(2), [6, 7], 3), Propose("a", features(2), [6, 7], 3),
                                  Propose("b", features(1), [6, 7], 3)])
            assert [len(a.drafts) for a in answers[:2]] == [3, 4]
            assert [a.code for a in answers[2:]] == [grpc.StatusCode.NOT_FOUND] + [grpc.StatusCode.INVALID_ARGUMENT] * 2
            assert "do not fit a step of 2 tokens" in answers[4].details
            step(link, [], ["a", "b"])
            assert engine.num_sessions == 0
            link.close()
    finally:
        service.server.stop(None)


def test_the_scheduler_never_waits_while_a_request_is_there(target, tiny_dir):
    """Greedy requests through a Scheduler over real streams: their tokens are the target's alone, and the
    step loop sleeps only while it holds no request at all (a step runs what is ready: no timed wait for a
    request that is not coming, as the batchers' due-back windows did)."""
    from coordinator.scheduler import Scheduler
    from tandem.params import GenerationRequest
    from tandem.policy import Speculation
    from tandem_tools.inprocess import InProcessGenerator

    _, engine, _, _ = target
    service = Service("draft", DraftSettings(model=tiny_dir / "draft", target=tiny_dir / "target", port=0),
                      ["tandem.v1.DraftService"])
    servicer = DraftServicer(service)
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, service.server)
    service.start()
    servicer.attach(DraftEngine(tiny_dir / "draft", tiny_dir / "target"))
    service.ready()
    channel = grpc.insecure_channel(service.address)
    scheduler = Scheduler(target_link(target),
                          ServiceLink("draft", draft_pb2_grpc.DraftServiceStub(channel).Step, pack_draft, 30),
                          engine.eos_token_ids, engine.max_context, Speculation(), max_running=8, max_waiting=8)
    waits: list[tuple[int, int]] = []
    wait = scheduler._changed.wait

    def recorded(timeout=None):
        waits.append((len(scheduler._running), len(scheduler._waiting), timeout))
        return wait(timeout)

    scheduler._changed.wait = recorded
    try:
        prompts = id_prompts(5, engine.vocab_size, seed=11)
        requests = [GenerationRequest(prompt_ids=p, max_new_tokens=12 + 3 * i, num_draft_tokens=1 + i % 4,
                                      ignore_eos=True) for i, p in enumerate(prompts)]
        handles = [scheduler.submit(r) for r in requests]
        got = [[t for event in h.events() for t in event.new_tokens] for h in handles]
        reference = InProcessGenerator(tiny_dir / "target", None)
        assert got == [reference.generate(r.model_copy(update={"speculate": False})).token_ids for r in requests]
        assert scheduler.steps > 0 and all(w == (0, 0, None) for w in waits), waits
    finally:
        scheduler.close()
        channel.close()
        service.server.stop(None)
    deadline = time.monotonic() + 10
    while engine.num_sessions and time.monotonic() < deadline:  # the last releases, or the streams' end
        time.sleep(0.05)
    assert engine.num_sessions == 0


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(presence_penalty=0.8, frequency_penalty=0.6)],
                         ids=["plain", "penalised"])
def test_a_request_the_kv_budget_cannot_grow_preempts_the_newest_which_resumes_where_it_was(tiny_dir, sampling):
    """Three greedy generations whose KV together outgrows the target's budget: each holds the KV it has
    used, and when a verify cannot grow its share the newest is preempted (its sessions released), waits at
    the front of the queue, and recomputes its prompt and tokens once another has finished. Every client
    reads one stream: the target's own tokens, none lost or repeated. Penalised: the recomputed tokens still
    count as generated, so presence and frequency penalties see them as an unpreempted run does."""
    from coordinator.scheduler import Scheduler
    from tandem.params import GenerationRequest
    from tandem.policy import Speculation
    from tandem_tools.inprocess import InProcessGenerator

    services, channels = [], []

    def served(kind: str, engine):
        settings = (TargetSettings(model=tiny_dir / "target", port=0) if kind == "target" else
                    DraftSettings(model=tiny_dir / "draft", target=tiny_dir / "target", port=0))
        service = Service(kind, settings, [f"tandem.v1.{kind.title()}Service"])
        servicer = TargetServicer(service) if kind == "target" else DraftServicer(service)
        add = (target_pb2_grpc.add_TargetServiceServicer_to_server if kind == "target"
               else draft_pb2_grpc.add_DraftServiceServicer_to_server)
        add(servicer, service.server)
        service.start()
        servicer.attach(engine)
        service.ready()
        services.append(service)
        channels.append(grpc.insecure_channel(service.address))
        stub = (target_pb2_grpc.TargetServiceStub if kind == "target" else draft_pb2_grpc.DraftServiceStub)
        return stub(channels[-1])

    engine = TargetEngine(tiny_dir / "target", kv_cache_tokens=320)  # two of the three, grown, fit
    target = served("target", engine)
    draft = served("draft", DraftEngine(tiny_dir / "draft", tiny_dir / "target"))
    scheduler = Scheduler(ServiceLink("target", target.Step, pack_target, owner=OWNER),
                          ServiceLink("draft", draft.Step, pack_draft, 30), engine.eos_token_ids,
                          engine.max_context, Speculation(), max_running=8, max_waiting=8)
    try:
        prompts = id_prompts(3, engine.vocab_size, seed=5)
        requests = [GenerationRequest(prompt_ids=p[:6], max_new_tokens=110, num_draft_tokens=3, ignore_eos=True,
                                      sampling=sampling) for p in prompts]
        handles = [scheduler.submit(r) for r in requests]
        got = [[t for event in h.events() for t in event.new_tokens] for h in handles]
        reference = InProcessGenerator(tiny_dir / "target", None)
        assert got == [reference.generate(r.model_copy(update={"speculate": False})).token_ids for r in requests]
        assert scheduler.preempted >= 1
    finally:
        scheduler.close()
        for channel in channels:
            channel.close()
        for service in services:
            service.server.stop(None)
    deadline = time.monotonic() + 10
    while engine.num_sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.num_sessions == 0 and engine.kv_budget.used == 0


def test_a_request_without_max_new_tokens_is_fitted_to_the_kv_budget(tiny_dir):
    """Unset max_new_tokens (a chat request without max_tokens) shrinks to what one session can grow to in
    the target's KV budget, as to the context, and the target takes it; one given is left as given (the
    target refuses it, naming the budget)."""
    from types import SimpleNamespace

    from coordinator.generation import ClientRequest, fit_to_pair
    from tandem.params import GenerationRequest
    from tandem.sessions import ResourceExhausted
    from tandem.v1 import target_pb2

    engine = TargetEngine(tiny_dir / "target", kv_cache_tokens=1000)
    info = target_pb2.TargetInfo(vocab_size=engine.vocab_size, max_context=4096, kv_cache_tokens=1000)
    pair = SimpleNamespace(target_info=info, tokenizer=None)
    prompt = [5] * 10
    unset = ClientRequest(GenerationRequest(prompt_ids=prompt, max_new_tokens=4096 - 10), max_new_tokens_given=False)
    fitted = fit_to_pair(unset, pair).max_new_tokens
    assert 850 < fitted < 1000 - 10
    engine.prefill("fitted", prompt, GREEDY, max_new_tokens=fitted, verify_tokens=64)  # the widest verify too
    given = ClientRequest(GenerationRequest(prompt_ids=prompt, max_new_tokens=2000))
    assert fit_to_pair(given, pair).max_new_tokens == 2000
    with pytest.raises(ResourceExhausted, match="whole KV budget is 1000"):
        engine.prefill("given", prompt, GREEDY, max_new_tokens=2000)
    engine.release("fitted")


@pytest.mark.parametrize("target", ["unix"], indirect=True)
def test_the_step_socket_wants_the_token_from_the_services_info_and_falls_back_to_grpc_where_it_cannot_reach(target):
    stub, engine, _, local = target
    forged = target_pb2.TargetInfo().local_steps
    forged.path, forged.token = local.path, "not-the-token"
    link = ServiceLink("target", stub.Step, pack_target, owner=OWNER, local=forged,
                       answer_type=target_pb2.TargetBatchResult)
    (refused,) = step(link, [Prefill("forged", [5, 6], GREEDY, False)])
    assert refused.code == grpc.StatusCode.PERMISSION_DENIED and "token" in refused.details
    assert engine.num_sessions == 0
    forged.path = local.path + ".gone"  # a coordinator on another host: no such socket there
    link = ServiceLink("target", stub.Step, pack_target, owner=OWNER, local=forged,
                       answer_type=target_pb2.TargetBatchResult)
    assert decode(link, "far", [5, 6, 7], 6, 1) == decode(target_link(target), "near", [5, 6, 7], 6, 1)
    assert link.transport == "grpc"
    link.close()


@pytest.mark.parametrize("target", ["unix"], indirect=True)
def test_a_service_that_closes_its_step_socket_fails_the_step_in_flight_as_unavailable(target):
    _, engine, _, _ = target
    service = Service("target", TargetSettings(model=engine.model_dir, port=0), ["tandem.v1.TargetService"])
    servicer = TargetServicer(service)
    servicer.attach(engine)
    service.admission.ready = True
    own = StepSocket("target", servicer._serve_local)
    link = ServiceLink("target", None, pack_target, owner=OWNER, local=own.info(),
                       answer_type=target_pb2.TargetBatchResult)
    step(link, [Prefill("doomed", [5, 6, 7], GREEDY, False)])
    assert engine.num_sessions == 1
    own.close()
    (lost,) = step(link, [Verify("doomed", 5, [], False)])
    assert lost.code == grpc.StatusCode.UNAVAILABLE
    deadline = time.monotonic() + 10
    while engine.num_sessions and time.monotonic() < deadline:  # the connection's end frees its sessions
        time.sleep(0.05)
    assert engine.num_sessions == 0


def test_a_step_socket_path_too_long_for_af_unix_is_refused_cleanly(tmp_path, monkeypatch):
    """Under a TMPDIR too deep for AF_UNIX's ~108 bytes, StepSocket raises OSError and leaves nothing behind
    (the servicer then offers no socket and its steps go over gRPC, rather than the service dying)."""
    import tempfile

    from tandem.step_socket import StepSocket

    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with pytest.raises(OSError):
        StepSocket("target", lambda batches, owner: iter(()))
    assert list(deep.iterdir()) == []
