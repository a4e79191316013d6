"""The three services as real processes on loopback (`tandem serve`), compared with the in-process
reference: same tokens, same text, streaming, concurrency, long prompts, errors, deadlines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from coordinator.client import TandemClient, TandemError
from tandem.params import GenerationRequest, SamplingParams
from tandem.service import health_status
from tandem.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tandem_tools.inprocess import InProcessGenerator

TEXT_PROMPTS = ["def main(", "import os\n", "class Foo:\n    def __init__(self", "for i in range(", "# héllo wörld ✓"]


def id_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (n,), generator=g)
    return [torch.randint(2, vocab, (int(length),), generator=g).tolist() for length in lengths]


@dataclass
class Stack:
    address: str
    target: str
    draft: str
    proc: subprocess.Popen


def start_serve(tiny_dir: Path, log: Path) -> Stack:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem_tools.cli", "serve", "--target", str(tiny_dir / "target"),
         "--draft", str(tiny_dir / "draft"), "--port", "0"],
        stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "listening on" in line:
            break
    else:
        raise RuntimeError(f"tandem serve did not start: {lines} {log.read_text()[-3000:]}")
    internal = dict(part.split(" ") for part in lines[-2].split(": ", 1)[1].strip().split(", "))
    return Stack(lines[-1].rsplit(" ", 1)[1].strip(), internal["target"], internal["draft"], proc)


@pytest.fixture(scope="module")
def stack(tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    stack = start_serve(tiny_dir, log)
    yield stack
    stack.proc.send_signal(signal.SIGTERM)
    assert stack.proc.wait(60) == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def client(stack):
    with TandemClient(stack.address, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def reference(tiny_dir):
    # One torch thread beside the three service processes: on a 2-core machine a second spinning
    # worker makes every round of the reference many times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield InProcessGenerator(tiny_dir / "target", tiny_dir / "draft", draft_cost=0)  # as the services: gate off
    torch.set_num_threads(threads)


def expected(reference: InProcessGenerator, prompt, **params) -> dict:
    ids = reference.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt
    sampling = {k: params.pop(k) for k in ("temperature", "top_p", "top_k", "seed") if k in params}
    request = GenerationRequest(prompt_ids=ids, sampling=SamplingParams(**sampling), **params)
    # overlap: the servers' default while one generation runs
    return reference.generate(request, detokenize=True, overlap=True).model_dump()


def without_stats(result: dict) -> dict:
    return {key: value for key, value in result.items() if key != "stats"}


def remote(client: TandemClient, prompt, **params) -> dict:
    if isinstance(prompt, str):
        return client.generate(prompt=prompt, **params).model_dump()
    return client.generate(prompt_ids=prompt, **params).model_dump()


def test_serve_gives_the_target_cpus_of_its_own(stack):
    """With the models on the CPU, the target runs on one half of the CPUs and the draft and the
    coordinator on the other, every thread of them."""
    available = os.sched_getaffinity(0)
    if len(available) < 2:
        pytest.skip("one CPU: nothing to split")
    def alive(read, *args):  # a thread may end while we look
        try:
            return read(*args)
        except (FileNotFoundError, ProcessLookupError):
            return None

    children = [int(pid) for task in Path(f"/proc/{stack.proc.pid}/task").iterdir()
                for pid in (alive((task / "children").read_text) or "").split()]
    cpus = {}
    for pid in children:
        role = next(r for r in ("target", "draft", "coordinator") if r in Path(f"/proc/{pid}/cmdline").read_text().split("\0"))
        threads = [alive(os.sched_getaffinity, int(task.name)) for task in Path(f"/proc/{pid}/task").iterdir()]
        threads = {frozenset(t) for t in threads if t is not None}
        assert len(threads) == 1, (role, threads)  # every thread alike
        cpus[role] = threads.pop()
    assert cpus["draft"] == cpus["coordinator"]
    assert not cpus["target"] & cpus["draft"] and cpus["target"] | cpus["draft"] == available
    assert len(cpus["target"]) == (len(available) + 1) // 2


# -- same output as in-process --------------------------------------------------------------------


def test_serve_greedy_matches_in_process(client, reference):
    prompts = [*TEXT_PROMPTS, *id_prompts(7, reference.target.vocab_size)]
    for i, prompt in enumerate(prompts):
        params = {"max_new_tokens": 20 + i, "num_draft_tokens": 1 + i % 5}
        assert remote(client, prompt, **params) == expected(reference, prompt, **params), prompt


def test_serve_sampling_with_a_seed_matches_in_process(client, reference):
    for seed, prompt in enumerate([*TEXT_PROMPTS[:2], *id_prompts(2, reference.target.vocab_size, seed=1)]):
        params = {"max_new_tokens": 24, "temperature": 1.0, "top_p": 0.9, "seed": seed}
        assert remote(client, prompt, **params) == expected(reference, prompt, **params), prompt


def test_target_only_mode_matches_in_process(client, reference):
    """The same tokens, text and counts. Not always the same number of rounds: a target-only decode answers
    after 16 tokens or once its window is up (target_server/decode.py: 50 ms in-process, 250 ms for a unary
    call through the services), and 15 tokens of the tiny target took longer than 50 ms on a busy CI once."""
    params = {"max_new_tokens": 16, "speculate": False}
    got, want = remote(client, "def main(", **params), expected(reference, "def main(", **params)
    assert 1 <= got["stats"].pop("num_rounds") <= 15 and 1 <= want["stats"].pop("num_rounds") <= 15
    assert got == want
    assert got["stats"]["num_draft_tokens"] == 0


def test_grammars_and_penalties_over_grpc_give_the_targets_tokens(client, reference):
    """The gRPC request's grammar, min_tokens and penalties: greedy with speculation through the services,
    the target alone in-process."""
    from tandem.params import GrammarSpec

    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
                         "required": ["n"], "additionalProperties": False})
    cases = [({"grammar": {"json_schema": schema}}, {"grammar": GrammarSpec(kind="json_schema", value=schema)}),
             ({"grammar": {"regex": "[a-z]{2,9}"}}, {"grammar": GrammarSpec(kind="regex", value="[a-z]{2,9}")}),
             ({"grammar": {"choice": ["on", "off"]}}, {"grammar": GrammarSpec(kind="choice", value='["on", "off"]')}),
             ({"repetition_penalty": 1.5, "presence_penalty": 0.5, "frequency_penalty": 0.5, "min_tokens": 20},
              {"sampling": SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5),
               "min_tokens": 20})]
    ids = reference.tokenizer("def main(")["input_ids"]
    for remote_fields, local in cases:
        got = client.generate(prompt="def main(", max_new_tokens=24, **remote_fields)
        want = reference.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=24, speculate=False, **local))
        assert got.token_ids == want.token_ids, remote_fields
    with pytest.raises(TandemError, match="regex"):
        client.generate(prompt="def main(", max_new_tokens=4, grammar={"regex": "[a-"})


def test_cli_generate_server_json_matches_in_process(stack, reference):
    args = ["--prompt", "def main(", "--max-new-tokens", "24", "--json"]
    out = subprocess.run([sys.executable, "-m", "tandem_tools.cli", "generate", "--server", stack.address, *args],
                         capture_output=True, text=True, check=False, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == expected(reference, "def main(", max_new_tokens=24)


def test_cli_generate_server_stream_prints_the_text(stack, client):
    args = ["--prompt", "import os\n", "--max-new-tokens", "24", "--stream"]
    out = subprocess.run([sys.executable, "-m", "tandem_tools.cli", "generate", "--server", stack.address, *args],
                         capture_output=True, text=True, check=False, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == client.generate(prompt="import os\n", max_new_tokens=24).text + "\n"
    assert "finish=" in out.stderr


# -- streaming, concurrency, long prompts ---------------------------------------------------------


def test_stream_deltas_concatenate_to_the_unary_result(client):
    for params in ({"max_new_tokens": 40}, {"max_new_tokens": 30, "temperature": 1.0, "seed": 3}):
        whole = client.generate(prompt="# héllo wörld ✓", **params)
        deltas = list(client.generate_stream(prompt="# héllo wörld ✓", **params))
        assert len(deltas) > 1
        assert [t for d in deltas for t in d.token_ids] == whole.token_ids
        assert "".join(d.text for d in deltas) == whole.text
        assert all(d.finish_reason is None and d.stats is None for d in deltas[:-1])
        assert (deltas[-1].finish_reason, deltas[-1].stats) == (whole.finish_reason, whole.stats)
        assert not any(d.text.endswith("\ufffd") for d in deltas[:-1])


def test_concurrent_clients_each_get_their_own_output(stack, reference):
    prompts = id_prompts(8, reference.target.vocab_size, seed=2)
    # the output, not the stats: a generation overlaps its rounds while it runs alone (overlap_max_running), and
    # how many rounds each ran alone before the others came is the scheduler's
    wanted = [without_stats(expected(reference, p, max_new_tokens=24, num_draft_tokens=3)) for p in prompts]
    barrier = threading.Barrier(8)

    def run(prompt: list[int]) -> dict:
        with TandemClient(stack.address, timeout=120) as own:
            barrier.wait(30)  # all eight in flight together
            return without_stats(remote(own, prompt, max_new_tokens=24, num_draft_tokens=3))

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(run, prompts)) == wanted


def test_draft_trees_through_the_services_give_the_targets_tokens(stack, reference):
    """Tree requests (the draft's dynamic trees, the target's tree verify, parents relayed by the
    coordinator), several at once beside chain requests: every output is target-only's."""
    prompts = id_prompts(6, reference.target.vocab_size, seed=5)
    wanted = [expected(reference, p, max_new_tokens=20, speculate=False)["token_ids"] for p in prompts]

    def run(i: int) -> dict:
        tree = {"nodes": 10, "depth": 3, "top_k": 4} if i % 3 else None
        with TandemClient(stack.address, timeout=120) as own:
            return remote(own, prompts[i], max_new_tokens=20, num_draft_tokens=3, tree=tree)

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(run, range(6)))
    assert [r["token_ids"] for r in results] == wanted
    assert all(r["stats"]["num_tree_rounds"] > 0 for i, r in enumerate(results) if i % 3)


def test_a_4096_token_prompt_works_end_to_end(client, reference):
    # 4096 x 3 x 64 float32 features = 3 MiB: two 2 MiB chunks from target to draft via the coordinator
    prompt = id_prompts(1, reference.target.vocab_size, seed=3)[0] * 200
    prompt = prompt[:4096]
    assert len(prompt) == 4096
    params = {"max_new_tokens": 8, "num_draft_tokens": 3}
    assert remote(client, prompt, **params) == expected(reference, prompt, **params)


# -- text -----------------------------------------------------------------------------------------


def test_stop_strings_cut_the_text_and_end_with_stop(client):
    full = client.generate(prompt="def main(", max_new_tokens=48, ignore_eos=True)
    stop = full.text[20:23]
    cut = full.text.find(stop)
    result = client.generate(prompt="def main(", max_new_tokens=48, ignore_eos=True, stop=[stop, "\x00never"])
    assert result.finish_reason == "stop"
    assert result.text == full.text[:cut]
    assert result.token_ids == full.token_ids[: len(result.token_ids)]
    assert len(result.token_ids) < len(full.token_ids)
    streamed = list(client.generate_stream(prompt="def main(", max_new_tokens=48, ignore_eos=True, stop=[stop]))
    assert "".join(d.text for d in streamed) == result.text
    assert [t for d in streamed for t in d.token_ids] == result.token_ids


def test_cli_in_process_honours_stop_strings_like_the_server(stack, client, tiny_dir):
    full = client.generate(prompt="def main(", max_new_tokens=32, ignore_eos=True)
    stop = full.text[12:15]
    common = ["--prompt", "def main(", "--max-new-tokens", "32", "--ignore-eos", "--stop", stop, "--json"]
    local = ["--in-process", "--target", str(tiny_dir / "target"), "--draft", str(tiny_dir / "draft"),
             "--overlap", "on"]  # as the server by default
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the in-process run beside the services: see `reference`
    outs = [
        subprocess.run([sys.executable, "-m", "tandem_tools.cli", "generate", *where, *common],
                       capture_output=True, text=True, check=False, timeout=120, env=env)
        for where in (["--server", stack.address], local)
    ]
    assert all(o.returncode == 0 for o in outs), [o.stderr for o in outs]
    assert json.loads(outs[0].stdout) == json.loads(outs[1].stdout)
    assert json.loads(outs[0].stdout)["finish_reason"] == "stop"


# -- errors, deadlines, sessions --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"prompt": "x", "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": "x", "temperature": -1.0}, "temperature"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "num_draft_tokens": 99}, "num_draft_tokens"),
        ({"prompt": ""}, "empty"),
        ({"prompt_ids": [1, 10**6]}, "vocabulary"),
        ({"prompt": "x", "tree": {"nodes": 99}}, "tree nodes"),
    ],
)
def test_bad_requests_are_invalid_argument(client, params, message):
    with pytest.raises(TandemError) as info:
        client.generate(**params)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details


def test_cli_prints_the_status_and_exits_non_zero(stack):
    out = subprocess.run(
        [sys.executable, "-m", "tandem_tools.cli", "generate", "--server", stack.address, "--prompt", "x",
         "--max-new-tokens", "0"],
        capture_output=True, text=True, check=False, timeout=60,
    )
    assert out.returncode != 0
    assert "INVALID_ARGUMENT" in out.stderr and "max_new_tokens" in out.stderr


def open_sessions(stack: Stack) -> tuple[int, int]:
    with grpc.insecure_channel(stack.target) as t, grpc.insecure_channel(stack.draft) as d:
        target = target_pb2_grpc.TargetServiceStub(t).ModelInfo(target_pb2.TargetInfoRequest(), timeout=10)
        draft = draft_pb2_grpc.DraftServiceStub(d).ModelInfo(draft_pb2.DraftInfoRequest(), timeout=10)
    return target.num_sessions, draft.num_sessions


def wait_for_no_sessions(stack: Stack, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (sessions := open_sessions(stack)) != (0, 0):
        assert time.monotonic() < deadline, f"sessions still open (target, draft): {sessions}"
        time.sleep(0.05)


def test_deadline_cancels_the_generation_and_frees_both_sessions(stack, client):
    with pytest.raises(TandemError) as info:
        client.generate(prompt_ids=[5, 6, 7], max_new_tokens=5000, ignore_eos=True, timeout=0.5)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for_no_sessions(stack)


def test_abandoned_stream_frees_both_sessions(stack, client):
    stream = client.generate_stream(prompt_ids=[5, 6, 7], max_new_tokens=5000, ignore_eos=True)
    next(stream)
    next(stream)
    assert open_sessions(stack) == (1, 1)
    stream.close()
    wait_for_no_sessions(stack)


def test_sessions_are_released_after_generations(stack, client):
    client.generate(prompt="def main(", max_new_tokens=8)
    wait_for_no_sessions(stack, timeout=2.0)


# -- health, reflection -----------------------------------------------------------------------------


def test_every_service_reports_serving_and_offers_reflection(stack):
    wanted = {stack.address: "tandem.v1.Coordinator", stack.target: "tandem.v1.TargetService",
              stack.draft: "tandem.v1.DraftService"}
    for address, service in wanted.items():
        assert health_status(address) == "SERVING"
        assert health_status(address, service) == "SERVING"
        with grpc.insecure_channel(address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            [response] = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in response.list_services_response.service}
        assert {service, "grpc.health.v1.Health"} <= names


def test_the_coordinator_imports_no_torch():
    code = (
        "import sys, coordinator.server, coordinator.client, coordinator.scheduler, tandem.text, "
        "coordinator.http.app, coordinator.http.server, "
        "tandem_tools.serve, tandem.wire, tandem.config, tandem_tools.cli; "
        "bad = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]; "
        "assert not bad, bad"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60)
    assert out.returncode == 0, out.stderr
