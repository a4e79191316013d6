"""Bad requests against a running `tandem serve --api-key ... --http-port`: the inputs that crashed or
stalled other servers (vLLM's huge `n`, huge header, malformed tools, invalid regex; SGLang's top_logprobs
past the vocabulary) and every bound of a request, on both fronts. Each gets its clear status; beside
each, another request's greedy output is unchanged; after each, no session is left on either service;
at the end the target's whole KV budget can be reserved again (no block leaked).

One stack for the module."""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass

import grpc
import httpx
import pytest

from coordinator.client import TandemClient
from tandem.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.processes import wait_for_no_sessions
from tests.serving import KV_ENV, Served, assert_whole_kv_budget_free, serve

KEY = "bounds-key"
REFERENCE = {"prompt_ids": [7, 8, 9, 10], "max_new_tokens": 24, "ignore_eos": True}


@dataclass
class Stack:
    served: Served
    reference: list[int]  # REFERENCE's greedy output before any bad request

    def __getattr__(self, name: str):
        return getattr(self.served, name)


@pytest.fixture(scope="module")
def stack(tiny_dir, tmp_path_factory):
    served = serve(tiny_dir, tmp_path_factory.mktemp("serve") / "serve.log", ["--api-key", KEY], KV_ENV)
    with TandemClient(served.grpc, timeout=60, api_key=KEY) as client:
        reference = client.generate(**REFERENCE).token_ids
    yield Stack(served, reference)
    served.stop()


def beside_another_request(stack: Stack, bad):
    """Run `bad()` while a good request generates; the good one's output must be the reference, and no
    session may be left once both are done. Returns what `bad()` returned."""
    outcome = {}

    def good():
        with TandemClient(stack.grpc, timeout=60, api_key=KEY) as client:
            outcome["ids"] = [t for d in client.generate_stream(**REFERENCE) for t in d.token_ids]

    thread = threading.Thread(target=good)
    thread.start()
    try:
        result = bad()
    finally:
        thread.join(60)
    assert outcome.get("ids") == stack.reference
    wait_for_no_sessions(stack.target, stack.draft)
    return result


# -- HTTP -------------------------------------------------------------------------------------------

COMPLETION = {"model": "target", "prompt": "def main(", "max_tokens": 4, "temperature": 0}
CHAT = {"model": "target", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
HTTP_CASES = [
    # (what, route, body, status)
    ("huge n (CVE-2026-34756)", "/v1/completions", {**COMPLETION, "n": 10 ** 9}, 400),
    ("n past max_sessions + max_waiting", "/v1/completions", {**COMPLETION, "n": 128}, 429),
    ("batch of prompts past max_sessions + max_waiting", "/v1/completions", {**COMPLETION, "prompt": ["a"] * 1000}, 429),
    ("malformed tools (CVE-2025-48944)", "/v1/chat/completions",
     {**CHAT, "tools": [{"type": "function", "function": {"name": 123, "parameters": "x"}}]}, 400),
    ("tools not a list", "/v1/chat/completions", {**CHAT, "tools": "x"}, 400),
    ("invalid regex, guided_regex (vllm#17313)", "/v1/chat/completions", {**CHAT, "guided_regex": "(("}, 400),
    ("invalid regex, response_format", "/v1/chat/completions",
     {**CHAT, "response_format": {"type": "regex", "regex": "(("}}, 400),
    ("invalid regex, structured_outputs", "/v1/chat/completions", {**CHAT, "structured_outputs": {"regex": "(("}}, 400),
    ("top_logprobs past the vocabulary (sglang#40076)", "/v1/chat/completions",
     {**CHAT, "logprobs": True, "top_logprobs": 10 ** 6}, 400),
    ("top_logprobs at the bound", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 20}, 200),
    ("logprobs past 20", "/v1/completions", {**COMPLETION, "logprobs": 21}, 400),
    ("17 stop strings", "/v1/completions", {**COMPLETION, "stop": [str(i) for i in range(17)]}, 400),
    ("a stop string of 10k characters", "/v1/completions", {**COMPLETION, "stop": ["x" * 10_000]}, 400),
    ("logit_bias of 100k entries", "/v1/completions", {**COMPLETION, "logit_bias": {str(i): 1 for i in range(100_000)}},
     400),
    ("max_tokens 2**70", "/v1/completions", {**COMPLETION, "max_tokens": 2 ** 70}, 400),
    ("prompt past the context", "/v1/completions", {**COMPLETION, "prompt": [1] * 100_000}, 400),
    ("prompt id past the vocabulary", "/v1/completions", {**COMPLETION, "prompt": [10 ** 9]}, 400),
    ("negative prompt id", "/v1/completions", {**COMPLETION, "prompt": [-1]}, 400),
    ("seed past int64", "/v1/completions", {**COMPLETION, "seed": 2 ** 80, "temperature": 1}, 400),
    ("10k messages", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a"}] * 10_000}, 400),
    ("a role the template refuses", "/v1/chat/completions", {**CHAT, "messages": [{"role": "{{7*7}}", "content": "a"}]},
     400),
    ("an image part", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]},
     400),
    ("best_of 10**6", "/v1/completions", {**COMPLETION, "best_of": 10 ** 6}, 400),
    ("num_draft_tokens 10**6", "/v1/completions", {**COMPLETION, "num_draft_tokens": 10 ** 6}, 400),
]
RAW_BODIES = [
    ("temperature NaN", '{"model": "target", "prompt": "a", "temperature": NaN}', 400),
    ("top_p Infinity", '{"model": "target", "prompt": "a", "top_p": Infinity}', 400),
    ("JSON nested 100k deep", '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", 400),
    ("truncated JSON", '{"prompt": ', 400),
    ("a body of 9 MiB", json.dumps({**COMPLETION, "prompt": "a" * (9 << 20)}), 413),
]


@pytest.mark.parametrize(("what", "route", "body", "status"), HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
def test_a_bad_http_request_gets_its_status_and_harms_no_other(stack, what, route, body, status):
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        response = beside_another_request(stack, lambda: http.post(route, json=body))
    assert response.status_code == status, response.text
    if status != 200:
        assert response.json()["error"]["message"]


@pytest.mark.parametrize(("what", "body", "status"), RAW_BODIES, ids=[c[0] for c in RAW_BODIES])
def test_a_malformed_body_gets_its_status_and_harms_no_other(stack, what, body, status):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    with httpx.Client(base_url=stack.url, headers=headers, timeout=60) as http:
        response = beside_another_request(stack, lambda: http.post("/v1/completions", content=body.encode()))
    assert response.status_code == status, response.text
    assert response.json()["error"]["message"]


def _raw(stack: Stack, request: bytes) -> bytes:
    host, port = stack.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        return sock.recv(65536).split(b"\r\n", 1)[0]


AUTH = f"Authorization: Bearer {KEY}\r\n".encode()
RAW_REQUESTS = [
    ("a header of 1 MiB (CVE-2025-48956)", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n",
     b"400"),
    ("an authorization header of 1 MiB", b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + b"a" * (1 << 20)
     + b"\r\n\r\n", b"400"),
    ("a chunked body past 8 MiB", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + AUTH
     + b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(b"100000\r\n" + b"a" * (1 << 20) + b"\r\n" for _ in range(9))
     + b"0\r\n\r\n", b"413"),
    ("a Content-Length of 10 GB", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + AUTH
     + b"Content-Length: 10000000000\r\n\r\n{}", b"413"),
]


@pytest.mark.parametrize(("what", "request_bytes", "status"), RAW_REQUESTS, ids=[c[0] for c in RAW_REQUESTS])
def test_an_oversized_request_is_refused_before_it_is_read(stack, what, request_bytes, status):
    line = beside_another_request(stack, lambda: _raw(stack, request_bytes))
    assert line.split(b" ")[1] == status, line


# -- gRPC -------------------------------------------------------------------------------------------

R = coordinator_pb2.GenerateRequest
S = common_pb2.SamplingParams
IDS = [1, 2]
GRPC_CASES = [
    ("prompt id past the vocabulary", R(prompt_ids=[10 ** 9], max_new_tokens=2), "INVALID_ARGUMENT"),
    ("negative prompt id", R(prompt_ids=[-1], max_new_tokens=2), "INVALID_ARGUMENT"),
    ("max_new_tokens past the context", R(prompt_ids=IDS, max_new_tokens=2 ** 31 - 1), "OUT_OF_RANGE"),
    ("max_new_tokens 0", R(prompt_ids=IDS, max_new_tokens=0), "INVALID_ARGUMENT"),
    ("17 stop strings", R(prompt_ids=IDS, max_new_tokens=2, stop=[str(i) for i in range(17)]), "INVALID_ARGUMENT"),
    ("a stop string of 10k characters", R(prompt_ids=IDS, max_new_tokens=2, stop=["x" * 10_000]), "INVALID_ARGUMENT"),
    ("stop ids past the vocabulary", R(prompt_ids=IDS, max_new_tokens=2, stop_token_ids=range(10 ** 5)),
     "INVALID_ARGUMENT"),
    ("num_draft_tokens 10**6", R(prompt_ids=IDS, max_new_tokens=2, num_draft_tokens=10 ** 6), "INVALID_ARGUMENT"),
    ("a tree of 10**6 nodes", R(prompt_ids=IDS, max_new_tokens=2, tree=common_pb2.TreeParams(nodes=10 ** 6)),
     "INVALID_ARGUMENT"),
    ("temperature NaN", R(prompt_ids=IDS, max_new_tokens=2, sampling=S(temperature=float("nan"))), "INVALID_ARGUMENT"),
    ("top_p 0", R(prompt_ids=IDS, max_new_tokens=2, sampling=S(temperature=1, top_p=0)), "INVALID_ARGUMENT"),
    ("top_k past the vocabulary", R(prompt_ids=IDS, max_new_tokens=2, sampling=S(temperature=1, top_k=10 ** 9)), "OK"),
    ("logprobs past the vocabulary", R(prompt_ids=IDS, max_new_tokens=2, sampling=S(logprobs=10 ** 6)),
     "INVALID_ARGUMENT"),
    ("an empty prompt", R(max_new_tokens=2), "INVALID_ARGUMENT"),
    ("text and ids both", R(prompt="a", prompt_ids=[1], max_new_tokens=2), "INVALID_ARGUMENT"),
    ("100k messages", R(messages=[coordinator_pb2.ChatMessage(role="user", content="y")] * 100_000, max_new_tokens=2),
     "OUT_OF_RANGE"),
    ("a message past 16 MiB", R(prompt="a" * (17 << 20), max_new_tokens=2), "RESOURCE_EXHAUSTED"),
]
METADATA_CASES = [
    ("metadata of 1 MiB", (("x-big", "a" * (1 << 20)),)),
    ("10k metadata entries", tuple((f"x-{i}", "a") for i in range(10_000))),
]


@pytest.mark.parametrize(("what", "request_pb", "code"), GRPC_CASES, ids=[c[0] for c in GRPC_CASES])
def test_a_bad_grpc_request_gets_its_status_and_harms_no_other(stack, what, request_pb, code):
    def call() -> str:
        with grpc.insecure_channel(stack.grpc, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
            try:
                coordinator_pb2_grpc.CoordinatorStub(channel).Generate(
                    request_pb, metadata=(("authorization", f"Bearer {KEY}"),), timeout=60)
            except grpc.RpcError as exc:
                assert exc.details()
                return exc.code().name
            return "OK"

    assert beside_another_request(stack, call) == code


@pytest.mark.parametrize(("what", "metadata"), METADATA_CASES, ids=[c[0] for c in METADATA_CASES])
def test_oversized_metadata_is_refused(stack, what, metadata):
    def call() -> grpc.StatusCode:
        with grpc.insecure_channel(stack.grpc) as channel, pytest.raises(grpc.RpcError) as exc:
            coordinator_pb2_grpc.CoordinatorStub(channel).Generate(
                R(prompt_ids=IDS, max_new_tokens=2), metadata=(("authorization", f"Bearer {KEY}"), *metadata),
                timeout=60)
        return exc.value.code()

    assert beside_another_request(stack, call) == grpc.StatusCode.RESOURCE_EXHAUSTED


# -- nothing left behind ----------------------------------------------------------------------------


def test_the_whole_kv_budget_is_free_after_the_bad_requests(stack):
    assert_whole_kv_budget_free(stack.served, KEY)


def test_alternatives_never_go_past_the_vocabulary():
    """A target of fewer tokens than a request's top_logprobs answers with all of them (SGLang's scheduler died)."""
    import torch

    from target_server.acceptance import token_logprobs

    out = token_logprobs(torch.randn(2, 5), [1, 4], top=20)
    assert [len(lp.top_ids) for lp in out] == [5, 5]


def test_a_huge_prompt_text_is_refused_without_tokenizing_all_of_it(stack):
    """15 MiB of text took the coordinator 35 s of tokenizing to refuse; only a context's worth is read now."""
    import time

    text = "def main(): pass\n" * ((15 << 20) // 17)
    with grpc.insecure_channel(stack.grpc, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as exc:
            coordinator_pb2_grpc.CoordinatorStub(channel).Generate(
                R(prompt=text, max_new_tokens=2), metadata=(("authorization", f"Bearer {KEY}"),), timeout=60)
        took = time.monotonic() - started
    assert exc.value.code() == grpc.StatusCode.OUT_OF_RANGE and "already" in exc.value.details()
    assert took < 5, f"{took:.1f}s"
    wait_for_no_sessions(stack.target, stack.draft)
