"""The native target (target_server/native.py, paged.py): the Llama family of our own, reading the paged
KV pool in place. Logits and features equal transformers' for every architecture of the family, greedy
output equals `generate` alone and batched, and the compiled forward neither recompiles after warm-up
nor syncs the host more than once per verify."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import OracleDraft, compile_eagerly
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import _disable_current_modes
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tandem import packed
from tandem.packed import PackedLinear
from tandem.params import GenerationRequest, SamplingParams
from tandem_tools.inprocess import run_rounds
from tandem_tools.opcount import OpCounter
from target_server import paged
from target_server.capture import FeatureCapture
from target_server.engine import TargetEngine
from target_server.native import load_native
from target_server.paged import PagedKVPool, Span, bucket, plan
from target_server.warmup import WarmUp

SHAPE = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "initializer_range": 0.3, "max_position_embeddings": 512}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
FAMILIES = {
    "llama-gqa-llama3": (LlamaForCausalLM, LlamaConfig(**SHAPE, rope_parameters=LLAMA3_ROPE)),
    "llama-tied-mha": (LlamaForCausalLM, LlamaConfig(**{**SHAPE, "num_key_value_heads": 4}, tie_word_embeddings=True)),
    "mistral": (MistralForCausalLM, MistralConfig(**SHAPE, sliding_window=None)),
    "qwen2-bias": (Qwen2ForCausalLM, Qwen2Config(**SHAPE)),
    "qwen3-qk-norm": (Qwen3ForCausalLM, Qwen3Config(**SHAPE, head_dim=32)),  # head_dim apart from hidden / heads
}
AUX = [1, 2, 4]  # the embeddings' next layer, a middle one, the last layer's output


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    saved = {}
    for name, (cls, config) in FAMILIES.items():
        torch.manual_seed(0)
        model = cls(config).eval()
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        saved[name] = (path, model)
    return saved


def hf_reference(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits and the features FeatureCapture hooks out of it, [n, V] and [n, 3H]."""
    capture = FeatureCapture(model.model.layers, AUX)
    try:
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0]
        return logits, capture.take()[0]
    finally:
        capture.remove()


@pytest.mark.parametrize("attention", ["dense", "flex"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_features_equal_transformers(family, attention, checkpoints):
    """A prefill of three sequences in one flattened forward, then a verify of each (3, 1 and 5 new tokens)
    reading the prefill's KV in the pool: every row as transformers computes it alone. The BlockMask's tables
    are as wide as one sequence's blocks and the scratch block (5 columns), not as the pool (9 blocks)."""
    path, model = checkpoints[family]
    native = load_native(path, torch.device("cpu"), torch.float32, AUX)
    pool = PagedKVPool(native.num_layers, model.config.num_key_value_heads, native.head_dim, torch.float32,
                       torch.device("cpu"), blocks=8, sequence_blocks=4)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (20, 5, 37)]
    blocks = [pool.allocate(4) for _ in prompts]
    for news in (prompts, [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (3, 1, 5)]):
        past = [0] * 3 if news is prompts else [len(p) for p in prompts]
        spans = [Span(i, blocks[i], past[i], len(new)) for i, new in enumerate(news)]
        n = sum(len(new) for new in news)
        ids = torch.tensor([t for new in news for t in new] + [0] * (bucket(n) - n))
        positions, batch = plan(spans, bucket(n), pool, dense=attention == "dense")
        assert attention == "dense" or batch.kv_idx.shape[-1] == 5
        with torch.inference_mode():
            hidden, features = native(ids, positions, batch)
            logits = native.lm_head(hidden)
        start = 0
        for i, new in enumerate(news):
            whole = prompts[i] + new if news is not prompts else prompts[i]
            ref_logits, ref_features = hf_reference(model, whole)
            rows = slice(start, start + len(new))
            torch.testing.assert_close(logits[rows], ref_logits[-len(new):], rtol=1e-3, atol=1e-3)
            torch.testing.assert_close(features[rows], ref_features[-len(new):], rtol=1e-3, atol=1e-3)
            start += len(new)


def test_a_query_block_of_one_sequence_sees_the_blocks_below_its_past_whole():
    """On the CPU each token is a query block: it sees its committed past's blocks whole (no mask), the rest of
    its blocks through the mask; padding sees the scratch block only."""
    pool = PagedKVPool(1, 1, 8, torch.float32, torch.device("cpu"), blocks=16)
    spans = [Span(0, [3, 5, 7], past=40, new=2), Span(1, [9], past=3, new=1)]
    _, batch = plan(spans, 4, pool, dense=False)  # a 4-token bucket: 3 tokens and a padding one

    def seen(num, idx):
        return [idx[0, 0, j, : int(n)].tolist() for j, n in enumerate(num[0, 0])]

    assert seen(batch.full_num, batch.full_idx) == [[3, 5], [3, 5], [], []]
    assert seen(batch.kv_num, batch.kv_idx) == [[7], [7], [9], [0]]


def test_a_blockmask_table_is_as_wide_as_a_query_blocks_sequences_not_as_the_pool():
    """Columns: q_block sequences' blocks and the scratch block, the pool's count where that is fewer; a
    sequence past its blocks is refused with the count named."""
    pool = PagedKVPool(1, 1, 8, torch.float32, torch.device("cpu"), blocks=64, sequence_blocks=4)
    assert (pool.table_columns(1), pool.table_columns(16), pool.table_columns(32)) == (5, 65, 65)
    assert PagedKVPool(1, 1, 8, torch.float32, torch.device("cpu"), blocks=64).table_columns(1) == 65
    _, batch = plan([Span(0, [3, 5, 7], past=40, new=2)], 2, pool, dense=False)
    assert batch.kv_idx.shape == batch.full_idx.shape == (1, 1, 2, 5)
    with pytest.raises(ValueError, match="sees 6 pool blocks, past the table's 5 columns"):
        plan([Span(0, list(range(1, 8)), past=100, new=1)], 2, pool, dense=False)


def test_what_the_native_model_cannot_run_falls_back_to_transformers(tmp_path):
    """Mistral with a sliding window shorter than the context runs on transformers' path; asked for
    "native" it is refused with the reason."""
    torch.manual_seed(0)
    MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=8)).save_pretrained(tmp_path)
    assert load_native(tmp_path, torch.device("cpu"), torch.float32, AUX) is None
    assert TargetEngine(tmp_path).engine == "hf"
    with pytest.raises(ValueError, match="sliding-window"):
        TargetEngine(tmp_path, engine="native")


def greedy_rounds(target: TargetEngine, oracle: OracleDraft, prompt: list[int], n: int, k: int) -> list[int]:
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=n, num_draft_tokens=k, ignore_eos=True)
    return [t for event in run_rounds(target, oracle, request) for t in event.new_tokens]


def hf_generate(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_equals_generate_alone_and_batched(family, checkpoints):
    """Prompts of different lengths, K from 0 to 6, one at a time and then all at once (their steps share
    batches): the tokens are transformers' greedy generate's."""
    path, model = checkpoints[family]
    target = TargetEngine(path, engine="native", aux_layer_ids=AUX)
    oracle = OracleDraft(model, corrupt=0.3)
    gen = torch.Generator().manual_seed(2)
    prompts = [[7, *torch.randint(2, 300, (3 + 5 * i,), generator=gen).tolist()] for i in range(5)]  # one x_0
    oracle.expect(7)
    expected = [hf_generate(model, p, 16) for p in prompts]
    assert [greedy_rounds(target, oracle, p, 16, i + 2) for i, p in enumerate(prompts)] == expected
    start = threading.Barrier(len(prompts))

    def one(i: int) -> list[int]:
        start.wait()
        return greedy_rounds(target, oracle, prompts[i], 16, [0, 1, 3, 4, 6][i])

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(one, range(len(prompts)))) == expected
    assert target.num_sessions == 0 and target.kv_budget.used == 0


@pytest.mark.parametrize("engine", ["native", "hf"])
def test_a_greedy_verify_syncs_the_host_once(checkpoints, engine):
    """The accept result is the verify's only host sync (the batch's argmax, read with one tolist); on
    transformers' path too (its committed rows are picked with an index, not a boolean mask)."""
    path, _ = checkpoints["llama-gqa-llama3"]
    target = TargetEngine(path, engine=engine, aux_layer_ids=AUX)
    token = target.prefill("a", [5, 6, 7, 8], SamplingParams()).token
    for drafts in ([1, 2, 3, 4], [token, 9], []):
        with OpCounter() as ops:
            token = target.verify("a", token, drafts).bonus
        assert ops.syncs <= 1, ops.sync_ops


@pytest.fixture
def compiled(checkpoints, monkeypatch):
    """A compiled engine (a compile is ~20-50 s a bucket here) whose forwards are padded to 8 tokens at least
    (as a CUDA one is to 16: paged.MIN_TOKENS): every step below fits the 8-token bucket, so it compiles
    once (with buckets of 2, 4 and 8, three times)."""
    path, model = checkpoints["llama-gqa-llama3"]
    monkeypatch.setitem(paged.MIN_TOKENS, "cpu", 8)
    return TargetEngine(path, engine="native", aux_layer_ids=AUX, compile=True), model


@pytest.mark.slow
def test_the_compiled_engine_matches_generate_without_recompiling(compiled):
    """Warm-up, then prefills and verifies alone and batched in the same bucket: transformers' tokens, no
    new graph (dynamo's counters), at most one host sync per verify."""
    target, model = compiled
    oracle = OracleDraft(model, corrupt=0.3)
    oracle.expect(7)
    prompts = [[7, 3, 9, 11], [7, 20, 21, 22, 23, 24], [7, 40]]
    assert greedy_rounds(target, oracle, prompts[0], 6, 4) == hf_generate(model, prompts[0], 6)  # the warm-up
    graphs = counters["stats"]["unique_graphs"]
    for p, n in zip(prompts[1:], (40, 10), strict=True):  # 40: its verifies see whole blocks below their past
        assert greedy_rounds(target, oracle, p, n, 3) == hf_generate(model, p, n)
    start = threading.Barrier(2)

    def one(p: list[int]) -> list[int]:
        start.wait()
        return greedy_rounds(target, oracle, p, 8, 2)  # 2 x 3 tokens: the same bucket batched

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(one, prompts[1:])) == [hf_generate(model, p, 8) for p in prompts[1:]]
    token = target.prefill("s", [7, 1, 2], SamplingParams()).token
    forward = target.runner._forward

    def compiled_outside_the_counter(*args):
        """Dynamo would trace the counter's dispatch mode into the graph: the compiled forward runs
        without it (it cannot sync the host: a fullgraph has no .item()), the rest of the verify with it."""
        with _disable_current_modes():
            return forward(*args)

    target.runner._forward = compiled_outside_the_counter
    try:
        with OpCounter() as ops:
            target.verify("s", token, [1, 2, 3, 4, 5])
    finally:
        target.runner._forward = forward
    assert ops.syncs <= 1, ops.sync_ops
    target.release("s")
    assert counters["stats"]["unique_graphs"] == graphs, "a graph was compiled after the warm-up"


def test_a_compiled_engine_takes_more_buckets_than_dynamos_default_from_the_batchers_thread(checkpoints, monkeypatch):
    """Dynamo's settings are per thread: a recompile limit set where the engine is built did not reach the
    batcher's thread, and a service's ninth bucket failed (FailOnRecompileLimitHit). Twelve buckets from
    another thread; the compile is dynamo's alone (backend "eager": the test is about its guards, and an
    inductor compile costs ~20 s a bucket here)."""
    compile_eagerly(monkeypatch)
    path, model = checkpoints["llama-gqa-llama3"]
    target = TargetEngine(path, engine="native", aux_layer_ids=AUX, compile=True)
    sizes = [1, 3, 5, 9, 17, 33, 49, 65, 81, 97, 113, 129]
    assert len({bucket(n) for n in sizes}) == 12

    def prefills() -> list[int]:
        return [target.prefill(f"s{n}", list(range(1, n + 1)), SamplingParams()).token for n in sizes]

    with ThreadPoolExecutor(1) as pool:
        tokens = pool.submit(prefills).result()
    assert tokens == [hf_generate(model, list(range(1, n + 1)), 1)[0] for n in sizes]


def test_a_background_compile_runs_a_bucket_eagerly_until_its_graph_is_ready(checkpoints, monkeypatch):
    """TANDEM_COMPILE=background (warmup.WarmUp): a verify whose bucket has no graph yet runs eagerly and queues
    the bucket, which compiles on a thread of its own (dynamo's "eager" backend here: the test is about the hand-
    over); from then on the bucket runs compiled, a prefill too where its bucket is (it never queues one);
    generate's tokens all along, and the engine says how many buckets are still compiling (ModelInfo's
    buckets_compiling). The first few buckets are queued with the pool."""
    compile_eagerly(monkeypatch)
    path, model = checkpoints["llama-gqa-llama3"]
    target = TargetEngine(path, engine="native", aux_layer_ids=AUX, compile="background")
    runner, threads = target.runner, []
    graph = runner._forward

    def compiled(*args):
        threads.append(threading.current_thread().name)
        return graph(*args)

    runner._forward = compiled
    oracle = OracleDraft(model, corrupt=0.3)
    oracle.expect(7)
    first, second = [7, 3, 9, 11], [7, 20, 21, 22, 23, 24]
    assert greedy_rounds(target, oracle, first, 8, 3) == hf_generate(model, first, 8)  # verifies of 4: one bucket
    assert runner.warm_up.wait(120) and target.buckets_compiling == 0
    rows = target.kv_pool.owner.shape[0]
    assert runner.buckets == {(n, rows) for n in WarmUp.FIRST} and threads[0] == "tandem-compile"
    threads.clear()
    target.prefill("p", list(range(1, 101)), SamplingParams())  # 100 tokens: a bucket of 112, never compiled
    assert not threads and runner.buckets == {(n, rows) for n in WarmUp.FIRST}  # eager, and nothing queued
    target.release("p")
    assert greedy_rounds(target, oracle, second, 8, 3) == hf_generate(model, second, 8)
    # the prefill (8: compiled) and the verifies, on the steps' own thread (the scheduler's)
    assert threads and set(threads) == {"tandem-scheduler"}


def test_a_bucket_whose_compile_fails_runs_eagerly_and_the_engine_carries_on(checkpoints, monkeypatch):
    """A compiled forward that raises (the compiler's failure: on an H100 flex's Triton template refused every
    block size below 16 rows) is logged once; its bucket runs eagerly from then on, with generate's tokens, and
    the other buckets stay compiled. CUDA forwards pad to 16 tokens at least (flex's smallest tile there)."""
    assert [bucket(n, "cuda") for n in (1, 2, 9, 16, 17, 300)] == [16, 16, 16, 16, 32, 512]
    assert [bucket(n) for n in (1, 2, 3, 9, 17)] == [2, 2, 4, 16, 32]
    compile_eagerly(monkeypatch)
    path, model = checkpoints["llama-gqa-llama3"]
    target = TargetEngine(path, engine="native", aux_layer_ids=AUX, compile=True)
    runner, graph, calls = target.runner, target.runner._forward, []

    def compiled(ids, positions, batch):
        calls.append(ids.shape[0])
        if ids.shape[0] == 4:
            raise RuntimeError("LoweringException: NoValidChoicesError")
        return graph(ids, positions, batch)

    runner._forward = compiled
    oracle = OracleDraft(model, corrupt=0.3)
    oracle.expect(7)
    prompt = [7, 3, 9, 11]
    assert greedy_rounds(target, oracle, prompt, 10, 3) == hf_generate(model, prompt, 10)  # verifies of 4 tokens
    rows = target.kv_pool.owner.shape[0]
    assert runner.failed == {(4, rows)} and calls.count(4) == 1  # tried once, then eagerly
    calls.clear()
    oracle.expect(7)
    assert greedy_rounds(target, oracle, prompt, 6, 1) == hf_generate(model, prompt, 6)  # verifies of 2: compiled
    assert calls and 4 not in calls


def test_an_eager_cpu_engine_packs_its_linears_and_they_compute_what_nn_linear_does(checkpoints, monkeypatch):
    """oneDNN's prepacked weights (PackedLinear) for the projections (q, k, v fused into one, gate and up into
    another: fuse_projections) and lm_head of an eager float32 CPU
    target (those of at least PACK_MIN_WEIGHTS weights; here all, the threshold lowered): the same products as
    nn.Linear within float32 rounding, for any row count, with and without bias, and generate's tokens."""
    for bias in (False, True):
        linear = torch.nn.Linear(48, 80, bias=bias)
        packed_linear = PackedLinear(linear)
        for shape in ((1, 48), (2, 48), (5, 48), (8, 48), (9, 48), (33, 48), (3, 4, 48)):
            x = torch.randn(*shape)
            torch.testing.assert_close(packed_linear(x), linear(x), rtol=1e-5, atol=1e-5)
    path, model = checkpoints["qwen2-bias"]
    assert not isinstance(TargetEngine(path, engine="native", aux_layer_ids=AUX).runner.model.lm_head, PackedLinear)
    monkeypatch.setattr(packed, "PACK_MIN_WEIGHTS", 1)
    target = TargetEngine(path, engine="native", aux_layer_ids=AUX)
    packed_model = target.runner.model
    assert isinstance(packed_model.lm_head, PackedLinear)
    assert all(isinstance(m, PackedLinear) for layer in packed_model.model.layers
               for m in (layer.self_attn.qkv, layer.self_attn.o_proj, layer.mlp.gate_up, layer.mlp.down_proj))
    oracle = OracleDraft(model, corrupt=0.3)
    oracle.expect(7)
    for prompt in ([7, 3, 9, 11], [7, *range(20, 60)]):
        assert greedy_rounds(target, oracle, prompt, 12, 4) == hf_generate(model, prompt, 12)
