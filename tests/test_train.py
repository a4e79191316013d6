"""The EAGLE-3 trainer: a head trained on a tiny target's own continuations is accepted often, computes in
training exactly what DraftEngine computes at inference, and loads as a published head.

The target here is make_tiny's, re-drawn with initializer_range 0.05: make_tiny's default weights (0.15)
make a next-token function so chaotic that no one-layer head follows it (the target's own logit lens one
layer early agrees with it half the time; a trained head is accepted about 5% of the time), while at 0.05
the target settles into patterns a head can learn in half a minute.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from draft_server.checkpoint import load_draft
from draft_server.engine import DraftEngine
from draft_server.model import DraftKV
from draft_server.teacher import Teacher
from draft_server.train import train_tiny_draft, ttt_forward
from draft_server.train_cli import add_train_parser
from draft_server.train_data import text_prompts
from tandem.params import GenerationRequest, SamplingParams
from tandem_tools.inprocess import InProcessGenerator
from tandem_tools.tiny import make_tiny
from target_server.engine import TargetEngine

K = 4
THRESHOLD = 1 + 0.4 * K  # mean acceptance length a correctly wired head must beat
REFERENCE_KEYS = {
    "fc.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


def redraw_learnable_target(target_dir: Path, init_range: float = 0.07, logit_std: float = 5.0) -> None:
    """Overwrite make_tiny's target with tied embeddings drawn at `init_range`, the final norm scaled so the
    logits keep a spread of about `logit_std` (peaked, as make_tiny's are)."""
    config = LlamaConfig.from_pretrained(target_dir)
    config.initializer_range = init_range
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    target = LlamaForCausalLM(config)
    with torch.no_grad():
        target.model.norm.weight.mul_(logit_std / (init_range * math.sqrt(config.hidden_size)))
    target.save_pretrained(target_dir)


def acceptance(generator: InProcessGenerator, prompts: list[list[int]]) -> list[float]:
    return [
        generator.generate(
            GenerationRequest(prompt_ids=p, max_new_tokens=64, num_draft_tokens=K, ignore_eos=True)
        ).stats["mean_acceptance_length"]
        for p in prompts
    ]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    make_tiny(root)  # root/target (tokenizer, config) and root/draft, an untrained head
    redraw_learnable_target(root / "target")
    history = []
    started = time.monotonic()
    trained = train_tiny_draft(root, root / "trained", history=history)
    seconds = time.monotonic() - started
    # held out: cut from other files than the training prompts (train_tiny_draft reads the first ones)
    prompts = text_prompts(root / "target", 8, 16, seed=1234, skip_files=100).tolist()
    return SimpleNamespace(
        target=root / "target", trained=trained, untrained=root / "draft", history=history, seconds=seconds,
        prompts=prompts,
    )


@pytest.fixture(scope="module")
def trained_acceptance(pair) -> list[float]:
    return acceptance(InProcessGenerator(pair.target, pair.trained, draft_cost=0), pair.prompts)


def test_trained_draft_acceptance_exceeds_threshold(pair, trained_acceptance):
    mean = sum(trained_acceptance) / len(trained_acceptance)
    print(f"trained in {pair.seconds:.1f}s; acceptance per prompt {[round(a, 2) for a in trained_acceptance]}")
    assert mean > THRESHOLD, f"mean acceptance length {mean:.2f} <= {THRESHOLD}: {trained_acceptance}"


def test_training_loss_falls_and_beats_untrained(pair, trained_acceptance):
    losses = [s.loss for s in pair.history]
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.6 * first, f"loss went from {first:.3f} to {last:.3f}"
    assert pair.history[-1].accuracy[0] > 0.3
    untrained = acceptance(InProcessGenerator(pair.target, pair.untrained, draft_cost=0), pair.prompts[:4])
    print(f"loss {first:.3f} -> {last:.3f}, accuracy per step {pair.history[-1].accuracy}; untrained {untrained}")
    assert sum(trained_acceptance) / len(trained_acceptance) > sum(untrained) / len(untrained) + 1.0


def test_trained_head_loads_in_reference_layout(pair):
    with safe_open(pair.trained / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("d2t").dtype == torch.int64
        assert f.get_tensor("t2d").dtype == torch.bool
    assert keys == REFERENCE_KEYS
    config = json.loads((pair.trained / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 384
    assert config["target_hidden_size"] == 64
    assert "speculators_model_type" not in config
    model = load_draft(pair.trained, pair.target)
    eos = json.loads((pair.target / "config.json").read_text())["eos_token_id"]
    assert bool(model.t2d[eos]), "EOS must be in the draft vocabulary"

    speculative = InProcessGenerator(pair.target, pair.trained)
    target_only = InProcessGenerator(pair.target)
    for prompt in pair.prompts[:3]:
        request = GenerationRequest(prompt_ids=prompt, max_new_tokens=48, num_draft_tokens=K, ignore_eos=True)
        assert speculative.generate(request).token_ids == target_only.generate(request).token_ids


def test_training_steps_compute_what_draft_engine_proposes(pair):
    """TTT step j at the last committed index is rollout step j of DraftEngine.propose: same logits."""
    target = TargetEngine(pair.target)
    engine = DraftEngine(pair.trained, pair.target)
    teacher = Teacher(pair.target)
    model = load_draft(pair.trained, pair.target)
    for n, prompt in enumerate(pair.prompts[4:7]):
        prefill = target.prefill(f"s{n}", prompt, SamplingParams())
        committed = [*prompt[1:], prefill.token]
        drafts = engine.propose(f"s{n}", prefill.features, committed, K, create=True)

        # inference, step by step as propose runs it, keeping the logits
        with torch.no_grad():
            kv = DraftKV()
            m = len(prompt)
            a = model(model.fc(prefill.features)[None], torch.tensor([committed]), torch.arange(m)[None], kv)[:, -1:]
            expected = []
            for step, draft in enumerate(drafts):
                expected.append(model.draft_logits(a[0, -1]))
                a = model(a, torch.tensor([[draft]]), torch.tensor([[m + step]]), kv)

            # training: one sequence x_0..x_n, d_1..d_K; the round's last committed index is n-1
            ids = torch.tensor([[*prompt, prefill.token, *drafts]])
            features, _ = teacher(ids)
            outputs = ttt_forward(model, ids, features.clone(), K)
        for j, out in enumerate(outputs):
            logits = model.draft_logits(out[0, m - 1])
            torch.testing.assert_close(logits, expected[j], atol=1e-4, rtol=1e-4)
            assert int(model.to_target_ids(logits.argmax())) == drafts[j]
    teacher.remove()


def test_train_draft_command_on_text_files(tmp_path, pair):
    data = tmp_path / "data.txt"
    data.write_text("def add(a, b):\n    return a + b\n\n" * 40)
    parser = argparse.ArgumentParser(prog="tandem")
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        ["train-draft", "--target", str(pair.target), "--data", str(data), "--out", str(tmp_path / "head"),
         "--steps", "3", "--ttt-steps", "2", "--seq-len", "32", "--draft-vocab-size", "128", "--quiet"]
    )
    assert args.func(args) == 0
    engine = DraftEngine(tmp_path / "head", pair.target)
    assert engine.config.draft_vocab_size == 128
    assert len(engine.propose("s", torch.zeros(3, engine.feature_size), [5, 6, 7], 3, create=True)) == 3


def test_answers_to_chat_prompts_of_any_length_are_each_prompts_own_greedy_answer(pair):
    """Teacher.answer left-pads a batch of prompts of different lengths: every answer is the one the prompt
    gets alone, and stops after its first EOS."""
    teacher = Teacher(pair.target)
    prompts = [[5, 6, 7], list(range(10, 30)), [40, 41, 42, 43, 44, 45, 46]]
    batched = teacher.answer(prompts, 12)
    for prompt, sequence in zip(prompts, batched):
        alone = teacher.continue_sequences(torch.tensor([prompt]), 12)[0].tolist()
        assert sequence[: len(prompt)] == prompt
        answer = sequence[len(prompt):]
        ends = [i for i, t in enumerate(alone[len(prompt):]) if t in teacher.eos_token_ids]
        assert answer == alone[len(prompt):][: ends[0] + 1 if ends else 12]
    teacher.remove()


def test_train_draft_command_on_chats(tmp_path, pair):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"def f{i}("}]}) + "\n"
                             for i in range(6)))
    parser = argparse.ArgumentParser(prog="tandem")
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        ["train-draft", "--target", str(pair.target), "--chats", str(chats), "--out", str(tmp_path / "head"),
         "--steps", "2", "--ttt-steps", "2", "--seq-len", "16", "--draft-vocab-size", "128", "--quiet"]
    )
    assert args.func(args) == 0
    assert DraftEngine(tmp_path / "head", pair.target).config.draft_vocab_size == 128
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "no messages here"}\n')
    args = parser.parse_args(["train-draft", "--target", str(pair.target), "--chats", str(bad), "--out",
                              str(tmp_path / "x")])
    with pytest.raises(ValueError, match="bad.jsonl:1: expected"):
        args.func(args)


def test_a_trained_head_through_the_services_as_users_run_them_gives_the_targets_tokens(pair, tmp_path):
    """The three processes with a trained head and every setting at its default (gate, adaptive K, overlap,
    the scheduler's two waves): drafts are accepted across the processes (features relayed, KV cropped, the
    bonus token), and greedy output is the target's alone, one request and several at once."""
    from concurrent.futures import ThreadPoolExecutor

    from processes import start_stack, stop_stack

    from coordinator.client import TandemClient

    reference = InProcessGenerator(pair.target, pair.trained, draft_cost=0)
    want = [reference.generate(GenerationRequest(prompt_ids=p, max_new_tokens=40, speculate=False,
                                                 ignore_eos=True)).token_ids for p in pair.prompts]
    procs = start_stack(pair.target.parent, tmp_path, draft=pair.trained, defaults=True)
    try:
        with TandemClient(procs["coordinator"].address, timeout=120) as client:
            def run(p):
                return client.generate(prompt_ids=p, max_new_tokens=40, num_draft_tokens=5, ignore_eos=True)

            alone = [run(p) for p in pair.prompts]
            with ThreadPoolExecutor(len(pair.prompts)) as pool:
                together = list(pool.map(run, pair.prompts))
        for got in (alone, together):
            assert [r.token_ids for r in got] == want
        accepted = sum(r.stats["num_accepted_tokens"] for r in alone)
        rounds = sum(r.stats["num_rounds"] for r in alone)
        assert accepted > rounds, f"{accepted} drafts accepted in {rounds} rounds"  # a mean length above 2
    finally:
        stop_stack(procs)
