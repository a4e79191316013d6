"""The cohort relay (coordinator/relay.py, TargetService.Cohort): many sessions' verifies in one message
each way, over real gRPC to a real target engine."""

from __future__ import annotations

import queue
import threading

import grpc
import pytest
import torch

from coordinator.backends import BackendError, GrpcTarget
from coordinator.relay import draft_relay, target_relay
from draft_server.engine import DraftEngine
from draft_server.service import DraftServicer
from tandem.config import DraftSettings, TargetSettings
from tandem.params import SamplingParams
from tandem.service import Service
from tandem.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tandem.wire import encode_features
from target_server.engine import TargetEngine
from target_server.service import TargetServicer
from tests.test_services import id_prompts


@pytest.fixture(scope="module")
def target(tiny_dir):
    """The tiny target's servicer on loopback; (stub, engine, relay)."""
    service = Service("target", TargetSettings(model=tiny_dir / "target", port=0), ["tandem.v1.TargetService"])
    servicer = TargetServicer(service, chunk_bytes=2 << 20)
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, service.server)
    service.start()
    engine = TargetEngine(tiny_dir / "target")
    servicer.engine = engine
    service.ready()
    channel = grpc.insecure_channel(service.address)
    stub = target_pb2_grpc.TargetServiceStub(channel)
    info = target_pb2.TargetInfo(hidden_size=engine.hidden_size, dtype="float32")
    yield stub, engine, target_relay(stub, info, max_message_mib=16)
    channel.close()
    service.server.stop(None)


def rounds(target: GrpcTarget, sid: str, prompt: list[int], n: int, barrier=None) -> list[tuple]:
    """A prefill, then n verifies of drafts made up from the tokens so far (some accepted, some not)."""
    t = target.prefill(sid, prompt, SamplingParams(), want_features=True).token
    out, history = [], list(prompt)
    for i in range(n):
        if barrier is not None:
            barrier.wait(30)
        drafts = [history[-(i % 3) - 1], t, (t + i) % 50]
        result = target.verify(sid, t, drafts)
        features = [chunk.num_rows for chunk in result.features]
        out.append((result.accepted, result.bonus, features))
        history += [t, *result.accepted]
        t = result.bonus
    target.release(sid)
    return out


def test_concurrent_verifies_share_a_message_and_give_what_their_own_streams_give(target, tiny_dir):
    stub, engine, relay = target
    prompts = id_prompts(6, engine.vocab_size, seed=3)
    alone = [rounds(GrpcTarget(stub, [], timeout=60), f"own{i}", p, 5) for i, p in enumerate(prompts)]
    batches = relay._batcher.batches
    barrier = threading.Barrier(len(prompts))
    relayed: list = [None] * len(prompts)

    def run(i: int) -> None:
        relayed[i] = rounds(GrpcTarget(stub, [], timeout=60, relay=relay), f"relay{i}", prompts[i], 5, barrier)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert relayed == alone
    assert all(n == a + 1 for out in relayed for accepted, _, (n,) in out for a in [len(accepted)])
    sent = relay._batcher.batches - batches
    assert sent < 5 * len(prompts) / 2, f"{sent} relay messages for {5 * len(prompts)} verifies"
    assert engine.num_sessions == 0


def test_a_bad_verify_in_a_cohort_fails_alone_and_the_others_go_on(target):
    stub, engine, _ = target
    own = GrpcTarget(stub, [], timeout=60)
    t = own.prefill("good", [5, 6, 7, 8], SamplingParams(), want_features=False).token
    other = GrpcTarget(stub, [], timeout=60)
    other.prefill("other", [5, 6], SamplingParams(), want_features=False)

    def verify(session_id: str, token: int) -> target_pb2.SessionStep:
        request = target_pb2.TargetRequest(verify=target_pb2.Verify(token=token, drafts=[t]))
        return target_pb2.SessionStep(session_id=session_id, request=request)

    steps = [verify("good", t), verify("nobody", t), verify("good", t), verify("other", engine.vocab_size + 5),
             target_pb2.SessionStep(session_id="good", request=target_pb2.TargetRequest(
                 prefill=target_pb2.Prefill(prompt_ids=[1, 2])))]
    (answer,) = stub.Cohort(iter([target_pb2.CohortSteps(steps=steps)]), timeout=60)
    codes = [grpc.StatusCode.OK if r.HasField("response") else r.error.code for r in answer.results]
    assert codes[0] == grpc.StatusCode.OK and answer.results[0].response.verified.bonus >= 0
    assert codes[1:] == [grpc.StatusCode.NOT_FOUND.value[0]] + [grpc.StatusCode.INVALID_ARGUMENT.value[0]] * 3
    assert "two steps of session 'good' in one cohort" in answer.results[2].error.message
    assert "the verify input" in answer.results[3].error.message
    assert "verifies only" in answer.results[4].error.message
    bonus = answer.results[0].response.verified.bonus
    assert own.verify("good", bonus, []).bonus >= 0  # the session carries on, on its own stream
    own.release("good")
    other.release("other")


def test_a_cancelled_generation_sends_no_more_verifies(target):
    stub, _, relay = target
    own = GrpcTarget(stub, [], timeout=60, relay=relay)
    t = own.prefill("gone", [5, 6, 7], SamplingParams(), want_features=False).token
    own.cancel()
    with pytest.raises(BackendError) as failed:
        own.verify("gone", t, [t])
    assert failed.value.code == grpc.StatusCode.CANCELLED


def test_chain_proposes_share_a_message_and_a_bad_one_fails_alone(tiny_dir):
    service = Service("draft", DraftSettings(model=tiny_dir / "draft", target=tiny_dir / "target", port=0),
                      ["tandem.v1.DraftService"])
    servicer = DraftServicer(service)
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, service.server)
    service.start()
    engine = DraftEngine(tiny_dir / "draft", tiny_dir / "target")
    servicer.engine = engine
    service.ready()
    width = engine.feature_size
    try:
        with grpc.insecure_channel(service.address) as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            streams = []
            for sid in ("a", "b"):  # each session opened by its first propose on its own stream
                first = draft_pb2.DraftRequest(session_id=sid, next_tokens=[3, 4, 5], num_draft_tokens=2,
                                               features=encode_features(torch.randn(3, width))[0])
                requests: queue.SimpleQueue = queue.SimpleQueue()
                requests.put(first)
                call = stub.Session(iter(requests.get, None), timeout=60)  # held open: the session lives
                assert len(next(call).drafts) == 2
                streams.append(call)

            def propose(sid: str, k: int = 3, **extra) -> draft_pb2.DraftSessionStep:
                request = draft_pb2.DraftRequest(next_tokens=[6, 7], num_draft_tokens=k,
                                                 features=encode_features(torch.randn(2, width))[0], **extra)
                return draft_pb2.DraftSessionStep(session_id=sid, request=request)

            steps = [propose("a"), propose("b", 4), propose("nobody"), propose("a"), propose("b", 99)]
            (answer,) = stub.Cohort(iter([draft_pb2.DraftCohortSteps(steps=steps)]), timeout=60)
            ok = [r for r in answer.results if r.HasField("response")]
            assert [len(r.response.drafts) for r in ok] == [3, 4]
            assert {r.response.batch.size for r in ok} == {2}  # one batch
            codes = [r.error.code for r in answer.results[2:]]
            assert codes == [grpc.StatusCode.NOT_FOUND.value[0]] + [grpc.StatusCode.INVALID_ARGUMENT.value[0]] * 2
            relay = draft_relay(stub, draft_pb2.DraftInfo(target_hidden_size=width // 3, dtype="float32"), 16, 10.0)
            again = relay.step("a", propose("a").request, 5, None)
            assert len(again.drafts) == 3
            for call in streams:
                call.cancel()
    finally:
        service.server.stop(None)


def decode(target: GrpcTarget, sid: str, prompt: list[int], n: int, per_call: int, stop_ids=()) -> list[int]:
    """A prefill, then target-only verifies of `per_call` tokens each (Verify.decode) until n tokens."""
    t = target.prefill(sid, prompt, SamplingParams(), want_features=False, max_new_tokens=n + 1).token
    out = [t]
    while len(out) < n and t not in stop_ids:
        result = target.verify(sid, t, [], want_features=False, decode=min(per_call, n - len(out)), stop_ids=stop_ids)
        assert result.features is None
        out += [*result.accepted, result.bonus]
        t = result.bonus
    target.release(sid)
    return out


def test_a_target_only_decode_of_many_tokens_gives_what_single_tokens_give(target):
    stub, engine, relay = target
    prompts = id_prompts(4, engine.vocab_size, seed=5)
    single = [decode(GrpcTarget(stub, [], timeout=60), f"one{i}", p, 12, 1) for i, p in enumerate(prompts)]
    own = [decode(GrpcTarget(stub, [], timeout=60), f"own{i}", p, 12, 5) for i, p in enumerate(prompts)]
    assert own == single
    relayed: list = [None] * len(prompts)
    threads = [threading.Thread(target=lambda i=i: relayed.__setitem__(i, decode(
        GrpcTarget(stub, [], timeout=60, relay=relay), f"relay{i}", prompts[i], 12, 5))) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert relayed == single
    unary = [decode(GrpcTarget(stub, [], timeout=60, relay=relay, answer_within_ms=2000), f"unary{i}", p, 12, 11)
             for i, p in enumerate(prompts)]  # a unary client's decodes: answered once done, not every 50 ms
    assert unary == single
    stop = single[0][4]  # a decode ends after a stop id: the first one it makes
    stopped = decode(GrpcTarget(stub, [], timeout=60), "stop", prompts[0], 12, 8, stop_ids=[stop])
    assert stopped == single[0][: single[0].index(stop) + 1]
    assert engine.num_sessions == 0


def test_a_decode_with_drafts_or_features_is_refused_naming_why(target):
    stub, _, _ = target
    for kwargs, words in (({"drafts": [5]}, "takes no drafts"), ({"want_features": True}, "returns no features"),
                          ({"decode": 65}, "at most 64"), ({"decode": 30}, "past the"),
                          ({"answer_within_ms": 10_001}, "answer_within_ms is 10001")):
        call = {"drafts": [], "want_features": False, "decode": 4, "answer_within_ms": 0, **kwargs}
        own = GrpcTarget(stub, [], timeout=60, answer_within_ms=call["answer_within_ms"])  # a refusal ends the stream
        t = own.prefill("bad-decode", [5, 6, 7], SamplingParams(), want_features=False, max_new_tokens=8).token
        with pytest.raises(BackendError) as refused:
            own.verify("bad-decode", t, call["drafts"], want_features=call["want_features"], decode=call["decode"])
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in refused.value.details
    own = GrpcTarget(stub, [], timeout=60)
    t = own.prefill("bad-decode", [5, 6, 7], SamplingParams(), want_features=False, max_new_tokens=8).token
    assert len(own.verify("bad-decode", t, [], want_features=False, decode=4).accepted) <= 3  # 3 unless slow
    own.release("bad-decode")
