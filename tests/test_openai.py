"""The OpenAI-compatible HTTP front (coordinator/http/) of a running `tandem serve --http-port`, called
with the real `openai` client: the same text as the gRPC path, streaming, n samples, logprobs from the
target, stop strings, seeds, every error class, and a client that leaves freeing both sessions.

One stack for the module; the drain test stops it, last."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import torch

from coordinator.client import TandemClient
from tests.processes import open_sessions, wait_for_no_sessions

PROMPTS = ["def main(", "import os\n", "class Foo:\n    def __init__(self", "# héllo wörld ✓"]
MAX_SESSIONS = 4  # the coordinator's: running; more wait, up to MAX_WAITING, then 429
MAX_WAITING = 2


@dataclass
class Stack:
    url: str  # http://HOST:PORT
    grpc: str
    target: str
    draft: str
    proc: subprocess.Popen


def start_stack(target: Path, draft: Path, log: Path, env: dict[str, str] | None = None) -> Stack:
    """`tandem serve` of this pair with the HTTP front, up and serving."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem_tools.cli", "serve", "--target", str(target), "--draft", str(draft),
         "--port", "0", "--http-port", "0"],
        stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env={**os.environ, **(env or {})},
    )
    lines = {}
    for line in proc.stdout:
        if line.startswith("tandem serve: "):
            body = line.removeprefix("tandem serve: ").strip()
            if body.startswith("target "):
                lines.update(part.split(" ") for part in body.split(", "))
            elif body.startswith("OpenAI-compatible HTTP on "):
                lines["url"] = body.rsplit(" ", 1)[1].removesuffix("/v1")
            elif body.startswith("listening on "):
                lines["grpc"] = body.rsplit(" ", 1)[1]
                break
    else:
        raise RuntimeError(f"tandem serve did not start: {log.read_text()[-3000:]}")
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return Stack(lines["url"], lines["grpc"], lines["target"], lines["draft"], proc)


def stop_stack(stack: Stack, log: Path) -> None:
    if stack.proc.poll() is None:
        stack.proc.send_signal(signal.SIGTERM)
    assert stack.proc.wait(60) == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def stack(tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    stack = start_stack(tiny_dir / "target", tiny_dir / "draft", log,
                        {"TANDEM_COORDINATOR_MAX_SESSIONS": str(MAX_SESSIONS),
                         "TANDEM_COORDINATOR_MAX_WAITING": str(MAX_WAITING)})
    yield stack
    stop_stack(stack, log)


@pytest.fixture(scope="module")
def client(stack):
    # no retries: a 429 or a 503 is what the test looks at
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def grpc_client(stack):
    with TandemClient(stack.grpc, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir / "target")


CHATML = ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
NAMESPACED = ("{% set ns = namespace(system='') %}{% for m in messages %}{% if m.role == 'system' %}"
              "{% set ns.system = m.content %}{% continue %}{% endif %}[{{ m.role }}] {{ m.content | tojson }}\n"
              "{% endfor %}{{ ns.system }}{% if add_generation_prompt %}[assistant]{% endif %}{{ eos_token }}")


@pytest.mark.parametrize("template", [None, CHATML, NAMESPACED])
def test_chat_templates_render_as_transformers_renders_them(tokenizer, template):
    from coordinator.chat import render_chat

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo <b>\"x\"</b>  "},
                {"role": "assistant", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "and?"}]}]
    source = template or tokenizer.chat_template
    plain = [{**m, "content": m["content"] if isinstance(m["content"], str) else "and?"} for m in messages]
    for generation_prompt in (True, False):
        expected = tokenizer.apply_chat_template(plain, chat_template=source, tokenize=False,
                                                 add_generation_prompt=generation_prompt)
        special = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
        assert render_chat(source, messages, special, generation_prompt) == expected


def test_chat_template_setting_reads_a_file_or_takes_the_template_itself(tmp_path):
    from tandem.config import ConfigError, CoordinatorSettings, load_settings

    path = tmp_path / "chat.jinja"
    path.write_text(CHATML)
    for given in (str(path), CHATML):
        assert load_settings(CoordinatorSettings, target_addr="a:1", chat_template=given).chat_template == CHATML
    with pytest.raises(ConfigError, match="neither a file nor a jinja2 template"):
        load_settings(CoordinatorSettings, target_addr="a:1", chat_template=str(tmp_path / "missing.jinja"))


def test_spec_metrics_are_vllms_fields_from_the_round_counts():
    from coordinator.http.protocol import spec_metrics
    from tandem.stats import GenerationStats

    one = GenerationStats(num_rounds=5, num_draft_tokens=15, num_accepted_tokens=6, accepted_per_position=[3, 2, 1])
    two = GenerationStats(num_rounds=2, num_draft_tokens=2, num_accepted_tokens=1, accepted_per_position=[1])
    spec = spec_metrics([one, two])["speculative_decoding"]
    assert spec == {"num_spec_steps": 7, "num_draft_tokens": 17, "num_accepted_draft_tokens": 7,
                    "mean_acceptance_length": 2.0, "draft_acceptance_rate": 7 / 17,
                    "acceptance_histogram": [2 + 1, 1 + 1, 1, 1], "num_spec_tokens": 3,
                    "accepted_per_position": [4, 2, 1]}
    assert sum(j * n for j, n in enumerate(spec["acceptance_histogram"])) == spec["num_accepted_draft_tokens"]


def test_models_lists_the_target_by_its_directory_name(client):
    assert [m.id for m in client.models.list().data] == ["target"]


def test_health_and_metrics_on_the_same_port(stack, client):
    client.completions.create(model="target", prompt="x", max_tokens=2)
    assert httpx.get(f"{stack.url}/health").status_code == 200
    metrics = httpx.get(f"{stack.url}/metrics").text
    assert 'tandem:request_success_total{finished_reason="length"}' in metrics
    assert "tandem:spec_decode_num_draft_tokens_total" in metrics
    # the same counters under vLLM's names, which `vllm bench serve` reads for its acceptance figures
    ours = {line.split(" ")[0].removeprefix("tandem:"): line.split(" ")[1] for line in metrics.splitlines()
            if line.startswith("tandem:spec_decode")}
    theirs = {line.split(" ")[0].removeprefix("vllm:"): line.split(" ")[1] for line in metrics.splitlines()
              if line.startswith("vllm:spec_decode")}
    assert ours and ours == theirs
    assert "# TYPE vllm:spec_decode_num_drafts_total counter" in metrics


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_is_the_grpc_paths_text(client, grpc_client, tokenizer, prompt):
    expected = grpc_client.generate(prompt=prompt, max_new_tokens=24, temperature=0.0)
    got = client.completions.create(model="target", prompt=prompt, max_tokens=24, temperature=0)
    choice = got.choices[0]
    assert (choice.text, choice.finish_reason) == (expected.text, expected.finish_reason)
    assert got.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    assert got.usage.completion_tokens == len(expected.token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_greedy_chat_is_the_grpc_paths_text_on_the_rendered_template(client, grpc_client, tokenizer):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def main("}]
    # the reference rendering: transformers' own apply_chat_template on the target's tokenizer
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = grpc_client.generate(prompt_ids=list(ids), max_new_tokens=24, temperature=0.0)
    got = client.chat.completions.create(model="target", messages=messages, max_completion_tokens=24, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == expected.text
    assert got.choices[0].finish_reason == expected.finish_reason
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), len(expected.token_ids))


def test_grpc_messages_are_rendered_as_transformers_renders_them(grpc_client, tokenizer):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "import os\n"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = grpc_client.generate(prompt_ids=list(ids), max_new_tokens=16, temperature=0.0)
    got = grpc_client.generate(messages=messages, max_new_tokens=16, temperature=0.0)
    assert (got.token_ids, got.text) == (expected.token_ids, expected.text)


def test_streamed_chat_concatenates_to_the_whole_answer_with_usage_and_spec_metrics(client):
    params = {"model": "target", "messages": [{"role": "user", "content": "import os\n"}], "max_tokens": 32,
                  "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**params)
    chunks = list(client.chat.completions.create(**params, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 32 == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    spec = last.model_extra["metrics"]["speculative_decoding"]
    assert spec["num_spec_steps"] == sum(spec["acceptance_histogram"])
    assert spec["num_accepted_draft_tokens"] == sum(j * n for j, n in enumerate(spec["acceptance_histogram"]))
    assert spec["num_draft_tokens"] > 0  # the draft proposed (the tiny head's are rarely accepted)
    # every round commits its accepted drafts and one token of the target's own (the prefill one more)
    assert 1 + spec["num_spec_steps"] + spec["num_accepted_draft_tokens"] >= 32


def test_streamed_completion_concatenates_to_the_whole_text(client):
    params = {"model": "target", "prompt": "for i in range(", "max_tokens": 40, "temperature": 0}
    whole = client.completions.create(**params)
    chunks = list(client.completions.create(**params, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert "speculative_decoding" in chunks[-1].model_extra["metrics"]  # on the last chunk, as vLLM sends it


def test_n_samples_are_independent_and_a_seed_repeats_them(client):
    params = {"model": "target", "prompt": "def main(", "max_tokens": 16, "temperature": 1.0, "seed": 7, "n": 3,
                  "extra_body": {"ignore_eos": True}}
    first = client.completions.create(**params)
    again = client.completions.create(**params)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # independent samples, not one repeated
    # sample i is seeded seed + i: the same as a single request with that seed
    single = client.completions.create(**{**params, "n": 1, "seed": 8})
    assert single.choices[0].text == texts[1]
    assert first.usage.completion_tokens == 3 * 16  # the prompt once, the completions of all three
    assert first.usage.prompt_tokens == single.usage.prompt_tokens


def test_streamed_n_samples_each_end_once(client):
    chunks = list(client.chat.completions.create(
        model="target", messages=[{"role": "user", "content": "x = "}], max_tokens=8, temperature=1.0, seed=3, n=2,
        stream=True))
    ends = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert ends == [0, 1]


def test_completion_logprobs_are_the_targets_log_softmax(client, grpc_client, hf_target, tokenizer):
    got = client.completions.create(model="target", prompt="import os\n", max_tokens=12, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    prompt = tokenizer("import os\n")["input_ids"]
    generated = grpc_client.generate(prompt="import os\n", max_new_tokens=12, temperature=0.0,
                                     ignore_eos=True).token_ids  # the same tokens (greedy)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert lp.tokens == [tokenizer.decode([t]) for t in generated]
    with torch.no_grad():
        logits = hf_target(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]  # [12, V]
    reference = torch.log_softmax(logits.float(), -1)
    for i, (value, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs, strict=True)):
        assert value == pytest.approx(reference[i, generated[i]].item(), abs=1e-4)
        best = reference[i].topk(3).values.tolist()  # greedy: the token is the likeliest
        assert max(top.values()) == pytest.approx(best[0], abs=1e-4)
        # (two tokens may show as the same text, "\ufffd": a dict keeps one of them)
        assert all(any(v == pytest.approx(b, abs=1e-4) for b in best) for v in top.values())
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_with_top_alternatives(client):
    got = client.chat.completions.create(model="target", messages=[{"role": "user", "content": "def f("}],
                                         max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
    streamed = client.chat.completions.create(model="target", messages=[{"role": "user", "content": "def f("}],
                                              max_tokens=6, temperature=0, logprobs=True, top_logprobs=2, stream=True)
    tokens = [e.token for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]


def test_no_logprobs_unless_asked(client):
    got = client.completions.create(model="target", prompt="x", max_tokens=4, temperature=0)
    assert got.choices[0].logprobs is None


def test_stop_strings_cut_the_text_and_end_with_stop(client):
    whole = client.completions.create(model="target", prompt="def main(", max_tokens=40, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    stop = whole[10:13]
    cut = whole[: whole.index(stop)]
    for stream in (False, True):
        for stops in (stop, [stop, "\x00never"]):
            got = client.completions.create(model="target", prompt="def main(", max_tokens=40, temperature=0,
                                            stop=stops, stream=stream, extra_body={"ignore_eos": True})
            if stream:
                chunks = list(got)
                text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
            else:
                text, finish = got.choices[0].text, got.choices[0].finish_reason
            assert (text, finish) == (cut, "stop")


def test_ignore_eos_generates_max_tokens(client):
    got = client.completions.create(model="target", prompt="x", max_tokens=50, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 50 and got.choices[0].finish_reason == "length"


def test_unknown_fields_are_ignored_and_user_too(client):
    got = client.completions.create(model="target", prompt="x", max_tokens=3, temperature=0, user="someone",
                                    extra_body={"no_such_field": {"a": 1}, "another": 3})
    assert got.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "stop": 3}, "stop"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": ""}, "prompt"),
    ({}, "prompt"),
])
def test_wrong_types_and_values_are_400_naming_the_field(stack, body, param):
    response = httpx.post(f"{stack.url}/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and isinstance(error["code"], str)
    assert param in error["message"] or param == "prompt"


def test_error_classes_map_to_their_http_status(client, stack):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context"):  # OUT_OF_RANGE
        client.completions.create(model="target", prompt="x", max_tokens=100_000)
    with pytest.raises(openai.BadRequestError, match="vocabulary"):  # INVALID_ARGUMENT from the pair
        client.completions.create(model="target", prompt=[1, 2, 10**6], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="roles"):  # the template's raise_exception
        client.chat.completions.create(model="target", messages=[{"role": "robot", "content": "x"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="only text"):
        client.chat.completions.create(model="target", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert len(client.completions.create(model="target", prompt="x", max_tokens=2, n=MAX_SESSIONS + 1).choices) == 5
    with pytest.raises(openai.RateLimitError, match="in flight"):  # RESOURCE_EXHAUSTED: running and waiting full
        client.completions.create(model="target", prompt="x", max_tokens=2, n=MAX_SESSIONS + MAX_WAITING + 1)
    assert httpx.post(f"{stack.url}/v1/completions", content=b"{not json").status_code == 400


def test_a_client_that_leaves_mid_stream_frees_both_sessions(stack):
    body = {"prompt": "def main(", "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{stack.url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert open_sessions(stack.target, stack.draft)[0] == 1  # generating
    wait_for_no_sessions(stack.target, stack.draft)  # left: the coordinator cancelled both sessions


def test_a_client_that_leaves_a_whole_request_frees_both_sessions(stack):
    body = {"prompt": "def main(", "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "n": 2}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{stack.url}/v1/completions", json=body, timeout=1.0)
    wait_for_no_sessions(stack.target, stack.draft)


def test_bench_openai_drives_the_front_beside_the_grpc_path(stack, tokenizer):
    from tandem_tools.bench.openai import GrpcChat, OpenAIChat, openai_table, run_openai_bench

    runners = [OpenAIChat(stack.url, "target"), GrpcChat(stack.grpc, lambda m: list(tokenizer.apply_chat_template(
        m, add_generation_prompt=True, tokenize=True, return_dict=False)))]
    try:
        results = run_openai_bench(runners, [[{"role": "user", "content": "def f("}]], [2], 8, 12, 0.0,
                                   echo=lambda m: None)
    finally:
        for runner in runners:
            runner.close()
    assert [(r["path"], r["requests"], r["generated_tokens"]) for r in results] == [
        ("openai-http", 8, 96), ("grpc", 8, 96)]  # ignore_eos: max_tokens each, as the servers counted them
    assert all(r["ttft_mean_ms"] > 0 and r["tpot_mean_ms"] > 0 for r in results)
    assert "| openai-http | 2 | 8 |" in openai_table(results)


def test_health_is_503_while_the_coordinator_connects(tmp_path):
    """No target yet: the HTTP front answers at once, /health and every API call with 503."""
    from tests.processes import Proc

    coordinator = Proc("coordinator", ["--target-addr", "127.0.0.1:9", "--http-port", "0"], tmp_path)
    try:
        coordinator.wait_address()
        http = coordinator.announce.with_name(coordinator.announce.name + ".http")
        deadline = time.monotonic() + 30
        while not http.is_file():
            assert time.monotonic() < deadline, coordinator.log()
            time.sleep(0.05)
        url = http.read_text().strip()
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "connecting" in health.text
        models = httpx.get(f"{url}/v1/models")
        assert models.status_code == 503 and models.json()["error"]["code"] == "service_unavailable"
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "x"})
        assert refused.status_code == 503, refused.text
    finally:
        coordinator.kill()


def test_draining_answers_503_while_in_flight_requests_finish(stack, client):
    """Last: stops the stack. SIGTERM drains the coordinator; a stream already running finishes."""
    body = {"prompt": "x", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{stack.url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        next(lines)
        stack.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(f"{stack.url}/health").status_code != 503:
            assert time.monotonic() < deadline, "health never went 503"
            time.sleep(0.05)
        with pytest.raises(openai.InternalServerError, match="draining") as refused:
            client.completions.create(model="target", prompt="x", max_tokens=2)
        assert refused.value.status_code == 503
        assert [line for line in lines if line][-1] == "data: [DONE]"  # the one in flight ran to its end
    assert stack.proc.wait(60) == 0


def test_bench_reads_vllm_custom_chat_jsonl(tmp_path):
    from tandem_tools.bench.openai import load_conversations

    path = tmp_path / "chats.jsonl"
    path.write_text('{"prompt": "hello"}\n'
                    '{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}\n'
                    '{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}\n')
    assert load_conversations(Path(path)) == [
        [{"role": "user", "content": "hello"}],
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        [{"role": "user", "content": "q"}],
    ]


def test_the_served_name_is_the_targets_as_last_seen_while_it_is_marked_down():
    """A target the monitor marks down (late health checks) while a request runs must not turn that request's
    answer into a 500: the front names the model from the services as last seen, and only a coordinator that
    never saw a target refuses (503)."""
    from types import SimpleNamespace

    from coordinator.http.app import Front
    from tandem.errors import Abort

    def down(patience: float = 0.0):
        raise Abort(grpc.StatusCode.UNAVAILABLE, "the target service is unavailable")

    seen = SimpleNamespace(target_info=SimpleNamespace(model="/models/target-8b"))
    front = Front(SimpleNamespace(monitor=SimpleNamespace(current=seen), pair=down))
    assert front.model_name() == "target-8b"
    with pytest.raises(Abort):
        Front(SimpleNamespace(monitor=SimpleNamespace(current=None), pair=down)).model_name()
