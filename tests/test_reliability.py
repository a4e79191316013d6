"""Reliability on one stack of three processes: every bad input gets its typed status and leaves the
others alone, cancelled streams leave no sessions and no memory behind, idle sessions are evicted,
mismatched pairs are refused at start-up, internal services stay on loopback, and a short load run."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from processes import (
    listening_addresses,
    open_sessions,
    rss_mib,
    start_stack,
    stop_stack,
    wait_for_no_sessions,
)

from coordinator.client import TandemClient, TandemError, build_request
from coordinator.monitor import check_services_pair
from tandem.pairing import PairMismatch
from tandem.service import health_status
from tandem.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    draft_pb2,
    draft_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from tandem.wire import encode_features

GOOD = {"prompt_ids": [5, 6, 7], "max_new_tokens": 6}


@pytest.fixture(scope="module")
def stack(tiny_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("reliability")
    procs = start_stack(tiny_dir, run, coordinator_args=["--max-sessions", "32"])
    yield procs
    stop_stack(procs)


@pytest.fixture(scope="module")
def client(stack):
    with TandemClient(stack["coordinator"].address, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def good_output(client):
    return client.generate(**GOOD).model_dump()


def call(stack, request: coordinator_pb2.GenerateRequest) -> None:
    with grpc.insecure_channel(stack["coordinator"].address) as channel:
        coordinator_pb2_grpc.CoordinatorStub(channel).Generate(request, timeout=60)


def req(**kwargs) -> coordinator_pb2.GenerateRequest:
    return build_request(**{"prompt_ids": [5, 6, 7], **kwargs})


INVALID = grpc.StatusCode.INVALID_ARGUMENT
BAD_INPUTS = [
    # (name, request, status, words the message must contain)
    ("empty prompt", coordinator_pb2.GenerateRequest(prompt=""), INVALID, "empty"),
    ("neither text nor ids", coordinator_pb2.GenerateRequest(max_new_tokens=4), INVALID, "empty"),
    ("both text and ids", coordinator_pb2.GenerateRequest(prompt="x", prompt_ids=[5]), INVALID,
     "not prompt and prompt_ids"),
    ("both text and messages", coordinator_pb2.GenerateRequest(
        prompt="x", messages=[coordinator_pb2.ChatMessage(role="user", content="hi")]), INVALID,
     "not prompt and messages"),
    ("a role the chat template refuses", build_request(messages=[{"role": "robot", "content": "hi"}]), INVALID,
     "chat template refused the messages: roles are system, user and assistant, got robot"),
    ("token id past the vocabulary", req(prompt_ids=[5, 10**6]), INVALID, "vocabulary"),
    ("negative token id", req(prompt_ids=[5, -1]), INVALID, "vocabulary"),
    ("max_new_tokens 0", req(max_new_tokens=0), INVALID, "max_new_tokens"),
    ("max_new_tokens < 0", req(max_new_tokens=-5), INVALID, "max_new_tokens"),
    ("temperature < 0", req(temperature=-1.0), INVALID, "temperature"),
    ("temperature NaN", req(temperature=math.nan), INVALID, "temperature"),
    ("temperature inf", req(temperature=math.inf), INVALID, "temperature"),
    ("top_p 0", req(top_p=0.0), INVALID, "top_p"),
    ("top_p > 1", req(top_p=1.5), INVALID, "top_p"),
    ("top_p NaN", req(top_p=math.nan), INVALID, "top_p"),
    ("top_k < 0", req(top_k=-1), INVALID, "top_k"),
    ("K above the maximum", req(num_draft_tokens=17), INVALID, "num_draft_tokens"),
    ("K < 0", req(num_draft_tokens=-1), INVALID, "num_draft_tokens"),
    ("empty stop string", req(stop=[""]), INVALID, "stop[0] is empty"),
    ("too many stop strings", req(stop=[f"s{i}" for i in range(17)]), INVALID, "stop strings"),
    ("stop string too long", req(stop=["x" * 300]), INVALID, "stop[0]"),
    ("stop token id past the vocabulary", req(stop_token_ids=[10**6]), INVALID, "stop_token_ids"),
    ("prompt as long as the context", req(prompt_ids=[5] * 8192), grpc.StatusCode.OUT_OF_RANGE, "context"),
    ("prompt + max_new_tokens past the context", req(max_new_tokens=9000), grpc.StatusCode.OUT_OF_RANGE, "context"),
]


@pytest.mark.parametrize(("name", "request_", "code", "words"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_its_status_and_the_next_request_is_served(stack, client, good_output, name, request_,
                                                                  code, words):
    with pytest.raises(grpc.RpcError) as info:
        call(stack, request_)
    assert info.value.code() == code, info.value.details()
    assert words in info.value.details()
    assert client.generate(**GOOD).model_dump() == good_output


def test_bad_requests_do_not_disturb_a_generation_in_flight(stack, client):
    params = {"prompt_ids": [9, 8, 7, 6], "max_new_tokens": 120, "ignore_eos": True}
    alone = client.generate(**params).token_ids
    stream = client.generate_stream(**params)
    tokens = list(next(stream).token_ids)
    for _, request, code, _ in BAD_INPUTS:
        with pytest.raises(grpc.RpcError) as info:
            call(stack, request)
        assert info.value.code() == code
    tokens += [t for delta in stream for t in delta.token_ids]
    assert tokens == alone
    wait_for_no_sessions(stack["target"].address, stack["draft"].address)


def test_unset_max_new_tokens_shrinks_to_the_context_instead_of_failing(client):
    result = client.generate(prompt_ids=[5] * 8190, ignore_eos=True)
    assert len(result.token_ids) == 2 and result.finish_reason == "length"


def test_cli_prints_the_status_and_message_and_exits_non_zero(stack):
    out = subprocess.run(
        [sys.executable, "-m", "tandem_tools.cli", "generate", "--server", stack["coordinator"].address,
         "--prompt-ids", "5,6,7", "--max-new-tokens", "9000"],
        capture_output=True, text=True, check=False, timeout=60,
    )
    assert out.returncode != 0
    assert "OUT_OF_RANGE" in out.stderr and "context of 8192 tokens" in out.stderr


def test_requests_past_max_sessions_wait_past_max_waiting_are_refused_and_draining_refuses(tiny_dir, tmp_path):
    """A pair of its own with --max-sessions 1 --max-waiting 1: the second concurrent request waits for the
    first (FCFS) and then runs; a third is RESOURCE_EXHAUSTED; once the coordinator drains, new requests are
    UNAVAILABLE."""
    procs = start_stack(tiny_dir, tmp_path, coordinator_args=["--max-sessions", "1", "--max-waiting", "1",
                                                              "--grace-period", "60"])
    small = procs["coordinator"]
    try:
        with TandemClient(small.address, timeout=60) as client, ThreadPoolExecutor(1) as pool:
            held = client.generate_stream(prompt_ids=[5, 6, 7], max_new_tokens=5000, ignore_eos=True)
            next(held)
            waiting = pool.submit(client.generate, **GOOD)
            time.sleep(1.0)  # the second is in the queue: a third finds it full
            with pytest.raises(TandemError) as info:
                client.generate(**GOOD)
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_sessions + max_waiting=2" in info.value.details
            assert not waiting.done()
            held.close()
            assert len(waiting.result(60).token_ids) == GOOD["max_new_tokens"]
            held = client.generate_stream(prompt_ids=[5, 6, 7], max_new_tokens=5000, ignore_eos=True)
            next(held)
            small.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while health_status(small.address) != "NOT_SERVING":
                assert time.monotonic() < deadline
                time.sleep(0.02)
            with pytest.raises(TandemError) as info:
                client.generate(**GOOD)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE and "draining" in info.value.details
            held.close()
        assert small.proc.wait(30) == 0
    finally:
        stop_stack(procs)


def test_cancelled_streams_leave_no_sessions_and_memory_returns_to_its_baseline(stack):
    """1000 generations cancelled after their first delta, from 4 client threads."""
    address = stack["coordinator"].address
    pids = {name: stack[name].pid for name in ("target", "draft")}

    def cancel_after_first_delta(n: int) -> int:
        stream = client.generate_stream(prompt_ids=[5 + n % 50, 6, 7], max_new_tokens=64, ignore_eos=True)
        first = next(stream)
        stream.close()
        return len(first.token_ids)

    with TandemClient(address, timeout=60) as client, ThreadPoolExecutor(4) as pool:
        assert all(pool.map(cancel_after_first_delta, range(100)))  # warm-up: allocator, thread pools, caches
        wait_for_no_sessions(stack["target"].address, stack["draft"].address)
        baseline = {name: rss_mib(pid) for name, pid in pids.items()}
        assert all(pool.map(cancel_after_first_delta, range(1000)))
    wait_for_no_sessions(stack["target"].address, stack["draft"].address)
    after = {name: rss_mib(pid) for name, pid in pids.items()}
    for name in pids:
        assert after[name] < baseline[name] + 50, f"{name}: {baseline[name]:.0f} MiB -> {after[name]:.0f} MiB"


def test_a_second_coordinator_is_refused_by_the_services_and_leaves_nothing(stack, good_output):
    """One coordinator steps a pair: another's stream is refused, naming why, and opens no session (the first
    coordinator's sessions end with its streams: tests/test_steps.py)."""
    hidden = None
    for name, stub_class in (("target", target_pb2_grpc.TargetServiceStub), ("draft", draft_pb2_grpc.DraftServiceStub)):
        with grpc.insecure_channel(stack[name].address) as channel:
            stub = stub_class(channel)
            if name == "target":
                step = target_pb2.SessionStep(session_id="rogue", request=target_pb2.TargetRequest(
                    prefill=target_pb2.Prefill(prompt_ids=[5, 6, 7], sampling=common_pb2.SamplingParams())))
                batch = target_pb2.TargetBatch(steps=[step])
                hidden = stub.ModelInfo(target_pb2.TargetInfoRequest(), timeout=10).hidden_size
            else:
                [features] = encode_features(torch.zeros(2, 3 * hidden))
                batch = draft_pb2.DraftBatch(steps=[draft_pb2.DraftSessionStep(session_id="rogue", open=True,
                    request=draft_pb2.DraftRequest(next_tokens=[6, 7], num_draft_tokens=2, features=features))])
            with pytest.raises(grpc.RpcError) as refused:
                next(stub.Step(iter([batch]), timeout=30, metadata=[("tandem-coordinator", "rogue")]))
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "stepped by another coordinator" in refused.value.details()
    assert open_sessions(stack["target"].address, stack["draft"].address) == (0, 0)


def test_internal_services_listen_on_loopback_only_by_default(stack):
    for name in ("target", "draft", "coordinator"):
        assert stack[name].address.startswith("127.0.0.1:")
        assert listening_addresses(stack[name].port) == {"127.0.0.1"}, name


# -- the pair check at start-up --------------------------------------------------------------------


def target_info(**changes) -> target_pb2.TargetInfo:
    fields = {"vocab_size": 512, "hidden_size": 64, "num_layers": 8, "layer_ids": [2, 4, 5], "dtype": "float32",
              "max_context": 8192}
    return target_pb2.TargetInfo(**{**fields, **changes})


def draft_info(**changes) -> draft_pb2.DraftInfo:
    fields = {"vocab_size": 512, "target_hidden_size": 64, "max_target_id": 500, "dtype": "float32",
              "target_max_context": 8192}
    return draft_pb2.DraftInfo(**{**fields, **changes})


@pytest.mark.parametrize(
    ("target", "draft", "words"),
    [
        (target_info(), draft_info(vocab_size=1000), "vocabulary"),
        (target_info(), draft_info(max_target_id=600), "vocabulary: d2t maps to token 600"),
        (target_info(), draft_info(target_hidden_size=128), "hidden size"),
        (target_info(), draft_info(aux_layer_ids=[1, 3, 6]), "layer ids"),
        (target_info(layer_ids=[1, 2, 3]), draft_info(), "layer ids"),  # default ids (2, L/2, L-3) expected
        (target_info(), draft_info(dtype="bfloat16"), "dtype"),
        (target_info(), draft_info(target_max_context=4096), "context length"),
    ],
)
def test_a_mismatched_pair_is_refused_naming_the_mismatch(target, draft, words):
    with pytest.raises(PairMismatch) as info:
        check_services_pair(target, draft)
    assert words in str(info.value)


def test_a_matching_pair_passes():
    check_services_pair(target_info(), draft_info())
    check_services_pair(target_info(layer_ids=[1, 3, 6]), draft_info(aux_layer_ids=[1, 3, 6]))


class _WrongDraft(draft_pb2_grpc.DraftServiceServicer):
    def ModelInfo(self, request, context):
        return draft_info(target_hidden_size=12345, dtype="bfloat16", target_max_context=4096)


def test_the_coordinator_refuses_to_start_on_a_mismatched_pair_with_one_message(stack, tmp_path: Path):
    server = grpc.server(ThreadPoolExecutor(2))
    draft_pb2_grpc.add_DraftServiceServicer_to_server(_WrongDraft(), server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "tandem_tools.cli", "coordinator", "--target-addr", stack["target"].address,
             "--draft-addr", f"127.0.0.1:{port}", "--port", "0"],
            capture_output=True, text=True, check=False, timeout=60,
        )
    finally:
        server.stop(None)
    assert out.returncode != 0
    [line] = [line for line in out.stderr.splitlines() if "does not fit" in line]
    assert "cannot start" in line
    for words in ("hidden size", "dtype", "context length"):
        assert words in line


# -- load -------------------------------------------------------------------------------------------


def test_a_short_load_run_has_no_errors_and_only_correct_outputs(stack):
    out = subprocess.run(
        [sys.executable, "-m", "tandem_tools.cli", "load", "--server", stack["coordinator"].address, "--clients", "8",
         "--duration", "8", "--json"],
        capture_output=True, text=True, check=False, timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["requests_ok"] > 0 and report["errors"] == {} and report["wrong_outputs"] == 0
    assert report["latency_p99_s"] >= report["latency_p50_s"] > 0
    wait_for_no_sessions(stack["target"].address, stack["draft"].address)


class _LeftContext:
    """A servicer context whose client has gone (a cancel, a deadline)."""

    def __init__(self):
        self.aborted: tuple | None = None

    def is_active(self) -> bool:
        return False

    def abort(self, code, details):
        self.aborted = code, details
        raise Exception()  # noqa: TRY002 - as grpc's: a bare Exception unwinds the handler


@pytest.mark.parametrize("streaming", [False, True])
def test_a_handler_that_fails_after_its_client_left_ends_without_an_answer(streaming):
    """A handler failing after its client left has nobody to tell: it ends the RPC (CANCELLED) rather than
    answer. A unary one used to return None from the error mapping, and grpc logged "Exception serializing
    message!" with a traceback for each (five at once when a 16-request bench hit its deadline)."""
    from tandem.errors import ERRORS, _streaming, _unary
    from tandem.sessions import SessionNotFound

    def behavior(request, context):
        raise SessionNotFound("unknown target session 'a'")

    def streamed(request, context):
        yield from ()
        raise SessionNotFound("unknown target session 'a'")

    context = _LeftContext()
    with pytest.raises(Exception) as raised:
        if streaming:
            list(_streaming(streamed, ERRORS)(None, context))
        else:
            _unary(behavior, ERRORS)(None, context)
    assert type(raised.value) is Exception and context.aborted == (grpc.StatusCode.CANCELLED, "the client left")
