"""The accounting and the report's arithmetic, without processes: byte kinds add up to the serialized
size, the gRPC wrappers count what really crosses, the stages add up to a round, clocks are aligned."""

from __future__ import annotations

import random
from concurrent import futures

import grpc
import pytest

from tandem.traffic import (
    KINDS,
    LinkCount,
    MeteredChannel,
    Traffic,
    TrafficInterceptor,
    ids_size,
    parts_of,
    varint_size,
)
from tandem.v1 import common_pb2, coordinator_pb2, draft_pb2, profile_pb2, target_pb2
from tandem_tools.report import STAGES, round_stages
from tandem_tools.trace import _offset


def feature_chunk(rows: int, width: int = 192, dtype: str = "float32") -> common_pb2.Features:
    size = {"float32": 4, "bfloat16": 2}[dtype]
    return common_pb2.Features(
        tensor=common_pb2.Tensor(dtype=dtype, shape=[rows, width], data=bytes(rows * width * size)),
        row_offset=0, num_rows=rows, total_rows=rows,
    )


def messages(rng: random.Random) -> list:
    def ids(n: int) -> list[int]:
        return [rng.choice([0, 1, 127, 128, 16383, 16384, 128_255, rng.randrange(200_000)]) for _ in range(n)]

    return [
        target_pb2.TargetRequest(prefill=target_pb2.Prefill(session_id="ab" * 16, prompt_ids=ids(50),
                                                            sampling=common_pb2.SamplingParams(temperature=0.7),
                                                            want_features=True, want_timing=True)),
        target_pb2.TargetRequest(verify=target_pb2.Verify(token=ids(1)[0], drafts=ids(5), want_features=True)),
        target_pb2.TargetRequest(verify=target_pb2.Verify(token=0, drafts=[])),
        target_pb2.TargetResponse(prefilled=target_pb2.Prefilled(token=ids(1)[0]), features=feature_chunk(7)),
        target_pb2.TargetResponse(verified=target_pb2.Verified(accepted=ids(3), bonus=ids(1)[0]),
                                  features=feature_chunk(4, 12288, "bfloat16"),
                                  timing=profile_pb2.StepTiming(received_ns=1 << 40, sent_ns=(1 << 40) + 5,
                                                                compute_ns=123_456)),
        target_pb2.TargetResponse(features=feature_chunk(3)),
        draft_pb2.DraftRequest(next_tokens=ids(9), num_draft_tokens=4, features=feature_chunk(9)),
        draft_pb2.DraftResponse(drafts=ids(4), timing=profile_pb2.StepTiming(compute_ns=99)),
        draft_pb2.DraftResponse(drafts=ids(3), q=[common_pb2.DraftProbs(ids=ids(8), probs=[0.125] * 8)
                                                  for _ in range(3)]),
        target_pb2.TargetRequest(verify=target_pb2.Verify(token=5, drafts=ids(2), q=[
            common_pb2.DraftProbs(ids=ids(32), probs=[rng.random() for _ in range(32)]) for _ in range(2)])),
        coordinator_pb2.GenerateRequest(prompt="héllo wörld ✓", max_new_tokens=32, stop=["\n\n"]),
        coordinator_pb2.GenerateRequest(prompt_ids=ids(30)),
        coordinator_pb2.GenerateResponse(token_ids=ids(6), text="def main(", finish_reason="length"),
        target_pb2.TargetInfo(model="m", vocab_size=5),
    ]


def test_varint_sizes_are_protobufs():
    for value in [0, 1, 127, 128, 300, 16383, 16384, 2**21 - 1, 2**21, 2**28, 2**31 - 1]:
        encoded = draft_pb2.DraftResponse(drafts=[value]).SerializeToString()
        assert len(encoded) == 2 + varint_size(value), value  # tag + length + the varint
    assert ids_size([1, 200, 70_000]) == 1 + 2 + 3


def test_kinds_add_up_to_the_serialized_size_and_features_are_the_tensor_payload():
    rng = random.Random(0)
    for _ in range(20):
        for msg in messages(rng):
            parts = parts_of(msg)
            kinds = parts.kinds(msg.ByteSize())
            assert set(kinds) == set(KINDS)
            assert sum(kinds.values()) == len(msg.SerializeToString())
            assert all(v >= 0 for v in kinds.values()), (type(msg).__name__, kinds)
            features = [f for f in (getattr(msg, "features", None),) if f is not None and msg.HasField("features")]
            assert parts.features == sum(len(f.tensor.data) for f in features)
            assert parts.feature_rows == sum(f.num_rows for f in features)


def test_token_id_bytes_are_the_varints_of_the_ids():
    msg = target_pb2.TargetResponse(verified=target_pb2.Verified(accepted=[5, 300, 70_000], bonus=128_000))
    parts = parts_of(msg)
    assert (parts.num_token_ids, parts.token_ids) == (4, 1 + 2 + 3 + 3)
    request = target_pb2.TargetRequest(verify=target_pb2.Verify(token=0, drafts=[1, 2]))
    assert (parts_of(request).num_token_ids, parts_of(request).token_ids) == (3, 2)  # a zero id is not sent


def test_a_batch_message_counts_the_payload_of_each_step():
    verify = target_pb2.TargetRequest(verify=target_pb2.Verify(token=5, drafts=[300, 7]))
    steps = target_pb2.TargetBatch(steps=[target_pb2.SessionStep(session_id=f"s{i}", request=verify) for i in range(3)])
    assert (parts_of(steps).num_token_ids, parts_of(steps).token_ids) == (9, 3 * (1 + 2 + 1))
    answer = target_pb2.TargetResponse(verified=target_pb2.Verified(accepted=[300], bonus=9))
    results = target_pb2.TargetBatchResult(results=[target_pb2.StepResult(response=answer),
                                                target_pb2.StepResult(error=common_pb2.StepError(code=5))])
    assert parts_of(results).num_token_ids == 2  # the failed step carries none
    proposes = draft_pb2.DraftBatch(steps=[draft_pb2.DraftSessionStep(
        session_id="s", request=draft_pb2.DraftRequest(next_tokens=[1, 2]))])
    drafted = draft_pb2.DraftBatchResult(results=[draft_pb2.DraftStepResult(
        response=draft_pb2.DraftResponse(drafts=[3, 4, 5]))])
    assert (parts_of(proposes).num_token_ids, parts_of(drafted).num_token_ids) == (2, 3)


def test_q_bytes_are_its_support_ids_and_float_probabilities():
    q = [common_pb2.DraftProbs(ids=[5, 300, 70_000], probs=[0.5, 0.25, 0.25]),
         common_pb2.DraftProbs(ids=[9], probs=[1.0])]
    response = draft_pb2.DraftResponse(drafts=[5, 9], q=q)
    # each q: a tag and a length per field, the id varints, 4 bytes per probability
    assert parts_of(response).draft_probs == (2 + 1 + 2 + 3 + 2 + 4 * 3) + (2 + 1 + 2 + 4)
    assert parts_of(response).num_token_ids == 2  # q's support is not counted as token ids
    relayed = target_pb2.TargetRequest(verify=target_pb2.Verify(token=1, drafts=[5, 9], q=q))
    assert parts_of(relayed).draft_probs == parts_of(response).draft_probs


@pytest.fixture
def echo_server():
    """A generic bidi echo service with the traffic interceptor, and a metered channel to it."""
    server_traffic, client_traffic = Traffic(), Traffic()
    server = grpc.server(futures.ThreadPoolExecutor(4),
                         interceptors=[TrafficInterceptor(server_traffic, "draft->coordinator", "coordinator->draft")])

    def session(requests, context):
        for request in requests:
            yield draft_pb2.DraftResponse(drafts=list(request.next_tokens)[:3])

    handler = grpc.method_handlers_generic_handler("tandem.v1.DraftService", {
        "Session": grpc.stream_stream_rpc_method_handler(
            session, request_deserializer=draft_pb2.DraftRequest.FromString,
            response_serializer=draft_pb2.DraftResponse.SerializeToString),
    })
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = MeteredChannel(grpc.insecure_channel(f"127.0.0.1:{port}"), client_traffic, "coordinator->draft",
                             "draft->coordinator")
    yield channel, server_traffic, client_traffic
    channel.close()
    server.stop(None)


def test_the_grpc_wrappers_count_exactly_what_is_sent_on_both_ends(echo_server):
    channel, server_traffic, client_traffic = echo_server
    call = channel.stream_stream("/tandem.v1.DraftService/Session",
                                 request_serializer=draft_pb2.DraftRequest.SerializeToString,
                                 response_deserializer=draft_pb2.DraftResponse.FromString)
    requests = [draft_pb2.DraftRequest(next_tokens=[1, 300, 70_000, 5], num_draft_tokens=3,
                                       features=feature_chunk(4)) for _ in range(5)]
    responses = list(call(iter(requests)))
    assert len(responses) == 5
    sent = client_traffic.snapshot()[("sent", "coordinator->draft", "grpc")]
    received = server_traffic.snapshot()[("received", "coordinator->draft", "grpc")]
    expected = LinkCount()
    for r in requests:
        expected.add(len(r.SerializeToString()), parts_of(r))
    assert sent == received == expected
    assert sent.bytes["features"] == 5 * 4 * 192 * 4 and sent.token_ids == 20 and sent.feature_rows == 20
    back = server_traffic.snapshot()[("sent", "draft->coordinator", "grpc")]
    assert back == client_traffic.snapshot()[("received", "draft->coordinator", "grpc")]
    assert back.messages == 5 and back.total == sum(r.ByteSize() for r in responses)


def _round(**fields) -> profile_pb2.RoundProfile:
    return profile_pb2.RoundProfile(**fields)


def test_the_stages_of_a_round_add_up_to_its_wall_time():
    ms = 1_000_000
    r = _round(
        index=3, start_ns=100 * ms, end_ns=130 * ms,
        draft_sent_ns=101 * ms, draft_received_ns=108 * ms, target_sent_ns=109 * ms, target_received_ns=128 * ms,
        draft=profile_pb2.StepTiming(received_ns=1, sent_ns=2, queue_ns=1 * ms, compute_ns=4 * ms, codec_ns=ms // 2),
        target=profile_pb2.StepTiming(received_ns=1, sent_ns=2, queue_ns=0, compute_ns=15 * ms, codec_ns=ms // 4),
    )
    stages = round_stages(r)
    assert sum(stages.values()) == 30 * ms
    assert stages == {"target_compute": 15 * ms, "draft_compute": 4 * ms, "queueing": 1 * ms,
                      "transport": (7 - 5 + 19 - 15) * ms, "coordinator": (30 - 7 - 19) * ms}
    prefill = round_stages(_round(index=0, start_ns=0, end_ns=10 * ms, target_sent_ns=ms, target_received_ns=9 * ms,
                                  target=profile_pb2.StepTiming(compute_ns=6 * ms)))
    assert prefill["draft_compute"] == 0 and sum(prefill.values()) == 10 * ms
    assert set(stages) == set(STAGES)
    # a target-only round timed by the gate, the draft taking in its pairs beside it: only what outlasts it counts
    beside = round_stages(_round(index=4, start_ns=100 * ms, end_ns=153 * ms, target_sent_ns=101 * ms,
                                 target_received_ns=150 * ms, draft_sent_ns=101 * ms, draft_received_ns=151 * ms,
                                 target=profile_pb2.StepTiming(compute_ns=48 * ms),
                                 draft=profile_pb2.StepTiming(compute_ns=2 * ms)))
    assert beside["coordinator"] == 3 * ms and beside["draft_compute"] == ms and sum(beside.values()) == 53 * ms


def test_clock_offsets_prefer_zero_and_recover_a_shifted_clock():
    # same host: every step fits inside its round trip with no shift
    assert _offset([(-5, 3), (-2, 8), (-1, 1)]) == 0
    # a service clock 1000 behind: each step says the offset is between (sent - received) and (answer - sent)
    true = 1000
    bounds = [(c_sent - (c_sent + d - true), (c_sent + d + w + r) - (c_sent + d + w - true))
              for c_sent, d, w, r in [(0, 5, 20, 3), (100, 2, 7, 9), (300, 4, 4, 4)]]
    offset = _offset(bounds)
    assert true - 2 <= offset <= true + 5
    assert all(low <= offset <= high for low, high in bounds)


def test_an_overlapped_rounds_answers_are_stamped_when_each_link_read_them():
    """The scheduler reads the target's answer and then the draft's before it hands either on: the probe takes
    each step's times from its own link (ServiceLink.sent_ns / received_ns), so a verify that answered while
    its ahead still ran is not counted as waited for, and the ahead's overrun is (report: ahead_exposed_ns)."""
    from types import SimpleNamespace

    from coordinator.probe import RequestProbe
    from tandem.protocol import Ahead, Verify
    from tandem_tools.report import ahead_exposed_ns

    ms = 1_000_000
    probe = RequestProbe(coordinator_pb2.GenerateRequest(prompt_ids=[1, 2, 3], profile=True))
    target = SimpleNamespace(service="target", transport="unix", sent_ns=100 * ms, received_ns=106 * ms)
    draft = SimpleNamespace(service="draft", transport="unix", sent_ns=101 * ms, received_ns=109 * ms)
    verify, ahead = Verify("s", 5, [6, 7]), Ahead("s", None, [], [6, 7], 2, 8)
    probe.steps_sent([verify, ahead], (target, draft))
    answers = {id(verify): target_pb2.TargetResponse(verified=target_pb2.Verified(accepted=[6], bonus=9)),
               id(ahead): draft_pb2.DraftResponse(branches=[draft_pb2.Branch(accepted=1, bonus=9, drafts=[4, 4])])}
    probe.steps_received([verify, ahead], answers, (target, draft))
    probe.round_done(2)
    r = probe._rounds[-1].to_pb("grpc", probe.steps)
    assert (r.target_sent_ns, r.target_received_ns) == (100 * ms, 106 * ms)
    assert (r.ahead_sent_ns, r.ahead_received_ns) == (101 * ms, 109 * ms)
    assert ahead_exposed_ns(r) == 3 * ms
