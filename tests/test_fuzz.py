"""Property-based fuzzing of the fronts and of the target's step stream, bounded in time (derandomized, a
fixed number of cases each): schemathesis from the HTTP front's OpenAPI document (coordinator/http/openapi.py),
valid and invalid bodies; hypothesis for the coordinator's GenerateRequest and for the target's Session
messages. No case may be a server error (HTTP 5xx, INTERNAL, UNKNOWN); afterwards the stack still serves
the same greedy output, and no session and no KV block is left (counted).

One stack for the module; the fuzzers' case counts go to the terminal (-s) and to fuzz-counts.json."""

from __future__ import annotations

import json
import time

import grpc
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.client import TandemClient
from coordinator.http.app import Front
from coordinator.http.openapi import openapi_schema
from tandem.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, target_pb2, target_pb2_grpc
from tests.serving import KV_ENV, assert_whole_kv_budget_free, serve

KEY = "fuzz-key"
VOCAB = 512  # the tiny pair's
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.filter_too_much, HealthCheck.data_too_large])
# Generations stay short (a case is a request, not a benchmark): the bounds of these are tests/test_bounds.py's.
MAX_GENERATED = 8
REFERENCE = {"prompt_ids": [7, 8, 9, 10], "max_new_tokens": 16, "ignore_eos": True}
COUNTS: dict[str, dict] = {}  # what each fuzzer sent: cases, and how many got each status


@pytest.fixture(scope="module")
def stack(tiny_dir, tmp_path_factory):
    served = serve(tiny_dir, tmp_path_factory.mktemp("serve") / "serve.log", ["--api-key", KEY], KV_ENV)
    with TandemClient(served.grpc, timeout=60, api_key=KEY) as client:
        served.reference = client.generate(**REFERENCE).token_ids
    yield served
    served.stop()


# What clients mostly send: the "core" pass fuzzes these alone (the model's own name), where the whole
# document's random values of every optional field are mostly refused (unsupported fields, another model).
CORE_FIELDS = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
               "n", "stop", "seed", "stream", "stream_options", "logprobs", "top_logprobs", "ignore_eos", "user"}


def _fuzz_schema(core: bool = False) -> dict:
    """The front's document with the generated lengths capped (MAX_GENERATED) and no more samples than 4;
    `core`: the request bodies with CORE_FIELDS only, the model named as the stack serves it."""
    schema = openapi_schema(Front(None).app().routes)
    for name in ("CompletionRequest", "ChatRequest"):
        body = schema["components"]["schemas"][name]
        if core:
            body["properties"] = {k: v for k, v in body["properties"].items() if k in CORE_FIELDS}
            body["properties"]["model"] = {"const": "target"}
            body["required"] = [k for k in body.get("required", []) if k in body["properties"]]
            body["additionalProperties"] = False
        props = body["properties"]
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                props[field] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": MAX_GENERATED}, {"type": "null"}]}
        props["n"] = {**props["n"], "maximum": 4}
    if core:  # the roles the chat templates know, text content
        message = schema["components"]["schemas"]["ChatMessage"]
        message["properties"].update(role={"enum": ["system", "user", "assistant"]}, content={"type": "string"})
        message["required"] = ["role", "content"]
        message["additionalProperties"] = False
    return schema


def _capped(case):
    """A body that names no length gets MAX_GENERATED (a chat's default is the rest of the context)."""
    if isinstance(case.body, dict) and case.body.get("max_tokens") is None \
            and case.body.get("max_completion_tokens") is None:
        case.body["max_tokens"] = MAX_GENERATED
    return case


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "core"), [(schemathesis.GenerationMode.POSITIVE, True),
                                            (schemathesis.GenerationMode.POSITIVE, False),
                                            (schemathesis.GenerationMode.NEGATIVE, False)],
                         ids=["core", "valid", "invalid"])
def test_the_http_front_answers_every_generated_request_without_a_server_error(stack, mode, core):
    document = _fuzz_schema(core)
    schema = schemathesis.openapi.from_dict(document)
    session = requests.Session()
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            if (mode == schemathesis.GenerationMode.NEGATIVE or core) and "requestBody" not in operation:
                continue  # nothing to make invalid, or to narrow
            statuses: list[int] = []
            _fuzzer(schema[path][method.upper()].as_strategy(generation_mode=mode), stack.url, session, statuses)()
            COUNTS[f"http {'core' if core else mode.value} {method.upper()} {path}"] = _tally(statuses)
    _still_serving(stack)


def _fuzzer(cases, url: str, session: requests.Session, statuses: list[int]):
    """One operation's fuzzer: each case with the key, never a server error, an OpenAI error object on a refusal."""

    @FUZZ
    @given(case=cases.map(_capped))
    def call(case):
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {KEY}"}  # the key, not a made-up one
        response = case.call(base_url=url, session=session, timeout=60)
        assert response.status_code < 500, (case.body, response.text[:500])
        if response.status_code >= 400 and "application/json" in str(response.headers.get("content-type")):
            assert response.json()["error"]["message"], response.text
        statuses.append(response.status_code)

    return call


def _mostly(common, rare):
    """`common` three times in four, else `rare` (st.one_of does not weigh a strategy given twice)."""
    return st.integers(0, 3).flatmap(lambda i: rare if i == 3 else common)


def _ids(low: int = -3, high: int = VOCAB + 3):
    """Token ids, mostly in the vocabulary (so that a case reaches past validation), now and then anything."""
    valid = st.lists(st.integers(max(low, 0), min(high, VOCAB - 1)), max_size=24)
    wild = st.lists(st.one_of(st.integers(low, high), st.sampled_from([-(2 ** 31), 2 ** 31 - 1])), max_size=24)
    return _mostly(valid, wild)


def _sampling():
    """Sampling parameters, mostly sensible, now and then anything a float or an int can hold."""
    wild = st.floats(allow_nan=True, allow_infinity=True)
    sensible = st.builds(common_pb2.SamplingParams, temperature=st.floats(0, 2), top_k=st.integers(0, 600),
                         top_p=st.floats(0.01, 1), seed=st.integers(0, 2 ** 32), logprobs=st.integers(0, 20))
    anything = st.builds(common_pb2.SamplingParams, temperature=st.one_of(st.just(0.0), wild),
                         top_k=st.integers(-(2 ** 31), 2 ** 31 - 1), top_p=wild,
                         seed=st.integers(-(2 ** 63), 2 ** 63 - 1), logprobs=st.integers(-3, 40))
    return _mostly(sensible, anything)


def _generate_request():
    lengths = _mostly(st.integers(1, MAX_GENERATED), st.one_of(st.integers(-3, 0), st.sampled_from([8193, 2 ** 31 - 1])))
    messages = st.builds(coordinator_pb2.ChatMessage, role=_mostly(st.just("user"), st.sampled_from(["assistant",
                         "system", "tool", "x"])), content=st.text(max_size=40))
    tree = _mostly(st.builds(common_pb2.TreeParams, nodes=st.integers(1, 16), depth=st.integers(1, 4),
                             top_k=st.integers(1, 4)),
                   st.builds(common_pb2.TreeParams, nodes=st.integers(-3, 80), depth=st.integers(-3, 20),
                             top_k=st.integers(-3, 20)))
    # mostly one prompt source, as a client sends it; now and then several, or none, or empty ones
    one_source = st.one_of(st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=60)}),
                           st.fixed_dictionaries({"prompt_ids": st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                                         max_size=24)}),
                           st.fixed_dictionaries({"messages": st.lists(messages, min_size=1, max_size=3)}))
    sources = _mostly(one_source, st.fixed_dictionaries({}, optional={
        "prompt": st.text(max_size=60), "prompt_ids": _ids(), "messages": st.lists(messages, max_size=3)}))
    fields = st.fixed_dictionaries({"max_new_tokens": lengths}, optional={  # unset is 64: long for a case
        "num_draft_tokens": _mostly(st.integers(0, 8), st.integers(-3, 20)), "sampling": _sampling(),
        "stop_token_ids": _ids(), "stop": _mostly(st.lists(st.text(min_size=1, max_size=8), max_size=3),
                        st.lists(st.text(max_size=300), max_size=18)), "ignore_eos": st.booleans(),
        "speculate": st.booleans(), "tree": tree})
    return st.tuples(sources, fields).map(lambda t: coordinator_pb2.GenerateRequest(**t[0], **t[1]))


REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.mark.slow
def test_the_grpc_front_answers_every_generated_request_without_an_internal_error(stack):
    codes: list[str] = []
    with grpc.insecure_channel(stack.grpc) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)

        @FUZZ
        @given(request=_generate_request(), streamed=st.booleans())
        def call(request, streamed):
            metadata = (("authorization", f"Bearer {KEY}"),)
            try:
                if streamed:
                    list(stub.GenerateStream(request, metadata=metadata, timeout=60))
                else:
                    stub.Generate(request, metadata=metadata, timeout=60)
                codes.append("OK")
            except grpc.RpcError as exc:
                assert exc.code() in REFUSALS, (request, exc.code(), exc.details())
                assert exc.details()
                codes.append(exc.code().name)

        call()
    COUNTS["grpc GenerateRequest"] = _tally(codes)
    _still_serving(stack)


def _target_steps():
    """Batches of a Step stream as a coordinator may send them: mostly a prefill, then verifies, every field now
    and then anything, a batch of one or several steps, some of one session."""
    prompt = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24)
    prefill = st.builds(target_pb2.Prefill, prompt_ids=_mostly(prompt, _ids()), sampling=st.one_of(st.none(), _sampling()),
                        want_features=st.booleans(), max_new_tokens=_mostly(st.integers(1, 32), st.integers(-3, 2 ** 31 - 1)),
                        verify_tokens=_mostly(st.just(17), st.integers(-3, 200)))
    probs = st.builds(common_pb2.DraftProbs, ids=_ids(), probs=st.lists(st.floats(width=32), max_size=24))
    chain = st.fixed_dictionaries({"drafts": st.lists(st.integers(0, VOCAB - 1), max_size=6)})
    anything = st.fixed_dictionaries({"drafts": _ids(), "q": st.lists(probs, max_size=4),
                                      "parents": st.lists(st.integers(0, 30), max_size=24)})
    verify = st.tuples(_mostly(chain, anything), st.fixed_dictionaries({}, optional={
        "token": st.integers(-3, VOCAB + 3), "want_features": st.booleans(), "decode": _mostly(st.just(0), st.integers(-3, 70)),
        "stop_ids": _ids()})).map(lambda t: target_pb2.Verify(**t[0], **t[1]))
    prefills = prefill.map(lambda p: target_pb2.TargetRequest(prefill=p))
    verifies = verify.map(lambda v: target_pb2.TargetRequest(verify=v))
    session = st.sampled_from(["a", "b", "c"])
    step = st.builds(target_pb2.SessionStep, session_id=session, request=_mostly(verifies, prefills))
    batch = st.builds(target_pb2.TargetBatch, steps=st.lists(step, max_size=4), release=st.lists(session, max_size=2))
    first = st.builds(target_pb2.TargetBatch, steps=st.lists(st.builds(target_pb2.SessionStep, session_id=session,
                                                                       request=prefills), min_size=1, max_size=3))
    return st.tuples(first, st.lists(batch, max_size=4)).map(lambda t: [t[0], *t[1]])


STEP_REFUSALS = REFUSALS | {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}


@pytest.fixture(scope="module")
def lone_target(tiny_dir):
    """A target service of its own, which no coordinator steps: the fuzzer is its coordinator."""
    from tandem.config import TargetSettings
    from tandem.service import Service
    from target_server.engine import TargetEngine
    from target_server.service import TargetServicer

    service = Service("target", TargetSettings(model=tiny_dir / "target", port=0, kv_cache_gib=None),
                      ["tandem.v1.TargetService"])
    servicer = TargetServicer(service)
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, service.server)
    service.start()
    engine = TargetEngine(tiny_dir / "target")
    servicer.attach(engine)
    service.ready()
    yield service.address, engine
    service.server.stop(None)


@pytest.mark.slow
def test_the_target_answers_every_generated_batch_without_an_internal_error(lone_target):
    """The target's Step stream, as a coordinator holding a certificate of its CA could drive it (the fronts'
    keys do not stand before it): every step gets a result or a refusal of its own, and the stream's end
    leaves no session."""
    address, engine = lone_target
    outcomes: list[str] = []
    refusals = {code.value[0] for code in STEP_REFUSALS}
    with grpc.insecure_channel(address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)

        @FUZZ
        @given(batches=_target_steps())
        def call(batches):
            try:
                for answer in stub.Step(iter(batches), timeout=60, metadata=[("tandem-coordinator", "fuzz")]):
                    for result in answer.results:
                        if result.HasField("error"):
                            assert result.error.code in refusals, (batches, result.error)
                            outcomes.append(grpc.StatusCode(next(c for c in grpc.StatusCode
                                                                 if c.value[0] == result.error.code)).name)
                        else:
                            outcomes.append("OK")
            except grpc.RpcError as exc:
                assert exc.code() in STEP_REFUSALS, (batches, exc.code(), exc.details())
                outcomes.append(exc.code().name)

        call()
    deadline = time.monotonic() + 10
    while engine.num_sessions and time.monotonic() < deadline:  # each stream's end frees its sessions
        time.sleep(0.05)
    assert engine.num_sessions == 0 and engine.kv_budget.used == 0
    COUNTS["target Step batches"] = _tally(outcomes)


def test_fuzz_counts(stack, tmp_path_factory):
    """Last: what ran, for the record (and none of it left anything behind)."""
    assert_whole_kv_budget_free(stack, KEY)
    out = tmp_path_factory.getbasetemp() / "fuzz-counts.json"
    out.write_text(json.dumps(COUNTS, indent=1))
    print(json.dumps(COUNTS, indent=1))


def _tally(outcomes: list) -> dict:
    return {"cases": len(outcomes), **{str(k): outcomes.count(k) for k in sorted(set(outcomes), key=str)}}


def _still_serving(stack) -> None:
    with TandemClient(stack.grpc, timeout=60, api_key=KEY) as client:
        assert client.generate(**REFERENCE).token_ids == stack.reference
    assert_whole_kv_budget_free(stack, KEY)
