"""Feature fast paths (tandem/transports/): the handshake's choice and its errors, the ring and the
mailbox in-process, and whole stacks per transport: the same generations as gRPC, the coordinator
carrying ids and descriptors only, and a draft killed mid-stream never holding the target."""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from coordinator.client import TandemClient
from tandem.transports import TransportMismatch, negotiate
from tandem.transports.contract import TransportError
from tandem.transports.endpoints import DraftTransport, TargetTransport
from tandem.transports.ring import Ring
from tandem.v1 import common_pb2
from tandem_tools.profile import free_port
from tests.processes import start_stack, stop_stack

HOST = "boot/ipc:[1]"
PROMPTS = [[1, 5, 9, 2], [7, 7, 3, 11, 4, 8], [20, 3]]


def caps(device="cpu", requested="auto", host=HOST, uuid="", dtype="float32", width=192, available=None):
    if available is None:
        available = ["grpc", "shm", "nccl"] + (["cuda-ipc"] if device.startswith("cuda") else [])
    return common_pb2.TransportCaps(requested=requested, available=available, host_id=host, device=device,
                                    device_uuid=uuid, dtype=dtype, feature_width=width)


# -- the handshake's choice -----------------------------------------------------------------------


def test_auto_picks_the_fastest_path_both_ends_support():
    assert negotiate(caps(), caps()).transport == "shm"  # one host, CPU: gloo is slower than shm
    assert negotiate(caps(), caps(host="other/ipc:[2]")).transport == "grpc"
    one_node = negotiate(caps("cuda:0", uuid="GPU-a"), caps("cuda:1", uuid="GPU-b"))
    assert one_node.transport == "cuda-ipc"
    assert negotiate(caps("cuda:0", uuid="GPU-a"), caps("cuda:0", host="n2", uuid="GPU-b")).transport == "nccl"
    # NCCL refuses two ranks on one GPU; other hosts can't share memory: nothing fast is left
    assert negotiate(caps("cuda", uuid="GPU-a", available=["grpc", "nccl"]),
                     caps("cuda", uuid="GPU-a", available=["grpc", "nccl"])).transport == "grpc"


def test_an_explicit_choice_wins_and_an_unavailable_one_falls_back_to_grpc():
    assert negotiate(caps(requested="nccl"), caps()).transport == "nccl"  # gloo on CPU, when asked for
    choice = negotiate(caps(requested="cuda-ipc"), caps(requested="cuda-ipc"))
    assert (choice.transport, choice.fallback) == ("grpc", True)
    assert "cuda-ipc" in choice.reason


@pytest.mark.parametrize(("target", "draft", "field"), [
    (caps(requested="shm"), caps(requested="nccl"), "transport differs"),
    (caps(dtype="bfloat16"), caps(dtype="float32"), "feature dtype differs"),
    (caps(width=192), caps(width=384), "feature width differs"),
])
def test_a_mismatch_is_one_error_naming_the_field(target, draft, field):
    with pytest.raises(TransportMismatch, match=field):
        negotiate(target, draft)


def test_the_draft_refuses_a_plan_that_does_not_fit_it():
    draft = DraftTransport("auto", "cpu", "float32", 192)
    plan = common_pb2.TransportPlan(transport="shm", dtype="float32", feature_width=96)
    with pytest.raises(TransportMismatch, match="feature width differs: the target sends 96, the draft expects 192"):
        draft.open(plan)


# -- the ring, shared memory and the nccl mailbox in one process ----------------------------------


def test_ring_frees_out_of_order_and_reports_full():
    ring = Ring(4096, max_inflight=3)
    a, b, c = ring.alloc(1000), ring.alloc(1000), ring.alloc(1000)
    assert ring.alloc(1) is None  # no slot left
    ring.free(b[0], 1000, b[1])
    assert ring.alloc(2000) is None  # 1024 free in the middle, 1024 at the end: no 2048 run
    ring.free(a[0], 1000, a[1])
    assert ring.alloc(2000)[0] == 0  # a and b coalesced
    ring.free(c[0], 1000, c[1])


def pair(transport: str, ring_mib: float = 1.0, max_inflight: int = 8, timeout: float = 5.0):
    target = TargetTransport(transport, "cpu", "float32", 12, ring_bytes=int(ring_mib * (1 << 20)),
                             max_inflight=max_inflight, timeout=timeout)
    draft = DraftTransport(transport, "cpu", "float32", 12)
    plan = target.open(common_pb2.TransportPlan(transport=transport, reason="test"))
    attach = threading.Thread(target=draft.open, args=(plan,))  # nccl: both ends join the group at once
    attach.start()
    attach.join(30)
    target.start(plan)
    return target, draft


def test_shm_steps_of_concurrent_sessions_are_kept_apart_until_each_is_two_steps_on():
    target, draft = pair("shm")
    try:
        a, b = torch.randn(5, 12), torch.randn(3, 12)
        ref_a, ref_b = target.send("a", a), target.send("b", b)
        assert torch.equal(draft.recv(ref_b, 3, 12), b) and torch.equal(draft.recv(ref_a, 5, 12), a)
        target.send("a", torch.randn(2, 12))  # session a moved on: its first step may still be read
        assert torch.equal(draft.recv(ref_a, 5, 12), a)
        target.send("a", torch.randn(2, 12))  # two steps on: its first step is freed
        with pytest.raises(TransportError, match="gone"):
            draft.recv(ref_a, 5, 12)
        assert target.send("c", torch.randn(1 << 16, 12)) is None  # 3 MiB: past the ring, so inline
    finally:
        target.close()
        draft.close()


def test_nccl_over_gloo_delivers_interleaved_sessions_and_never_blocks_the_target():
    target, draft = pair("nccl", timeout=3.0)
    try:
        steps = {sid: torch.randn(n, 12) for sid, n in (("a", 4), ("b", 1), ("c", 7))}
        refs = {sid: target.send(sid, t) for sid, t in steps.items()}
        for sid in ("c", "a", "b"):  # claimed in another order than sent
            assert torch.equal(draft.recv(refs[sid], steps[sid].shape[0], 12), steps[sid])
        draft.close()
        start = time.monotonic()
        with pytest.raises(TransportError):
            draft.recv(refs["a"], 4, 12)  # a closed channel fails at once, not after a hang
        assert time.monotonic() - start < 3
    finally:
        target.close()
        draft.close()


# -- whole stacks, one per transport --------------------------------------------------------------


def scrape(port: int) -> dict[tuple, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def feature_bytes(port: int, direction: str, link: str, transport: str) -> float:
    labels = tuple(sorted({"link": link, "kind": "features", "transport": transport}.items()))
    return scrape(port).get((f"tandem:transport_{direction}_bytes_total", labels), 0.0)


@pytest.fixture(scope="module")
def stacks(tiny_dir, tmp_path_factory):
    """transport -> (the three processes, their metrics ports), started on first use."""
    started: dict[str, tuple] = {}

    def get(transport: str):
        if transport not in started:
            run = tmp_path_factory.mktemp(f"stack-{transport}")
            ports = {name: free_port() for name in ("target", "draft", "coordinator")}
            procs = start_stack(
                tiny_dir, run,
                target_args=["--transport", transport, "--metrics-port", str(ports["target"])],
                draft_args=["--transport", transport, "--metrics-port", str(ports["draft"])],
                coordinator_args=["--metrics-port", str(ports["coordinator"]), "--draft-timeout", "10"],
            )
            started[transport] = (procs, ports)
        return started[transport]

    yield get
    for procs, _ in started.values():
        stop_stack(procs)


def generations(address: str, max_new_tokens: int = 12) -> list[list[int]]:
    with TandemClient(address, timeout=120) as client:
        return [client.generate(prompt_ids=p, max_new_tokens=max_new_tokens, num_draft_tokens=3, temperature=0.0,
                                ignore_eos=True).token_ids for p in PROMPTS]


def test_generations_are_identical_over_grpc_shm_and_nccl(stacks):
    outputs = {}
    for transport in ("grpc", "shm", "nccl"):
        procs, _ = stacks(transport)
        assert f"features come over {transport}" in procs["draft"].log() or transport == "grpc"
        outputs[transport] = generations(procs["coordinator"].address)
    assert outputs["shm"] == outputs["grpc"] and outputs["nccl"] == outputs["grpc"]


@pytest.mark.parametrize("transport", ["shm", "nccl"])
def test_a_fast_path_leaves_the_coordinator_ids_and_descriptors(stacks, transport):
    procs, ports = stacks(transport)
    generations(procs["coordinator"].address)
    coordinator = ports["coordinator"]
    for direction, link in (("received", "target->coordinator"), ("sent", "coordinator->draft")):
        assert feature_bytes(coordinator, direction, link, "grpc") == 0
    sent = feature_bytes(ports["target"], "sent", "target->draft", transport)
    received = feature_bytes(ports["draft"], "received", "target->draft", transport)
    # a generation's last step has features no draft step reads (the round loop stops first)
    assert 0 < received <= sent
    from coordinator.client import build_request
    from tandem.v1 import coordinator_pb2_grpc

    request = build_request(prompt_ids=PROMPTS[0], max_new_tokens=4, num_draft_tokens=3)
    request.profile = True  # and a request's profile names the path its features took
    with grpc.insecure_channel(procs["coordinator"].address) as channel:
        last = list(coordinator_pb2_grpc.CoordinatorStub(channel).GenerateStream(request, timeout=120))[-1]
    assert last.profile.transport == transport


def test_a_transport_mismatch_is_one_clear_error(stacks, tmp_path):
    from tests.processes import Proc

    shm, nccl = stacks("shm")[0], stacks("nccl")[0]
    coordinator = Proc("coordinator", ["--target-addr", shm["target"].address,
                                       "--draft-addr", nccl["draft"].address], tmp_path)
    assert coordinator.proc.wait(120) != 0
    assert "transport differs: the target is set to shm, the draft to nccl" in coordinator.log()


def test_a_killed_draft_never_holds_the_target(stacks):
    procs, _ = stacks("nccl")
    target = procs["target"].address
    expected = generations(procs["coordinator"].address, max_new_tokens=150)
    results = {}
    long_run = threading.Thread(target=lambda: results.update(out=generations(procs["coordinator"].address, 150)))
    long_run.start()
    deadline = time.monotonic() + 30
    while _target_sessions(target) == 0:  # batched generations are quick: kill inside one, not after
        assert time.monotonic() < deadline, "the long run never started"
        time.sleep(0.02)
    time.sleep(0.2)
    procs["draft"].kill()  # mid-generation, in the middle of nccl sends
    long_run.join(120)
    assert not long_run.is_alive() and results["out"] == expected  # finished target-only, losslessly
    deadline = time.monotonic() + 30
    while _target_sessions(target) != 0:
        assert time.monotonic() < deadline, "the target still holds sessions after the draft died"
        time.sleep(0.1)
    assert generations(procs["coordinator"].address, 150) == expected  # and it goes on serving
    # (the target logs "the nccl feature channel ... broke" only when a send was under way at the kill;
    # when the coordinator noticed first, no feature is sent to the dead draft at all)


def _target_sessions(address: str) -> int:
    from tandem.v1 import target_pb2, target_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return target_pb2_grpc.TargetServiceStub(channel).ModelInfo(target_pb2.TargetInfoRequest(), timeout=10).num_sessions


# -- CUDA: cuda-ipc between two processes on one GPU, NCCL across two GPUs ------------------------


def _bench_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "transport.py"
    spec = importlib.util.spec_from_file_location("bench_transport", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ipc_moves_steps_between_two_processes():
    rows = _bench_module().bench("cuda-ipc", "cuda", iters=3)
    assert isinstance(rows, list) and len(rows) == 8


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs (it refuses two ranks on one)")
def test_nccl_moves_steps_between_two_gpus():
    rows = _bench_module().bench("nccl", "cuda", iters=3)
    assert isinstance(rows, list) and len(rows) == 8
