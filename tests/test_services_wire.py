"""The tensor wire codec, and features target -> coordinator -> draft over real gRPC in the scheduler's batches."""

from __future__ import annotations

import grpc
import pytest
import torch

from coordinator.links import ServiceLink
from coordinator.scheduler import pack_draft, pack_target
from draft_server.service import DraftServicer
from tandem.config import DraftSettings, TargetSettings
from tandem.defaults import BATCH_MESSAGE_MIB
from tandem.params import SamplingParams
from tandem.protocol import Drafts, Prefill, PrefillResult, Propose, Verify, VerifyResult
from tandem.service import Service, channel_options
from tandem.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc
from tandem.wire import (
    DEFAULT_CHUNK_BYTES,
    FeatureAssembler,
    WireError,
    decode_features,
    decode_tensor,
    encode_features,
    encode_tensor,
    is_last_chunk,
)
from target_server.service import TargetServicer

GRPC_DEFAULT_LIMIT = 4 << 20
# A 4096-token prefill of an 8B target (H = 4096) in bf16: 4096 x 3 x 4096 x 2 bytes = 96 MiB.
PREFILL_8B = (4096, 3 * 4096)


def features_8b() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(PREFILL_8B, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensor_round_trips_bit_exactly(dtype):
    t = torch.randn(3, 5, 7).to(dtype)
    msg = encode_tensor(t)
    assert (msg.dtype, list(msg.shape), len(msg.data)) == (str(dtype)[6:], [3, 5, 7], t.numel() * t.element_size())
    assert torch.equal(decode_tensor(msg), t)


def test_an_8b_sized_prefill_travels_in_chunks_under_the_message_limit():
    features = features_8b()
    assert features.numel() * 2 == 96 << 20
    chunks = encode_features(features)
    assert len(chunks) >= 48
    assert all(len(c.tensor.data) <= DEFAULT_CHUNK_BYTES for c in chunks)
    assert all(c.ByteSize() < GRPC_DEFAULT_LIMIT for c in chunks)
    assert [is_last_chunk(c) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert sum(c.num_rows for c in chunks) == PREFILL_8B[0]
    # each chunk survives serialization on its own, as each is its own message on the stream
    wire = [common_pb2.Features.FromString(c.SerializeToString()) for c in chunks]
    assert torch.equal(decode_features(wire), features)


def test_small_features_are_one_chunk():
    features = torch.randn(3, 192)
    [chunk] = encode_features(features)
    assert is_last_chunk(chunk) and chunk.total_rows == 3
    assert torch.equal(decode_features([chunk]), features)


def test_malformed_chunks_are_refused():
    chunks = encode_features(torch.randn(10, 8), chunk_bytes=4 * 8 * 3)  # 3 rows a chunk
    assert len(chunks) == 4
    with pytest.raises(WireError, match="starts at row"):
        decode_features([chunks[0], chunks[2]])
    with pytest.raises(WireError, match="ended before"):
        decode_features(chunks[:3])
    bad = common_pb2.Features()
    bad.CopyFrom(chunks[0])
    bad.tensor.data = bad.tensor.data[:-1]
    with pytest.raises(WireError, match="bytes"):
        FeatureAssembler().add(bad)
    bad.CopyFrom(chunks[0])
    bad.tensor.dtype = "int8"
    with pytest.raises(WireError, match="dtype"):
        FeatureAssembler().add(bad)
    # a header claiming more rows (or another width) than the step has is refused before allocating
    bad.CopyFrom(chunks[0])
    bad.total_rows = 1 << 40
    with pytest.raises(WireError, match="do not fit"):
        FeatureAssembler().add(bad, rows=10, width=8)
    with pytest.raises(WireError, match="do not fit"):
        FeatureAssembler().add(chunks[0], rows=10, width=16)
    assert FeatureAssembler().add(chunks[0], rows=10, width=8) is None


# -- the relay over gRPC, with engines that stand in for the models --------------------------------


class BigFeaturesTarget:
    """A target engine whose prefill returns an 8B-sized 96 MiB of features."""

    def __init__(self):
        self.features = features_8b()
        self.sessions: set[str] = set()
        self.device = torch.device("cpu")

    def run(self, steps):
        out = []
        for step in steps:
            if isinstance(step, Prefill):
                self.sessions.add(step.session_id)
                out.append(PrefillResult(token=7, features=self.features[: len(step.prompt_ids)]))
            else:
                out.append(VerifyResult(accepted=step.drafts[:1], bonus=9, features=self.features[:2]))
        return out

    def features_ready(self, session_id):
        return None

    def release(self, session_id):
        return self.sessions.discard(session_id) is None


class RecordingDraftEngine:
    feature_size = 3 * 4096  # an 8B target's 3H
    device = torch.device("cpu")

    def __init__(self):
        self.received: list[torch.Tensor] = []
        self.sessions: set[str] = set()

    def session_ids(self):
        return list(self.sessions)

    def run(self, steps):
        out = []
        for step in steps:
            assert step.features.shape[0] == len(step.next_tokens)
            self.sessions.add(step.session_id)
            self.received.append(step.features)
            out.append(Drafts([len(self.received)] * step.k))
        return out

    def release(self, session_id):
        self.sessions.discard(session_id)
        return True


@pytest.fixture
def relay_pair(tmp_path):
    """A target and a draft servicer on loopback, with the limits the coordinator's links have to them."""
    (tmp_path / "config.json").write_text("{}")
    target_service = Service("target", TargetSettings(model=tmp_path, port=0), ["tandem.v1.TargetService"])
    target = TargetServicer(target_service)
    target_pb2_grpc.add_TargetServiceServicer_to_server(target, target_service.server)
    draft_service = Service("draft", DraftSettings(model=tmp_path, target=tmp_path, port=0), ["tandem.v1.DraftService"])
    draft = DraftServicer(draft_service)
    draft_pb2_grpc.add_DraftServiceServicer_to_server(draft, draft_service.server)
    channels = []
    for service, servicer, engine in ((target_service, target, BigFeaturesTarget()),
                                      (draft_service, draft, RecordingDraftEngine())):
        service.start()
        servicer.engine = engine
        service.ready()
        channels.append(grpc.insecure_channel(service.address, options=channel_options(BATCH_MESSAGE_MIB)))
    yield (target_pb2_grpc.TargetServiceStub(channels[0]), target.engine,
           draft_pb2_grpc.DraftServiceStub(channels[1]), draft.engine)
    for channel in channels:
        channel.close()
    for service in (target_service, draft_service):
        service.server.stop(None)


def test_a_96_mib_prefill_crosses_to_the_draft_in_one_message_each_way(relay_pair):
    target_stub, target_engine, draft_stub, draft_engine = relay_pair
    target = ServiceLink("target", target_stub.Step, pack_target)
    draft = ServiceLink("draft", draft_stub.Step, pack_draft)
    prompt = list(range(PREFILL_8B[0]))
    target.send([Prefill("s1", prompt, SamplingParams())])
    (prefilled,) = target.receive()
    assert prefilled.prefilled.token == 7 and prefilled.features.num_rows == PREFILL_8B[0]
    draft.send([Propose("s1", prefilled.features, prompt[1:] + [7], 3, open=True)])
    assert list(draft.receive()[0].drafts) == [1, 1, 1]
    assert torch.equal(draft_engine.received[0], target_engine.features)
    target.send([Verify("s1", 7, [1, 1, 1])])  # features of t, d_1
    (verified,) = target.receive()
    assert (list(verified.verified.accepted), verified.verified.bonus) == ([1], 9)
    draft.send([Propose("s1", verified.features, [1, 9], 2)])
    assert list(draft.receive()[0].drafts) == [2, 2]
    assert torch.equal(draft_engine.received[1], target_engine.features[:2])
    target.send([], ["s1"])
    draft.send([], ["s1"])
    assert target.receive() == [] and draft.receive() == []
    assert target_engine.sessions == set() and draft_engine.sessions == set()
    target.close()
    draft.close()
