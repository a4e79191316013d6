"""Every request field of OpenAI's chat and completions APIs and vLLM's extensions against a running
`tandem serve --http-port`: the implemented ones do what they say, the others are a 400 naming the field
(none ignored), null is the field left out, errors carry OpenAI's string codes, unknown routes answer
JSON, /tokenize and /detokenize round-trip, and the checkpoint's generation_config.json is the default
sampling.

One stack for the module, on a copy of the tiny target whose generation_config.json sets temperature,
top_p and top_k."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
from typing import Literal

import httpx
import openai
import pytest

from coordinator.http import fields
from coordinator.http.protocol import ChatRequest, CompletionRequest, StreamOptions
from tandem.sessions import InvalidRequest
from tests.test_openai import CHATML, start_stack, stop_stack

# The checkpoint's sampling defaults, the repetition_penalty as Qwen's (applied, as vLLM applies it).
GENERATION_CONFIG = {"temperature": 0.7, "top_p": 0.8, "top_k": 5, "repetition_penalty": 1.05}
SAMPLING = dict(GENERATION_CONFIG)
MESSAGES = [{"role": "user", "content": "def main("}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# A value of each refused field that asks for something Tandem lacks.
ASKING = {
    "logit_bias": {"5": 10}, "allowed_token_ids": [1, 2], "bad_words": ["x"], "logits_processors": ["m.P"],
    "use_beam_search": True, "length_penalty": 0.5, "prompt_logprobs": 1, "spaces_between_special_tokens": False,
    "guided_whitespace_pattern": " ", "structural_tag": "{}", "priority": 1,
    "kv_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "store": True, "metadata": {"a": "b"},
    "service_tier": "flex", "functions": [TOOL["function"]], "function_call": "auto", "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low",
    "include_reasoning": False, "verbosity": "low", "web_search_options": {}, "echo": True, "chat_template": CHATML,
    "mm_processor_kwargs": {"a": 1}, "media_io_kwargs": {"video": {}}, "moderation": {"model": "omni"},
    "prompt_cache_options": {"ttl": "1h"}, "prompt_cache_retention": "24h", "prompt_embeds": "AAAA",
}
# Their neutral values, which ask for nothing: accepted, and the answer is the plain request's.
NEUTRAL = {
    "logit_bias": {}, "allowed_token_ids": [], "bad_words": [], "logits_processors": [], "use_beam_search": False,
    "length_penalty": 1.0, "spaces_between_special_tokens": True,
    "priority": 0, "kv_transfer_params": {}, "vllm_xargs": {}, "store": False, "metadata": {}, "service_tier": "auto",
    "functions": [], "function_call": "none", "modalities": ["text"],
    "include_reasoning": True, "echo": False, "mm_processor_kwargs": {}, "media_io_kwargs": {},
    "prompt_cache_options": {},
}
# Accepted identifiers that by their definition change nothing in the answer.
IDENTIFIERS = {"user": "u1", "safety_identifier": "s1", "prompt_cache_key": "k1", "cache_salt": "salt"}
STREAM_ASKING = {"include_obfuscation": True}


@pytest.fixture(scope="module")
def stack(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fields")
    target = root / "target"  # the served model's name stays "target"
    shutil.copytree(tiny_dir / "target", target)
    path = target / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**config, **GENERATION_CONFIG}))
    log = root / "serve.log"
    stack = start_stack(target, tiny_dir / "draft", log)
    yield stack
    stop_stack(stack, log)


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir / "target")


def post(stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{stack.url}{path}", json=body, timeout=120)


def chat(stack, **body) -> httpx.Response:
    return post(stack, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, **body})


def completion(stack, **body) -> httpx.Response:
    return post(stack, "/v1/completions", {"prompt": "def main(", "max_tokens": 8, **body})


def events(response: httpx.Response) -> list[dict]:
    """A stream's chunks (its server-sent events but [DONE])."""
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


def assert_400(response: httpx.Response, param: str, code: str | None = None) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert param in error["message"], error
    if code is not None:
        assert error["code"] == code, error
    return error


def test_every_field_of_the_openai_sdk_is_implemented_or_refused():
    from openai.types import completion_create_params as completion_params
    from openai.types.chat import ChatCompletionStreamOptionsParam as Options
    from openai.types.chat import completion_create_params as chat_params

    for params, model in ((chat_params.CompletionCreateParamsBase, ChatRequest),
                          (completion_params.CompletionCreateParamsBase, CompletionRequest)):
        assert set(params.__annotations__) <= set(model.model_fields) | set(model.REFUSED)
    assert set(Options.__annotations__) <= set(StreamOptions.model_fields) | set(fields.STREAM_OPTIONS)


def test_every_refused_field_has_a_value_that_asks_and_a_neutral_one():
    refused = set(fields.CHAT) | set(fields.COMPLETION)
    assert set(ASKING) == refused
    never = {name for name, rule in {**fields.CHAT, **fields.COMPLETION}.items() if rule.neutral is fields._never}
    assert set(NEUTRAL) == refused - never
    # none of them is also a field the models implement
    assert not refused & (set(ChatRequest.model_fields) | set(CompletionRequest.model_fields))


@pytest.mark.parametrize(("endpoint", "field"), [*(("chat", f) for f in sorted(fields.CHAT)),
                                                  *(("completion", f) for f in sorted(fields.COMPLETION))])
def test_a_field_tandem_lacks_is_a_400_naming_it(stack, endpoint, field):
    call = chat if endpoint == "chat" else completion
    assert_400(call(stack, **{field: ASKING[field]}), field, "unsupported_parameter")


@pytest.mark.parametrize("option", sorted(fields.STREAM_OPTIONS))
def test_a_stream_option_tandem_lacks_is_a_400_naming_it(stack, option):
    error = assert_400(chat(stack, stream=True, stream_options={option: STREAM_ASKING[option]}), "stream_options")
    assert option in error["message"]


def test_neutral_values_are_accepted_and_change_nothing(stack):
    for model, call in ((ChatRequest, chat), (CompletionRequest, completion)):
        neutral = {k: v for k, v in NEUTRAL.items() if k in model.REFUSED}
        got = call(stack, temperature=0, **neutral, **IDENTIFIERS)
        assert got.status_code == 200, got.text
        assert got.json()["choices"] == call(stack, temperature=0).json()["choices"]


def test_null_is_the_field_left_out(stack):
    """Every optional field null (as wrappers send None), on both endpoints: the answer of the request
    without them."""
    for model, call, required in ((ChatRequest, chat, "messages"), (CompletionRequest, completion, "prompt")):
        nulls = {name: None for name in (*model.model_fields, *model.REFUSED) if name != required}
        plain = call(stack, temperature=0, max_tokens=8, ignore_eos=True).json()
        got = call(stack, **{**nulls, "temperature": 0, "max_tokens": 8, "ignore_eos": True})
        assert got.status_code == 200, got.text
        assert got.json()["choices"] == plain["choices"]
        assert got.json()["usage"] == plain["usage"]
    streamed = chat(stack, temperature=0, stream=True, stream_options={"include_usage": None,
                                                                       "continuous_usage_stats": None})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")


def test_continuous_usage_stats_give_the_usage_so_far_on_every_chunk(stack):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = events(completion(stack, temperature=0, ignore_eos=True, stream=True, stream_options=options))
    so_far = [c["usage"]["completion_tokens"] for c in chunks]
    assert so_far == sorted(so_far) and so_far[-1] == 8
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {chunks[-1]["usage"]["prompt_tokens"]}
    plain = events(completion(stack, temperature=0, ignore_eos=True, stream=True,
                              stream_options={"include_usage": True}))
    assert all("usage" not in c for c in plain[:-1]) and plain[-1]["usage"] == chunks[-1]["usage"]


def test_include_stop_str_in_output_ends_the_text_after_the_stop_string(stack):
    params = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
    whole = completion(stack, **params).json()["choices"][0]["text"]
    stop = whole[10:13]
    params.update(stop=[stop], include_stop_str_in_output=True)
    got = completion(stack, **params).json()["choices"][0]
    chunks = [c["choices"][0] for c in events(completion(stack, **params, stream=True))]
    end = whole.index(stop) + len(stop)
    assert (got["text"], got["finish_reason"]) == (whole[:end], "stop")
    assert ("".join(c["text"] for c in chunks), chunks[-1]["finish_reason"]) == (whole[:end], "stop")


def test_special_tokens_in_the_text_on_request_but_not_the_token_that_ended_it(tokenizer):
    from tandem.rounds import RoundEvent
    from tandem.stats import GenerationStats
    from tandem.text import text_deltas

    ids = [*tokenizer("ab", add_special_tokens=False)["input_ids"], tokenizer.bos_token_id,
           *tokenizer("cd", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]

    def text(**options) -> str:
        rounds = iter([RoundEvent(ids[:3], GenerationStats()), RoundEvent(ids[3:], GenerationStats(), "stop")])
        return "".join(d.text for d in text_deltas(rounds, tokenizer.backend_tokenizer, **options))

    assert text() == tokenizer.decode(ids, skip_special_tokens=True)
    assert text(skip_special_tokens=False) == tokenizer.decode(ids[:-1])  # the EOS that ended it: not shown
    assert text(skip_special_tokens=False, include_stop=True) == tokenizer.decode(ids)
    assert tokenizer.bos_token in text(skip_special_tokens=False)


def test_skip_special_tokens_false_keeps_them_in_the_text(stack, tokenizer):
    for seed in range(3):
        got = completion(stack, seed=seed, temperature=2.0, top_k=0, top_p=1.0, max_tokens=48, ignore_eos=True,
                         skip_special_tokens=False, return_token_ids=True).json()["choices"][0]
        assert got["text"] == tokenizer.decode(got["token_ids"], skip_special_tokens=False)


@pytest.mark.parametrize("template", [None, CHATML])
def test_continue_final_message_and_documents_render_as_transformers_renders_them(tokenizer, template):
    from coordinator.chat import render_chat

    source = template or tokenizer.chat_template
    special = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
    for last in ("The answer is", "Trailing space ", [{"type": "text", "text": "in parts"}]):
        messages = [*MESSAGES, {"role": "assistant", "content": last}]
        plain = [*MESSAGES, {"role": "assistant", "content": last if isinstance(last, str) else "in parts"}]
        expected = tokenizer.apply_chat_template(plain, chat_template=source, tokenize=False,
                                                 continue_final_message=True)
        assert render_chat(source, messages, special, False, continue_final_message=True) == expected
    source = "{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}" + source
    documents = [{"title": "a", "text": "one"}, {"title": "b", "text": "two"}]
    expected = tokenizer.apply_chat_template(MESSAGES, chat_template=source, documents=documents, tokenize=False,
                                             add_generation_prompt=True)
    assert render_chat(source, MESSAGES, special, True, documents=documents) == expected


def test_continue_final_message_continues_the_assistants_turn(stack, tokenizer):
    from coordinator.client import TandemClient

    messages = [*MESSAGES, {"role": "assistant", "content": "    return"}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, continue_final_message=True, return_dict=False)
    with TandemClient(stack.grpc, timeout=120) as grpc_client:
        expected = grpc_client.generate(prompt_ids=list(ids), max_new_tokens=12, temperature=0.0)
    got = chat(stack, messages=messages, max_tokens=12, temperature=0, continue_final_message=True).json()
    assert (got["usage"]["prompt_tokens"], got["choices"][0]["message"]["content"]) == (len(ids), expected.text)
    closed = chat(stack, messages=messages, max_tokens=12, temperature=0).json()
    assert closed["usage"]["prompt_tokens"] > len(ids)  # without it the turn is closed and a new one opened
    assert_400(chat(stack, messages=messages, continue_final_message=True, add_generation_prompt=True),
               "continue_final_message")


def test_best_of_is_one_or_n(stack):
    for best_of in (1, 2):
        assert len(completion(stack, n=2, best_of=best_of, temperature=1.0, seed=3).json()["choices"]) == 2
    assert_400(completion(stack, n=2, best_of=3), "best_of", "unsupported_value")


def test_top_logprobs_needs_logprobs(stack):
    assert "logprobs" in assert_400(chat(stack, top_logprobs=2), "top_logprobs")["message"]
    assert chat(stack, top_logprobs=0).status_code == 200  # asks for no alternatives, as vLLM takes it
    got = chat(stack, logprobs=True, top_logprobs=2).json()["choices"][0]["logprobs"]["content"]
    assert all(len(entry["top_logprobs"]) == 2 for entry in got)


def test_a_text_part_without_text_and_a_clashing_template_keyword_are_400s(stack):
    for part in ({"type": "text"}, {"type": "text", "text": 3}):
        response = chat(stack, messages=[{"role": "user", "content": [part]}])
        assert response.status_code == 400 and "messages[0].content[0]" in response.json()["error"]["message"]
    for clash in ({"messages": []}, {"add_generation_prompt": False}, {"bos_token": "x"}, {"raise_exception": 1}):
        response = chat(stack, chat_template_kwargs=clash)
        assert response.status_code == 400 and next(iter(clash)) in response.json()["error"]["message"]
    assert chat(stack, chat_template_kwargs={"extra": "fine"}).status_code == 200
    from coordinator.chat import render_chat  # a template failing on the request's data fails that request

    with pytest.raises(InvalidRequest, match="TypeError"):
        render_chat("{{ messages[0].content + 1 }}", MESSAGES, {})


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(stack, tokenizer):
    ids = tokenizer("import os\nimport sys\n")["input_ids"]
    got = completion(stack, prompt=ids, temperature=0, truncate_prompt_tokens=3, ignore_eos=True).json()
    expected = completion(stack, prompt=ids[-3:], temperature=0, ignore_eos=True).json()
    assert got["usage"]["prompt_tokens"] == 3 and got["choices"][0]["text"] == expected["choices"][0]["text"]
    assert completion(stack, prompt=ids, truncate_prompt_tokens=-1).json()["usage"]["prompt_tokens"] == len(ids)
    assert_400(completion(stack, truncate_prompt_tokens=10**7), "truncate_prompt_tokens", "context_length_exceeded")
    assert_400(completion(stack, truncate_prompt_tokens=0), "truncate_prompt_tokens")


def test_add_special_tokens_request_id_and_tokens_as_ids(stack, tokenizer):
    for special in (True, False):
        got = completion(stack, prompt="hello", add_special_tokens=special).json()
        assert got["usage"]["prompt_tokens"] == len(tokenizer("hello", add_special_tokens=special)["input_ids"])
    assert completion(stack, request_id="abc-1").json()["id"] == "cmpl-abc-1"
    assert chat(stack, request_id="abc-2").json()["id"] == "chatcmpl-abc-2"
    got = completion(stack, temperature=0, logprobs=2, return_tokens_as_token_ids=True).json()["choices"][0]
    assert all(t.startswith("token_id:") for t in got["logprobs"]["tokens"])
    ids = [int(t.removeprefix("token_id:")) for t in got["logprobs"]["tokens"]]
    assert tokenizer.decode(ids) == got["text"]


def test_return_token_ids_gives_the_prompts_and_the_choices_ids(stack, tokenizer):
    got = completion(stack, temperature=0, ignore_eos=True, return_token_ids=True).json()["choices"][0]
    assert got["prompt_token_ids"] == tokenizer("def main(")["input_ids"]
    assert len(got["token_ids"]) == 8 and tokenizer.decode(got["token_ids"]) == got["text"]
    chunks = events(completion(stack, temperature=0, ignore_eos=True, stream=True, return_token_ids=True))
    assert [i for c in chunks for i in c["choices"][0]["token_ids"]] == got["token_ids"]
    assert [c["choices"][0].get("prompt_token_ids") for c in chunks][:2] == [got["prompt_token_ids"], None]
    whole = chat(stack, temperature=0, ignore_eos=True, return_token_ids=True).json()
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert whole["prompt_token_ids"] == list(ids)
    assert tokenizer.decode(whole["choices"][0]["token_ids"]) == whole["choices"][0]["message"]["content"]
    chunks = events(chat(stack, temperature=0, ignore_eos=True, stream=True, return_token_ids=True))
    assert chunks[0]["prompt_token_ids"] == list(ids)
    assert [i for c in chunks[1:] for i in c["choices"][0]["token_ids"]] == whole["choices"][0]["token_ids"]


def test_errors_carry_openais_string_codes(client, stack):
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert missing.value.code == "model_not_found" and missing.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="target", prompt="x", max_tokens=100_000)
    assert long.value.code == "context_length_exceeded"
    max_context = client.models.list().data[0].model_extra["max_model_len"]
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="target", prompt=[5] * max_context, max_tokens=2)
    assert long.value.code == "context_length_exceeded"
    assert_400(completion(stack, max_tokens="many"), "max_tokens", "invalid_type")
    assert post(stack, "/v1/completions", {}).json()["error"]["code"] == "missing_required_parameter"
    assert_400(completion(stack, n=0), "n", "invalid_value")
    not_json = httpx.post(f"{stack.url}/v1/completions", content=b"{not json")
    assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "invalid_json"


def test_unknown_routes_and_methods_answer_openais_error_object(stack):
    for method, path in (("POST", "/v1/responses"), ("GET", "/v1/nothing"), ("POST", "/v2/completions")):
        response = httpx.request(method, f"{stack.url}{path}", json={})
        assert response.status_code == 404 and response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "unknown_url")
        assert path in error["message"]
    wrong = httpx.get(f"{stack.url}/v1/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"


def test_tokenize_and_detokenize_round_trip(stack, client, tokenizer):
    text = "def main():\n    print('héllo ✓')\n"
    got = post(stack, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert got["tokens"] == tokenizer(text)["input_ids"] and got["count"] == len(got["tokens"])
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(got["tokens"])
    assert got["max_model_len"] == client.models.list().data[0].model_extra["max_model_len"]
    assert post(stack, "/detokenize", {"tokens": got["tokens"]}).json()["prompt"] == tokenizer.decode(got["tokens"])
    plain = post(stack, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["token_strs"] is None
    assert post(stack, "/detokenize", {"tokens": plain["tokens"]}).json()["prompt"] == text
    # a conversation counts as the chat endpoint renders it
    rendered = post(stack, "/tokenize", {"messages": MESSAGES}).json()
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert rendered["tokens"] == list(ids)
    assert rendered["count"] == chat(stack).json()["usage"]["prompt_tokens"]
    assert post(stack, "/tokenize", {"messages": MESSAGES, "tools": [TOOL]}).status_code == 200  # rendered with them
    assert_400(post(stack, "/detokenize", {"tokens": [10**7]}), "tokens")
    assert post(stack, "/tokenize", {"prompt": "x", "model": "gpt-4"}).json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{stack.url}/version").json() == {"version": importlib.metadata.version("tandem")}


def test_generation_config_is_the_default_sampling(stack):
    """An omitted (or null) temperature, top_p, top_k is the checkpoint's, as vLLM applies it."""
    for call in (completion, chat):
        def choices(call=call, **body):
            return call(stack, max_tokens=16, ignore_eos=True, **body).json()["choices"]

        differ = 0
        for seed in range(4):
            omitted = choices(seed=seed)
            assert omitted == choices(seed=seed, temperature=None, top_p=None, top_k=None) == choices(
                seed=seed, **SAMPLING)
            differ += omitted != choices(seed=seed, temperature=1.0, top_p=1.0, top_k=0)  # OpenAI's defaults
        assert differ
        assert choices(temperature=0) == choices(temperature=0, top_p=None)  # given: as given


def test_the_target_sends_its_generation_config_and_grpc_applies_it_without_sampling(stack):
    import grpc

    from coordinator.monitor import Pair
    from coordinator.server import client_request_from_pb
    from tandem.v1 import coordinator_pb2, target_pb2, target_pb2_grpc

    with grpc.insecure_channel(stack.target) as channel:
        info = target_pb2_grpc.TargetServiceStub(channel).ModelInfo(target_pb2.TargetInfoRequest(), timeout=30)
    assert {k: json.loads(info.generation_config)[k] for k in GENERATION_CONFIG} == GENERATION_CONFIG
    pair = Pair(None, info, None, None, None)
    unset = client_request_from_pb(coordinator_pb2.GenerateRequest(prompt_ids=[1, 2]), pair).generation.sampling
    assert {k: getattr(unset, k) for k in SAMPLING} == SAMPLING
    given = coordinator_pb2.GenerateRequest(prompt_ids=[1, 2], sampling={"temperature": 0.0})
    assert client_request_from_pb(given, pair).generation.sampling.greedy  # given: as given
    info.generation_config = ""
    assert client_request_from_pb(coordinator_pb2.GenerateRequest(prompt_ids=[1, 2]), pair).generation.sampling.greedy


# -- structured outputs and penalties through the front ------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def reference(tiny_dir):
    from tandem_tools.inprocess import InProcessGenerator

    return InProcessGenerator(tiny_dir / "target", tiny_dir / "draft", draft_cost=0)


def target_alone(reference, prompt_ids: list[int], max_tokens: int, **fields) -> list[int]:
    from tandem.params import GenerationRequest, SamplingParams

    sampling = SamplingParams(**{k: fields.pop(k) for k in list(fields) if k in SamplingParams.model_fields})
    request = GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=max_tokens, sampling=sampling, speculate=False,
                                **fields)
    return reference.generate(request).token_ids


@pytest.mark.parametrize(("body", "grammar"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}},
     {"kind": "json_schema", "value": json.dumps(PERSON)}),
    ({"guided_regex": "[a-z]{3,6}( [a-z]{2,5}){0,2}"}, {"kind": "regex", "value": "[a-z]{3,6}( [a-z]{2,5}){0,2}"}),
    ({"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}},
     {"kind": "choice", "value": json.dumps(["alpha", "beta", "gamma"])}),
    ({"guided_grammar": 'root ::= "(" [0-9]+ ")"'}, {"kind": "grammar", "value": 'root ::= "(" [0-9]+ ")"'}),
])
def test_greedy_structured_output_through_the_services_is_the_targets_alone(stack, reference, body, grammar):
    from tandem.params import GrammarSpec

    prompt = [17, 250, 33, 104, 9]
    got = completion(stack, prompt=prompt, max_tokens=40, temperature=0, repetition_penalty=1, return_token_ids=True,
                     **body).json()
    want = target_alone(reference, prompt, 40, grammar=GrammarSpec(**grammar))
    assert got["choices"][0]["token_ids"] == want, got


@pytest.mark.parametrize("penalty", [{"presence_penalty": 1.5}, {"frequency_penalty": 1.2},
                                     {"repetition_penalty": 1.6},
                                     {"min_p": 0.2, "temperature": 0.9, "seed": 3, "top_p": 1, "top_k": 0}])
def test_penalised_output_through_the_services_is_the_targets_alone(stack, reference, penalty):
    """Greedy with speculation; the sampled min_p target-only on both sides (a seed fixes a sampled output
    for one way of drafting: the law under speculation is tests/test_speculative_sampling.py's)."""
    prompt = [17, 250, 33, 104, 9]
    body = {"temperature": 0, "repetition_penalty": 1, **penalty}
    if "min_p" in penalty:
        body["speculate"] = False
    got = completion(stack, prompt=prompt, max_tokens=24, ignore_eos=True, return_token_ids=True, **body).json()
    want = target_alone(reference, prompt, 24, ignore_eos=True, **{k: v for k, v in body.items() if k != "speculate"})
    assert got["choices"][0]["token_ids"] == want, got


def test_min_tokens_through_the_front(stack, tokenizer):
    got = completion(stack, prompt="def main(", max_tokens=12, min_tokens=12, temperature=0,
                     stop_token_ids=list(range(1, 400))).json()
    assert got["usage"]["completion_tokens"] == 12 and got["choices"][0]["finish_reason"] == "length"
    assert_400(completion(stack, max_tokens=4, min_tokens=5), "min_tokens", "invalid_value")


@pytest.mark.parametrize(("body", "param"), [
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend"),
])
def test_a_bad_structured_output_is_a_400_naming_it(stack, body, param):
    response = chat(stack, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert param in error["message"] or error["param"] == param or (
        param in ("guided_regex", "response_format") and ("regex" in error["message"] or "schema" in
                                                           error["message"])), error


@pytest.mark.slow
def test_the_sdks_parse_gives_100_valid_answers(client):
    """client.beta.chat.completions.parse with a pydantic model: the strict JSON schema the SDK sends keeps
    every answer of the (random) tiny model valid, sampled at the checkpoint's defaults."""
    import jsonschema
    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=6)
        kind: str = Field(pattern="^(cat|dog|fish)$")
        legs: int = Field(ge=0, le=8)

    schema = Pet.model_json_schema()
    for seed in range(100):
        answer = client.beta.chat.completions.parse(model="target", messages=MESSAGES, response_format=Pet,
                                                    max_tokens=120, seed=seed)
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason == "stop", message.content
        jsonschema.validate(json.loads(message.content), schema)
        assert isinstance(message.parsed, Pet)


def test_langchain_with_structured_output(stack):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        """A city."""

        name: str = Field(max_length=8)
        population: int = Field(ge=0, le=1000)

    llm = ChatOpenAI(base_url=f"{stack.url}/v1", api_key="none", model="target", temperature=0, max_tokens=80,
                     max_retries=0)
    for method in ("json_schema", "json_mode"):
        structured = llm.with_structured_output(City if method == "json_schema" else City.model_json_schema(),
                                                method=method)
        answer = structured.invoke("Name a city as JSON.")
        if method == "json_schema":
            assert isinstance(answer, City)
        else:
            assert isinstance(answer, dict)


# -- tools ----------------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string", "maxLength": 8},
                                                                          "days": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 7}},
                                                           "required": ["city", "days"],
                                                           "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_are_returned_and_streamed(client, tool_choice):
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for seed in range(3):
        kwargs = {"model": "target", "messages": MESSAGES, "tools": [WEATHER, TIME], "tool_choice": tool_choice,
                  "max_tokens": 200, "seed": seed}
        answer = client.chat.completions.create(**kwargs)
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason == "tool_calls" and message.tool_calls, message
        for call in message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        if isinstance(tool_choice, dict):
            assert [c.function.name for c in message.tool_calls] == ["get_weather"]
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        streamed = [c for chunk in chunks for choice in chunk.choices for c in (choice.delta.tool_calls or [])]
        assert [(c.function.name, c.function.arguments) for c in streamed] == [
            (c.function.name, c.function.arguments) for c in message.tool_calls]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_tool_choice_answers_text_where_the_model_writes_no_call(client):
    answer = client.chat.completions.create(model="target", messages=MESSAGES, tools=[WEATHER], max_tokens=8,
                                            temperature=0)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content


def test_tool_calls_parse_as_vllms_hermes_and_llama3_json_parsers():
    from coordinator.http import tools

    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>' \
           '\n<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'
    content, calls = tools.parse(text, "auto", None, "hermes")
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "utc"})]
    assert len(tools.parse(text, "auto", None, "hermes", parallel=False)[1]) == 1
    content, calls = tools.parse('<|python_tag|>{"name": "get_time", "parameters": {"zone": "cet"}}', "auto", None,
                                 "llama3_json")
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"zone": "cet"}
    assert tools.parse("no call here", "auto", None, "hermes") == ("no call here", [])
    assert tools.parser_for("{{ '<tool_call>' }}") == "hermes" and tools.parser_for("<|python_tag|>") == "llama3_json"


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
])
def test_bad_tools_are_a_400_naming_them(stack, body, param):
    assert_400(chat(stack, **body), param)


def test_langchain_bind_tools(stack):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_time(zone: Literal["utc", "cet"]) -> str:
        """The time in a zone."""
        return zone

    llm = ChatOpenAI(base_url=f"{stack.url}/v1", api_key="none", model="target", temperature=0, max_tokens=60,
                     max_retries=0)
    for choice in ("required", "get_time"):
        tools = llm.bind_tools([get_time], tool_choice=choice, parallel_tool_calls=False, strict=True)
        message = tools.invoke("What time is it?")
        assert [call["name"] for call in message.tool_calls][:1] == ["get_time"], message
        assert message.tool_calls[0]["args"]["zone"] in ("utc", "cet")


def test_suffix_fills_in_the_middle_where_the_tokenizer_can(stack, tiny_dir):
    from tokenizers import AddedToken, Tokenizer

    from coordinator.http.tokens import fim_prompt

    # the tiny tokenizer has no fill-in-the-middle tokens: a 400 naming suffix
    assert_400(completion(stack, suffix="\n    return x\n"), "suffix", "unsupported_value")
    assert completion(stack, suffix="").status_code == 200  # empty: a plain completion
    tokenizer = Tokenizer.from_file(str(tiny_dir / "target" / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<|fim_prefix|>", "<|fim_suffix|>",
                                                                        "<|fim_middle|>")])
    pre, suf, mid = (tokenizer.token_to_id(t) for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))
    ids = fim_prompt(tokenizer, "def f(x):", "    return x")
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids
    assert ids == [pre, *encode("def f(x):"), suf, *encode("    return x"), mid]
