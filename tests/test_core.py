"""The core engine: lossless greedy and sampling, the draft's cache, checkpoint layouts, pairing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import OracleDraft, RecordingDraft, StepByStep

from draft_server.checkpoint import REFERENCE, read_target_embedding, save_draft
from draft_server.engine import DraftEngine
from draft_server.model import Eagle3Draft
from tandem.pairing import PairMismatch
from tandem.params import GenerationRequest, SamplingParams
from tandem_tools.inprocess import InProcessGenerator, run_rounds
from tandem_tools.tiny import tiny_draft_config
from target_server.acceptance import target_probs
from target_server.engine import TargetEngine


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (n,), generator=g)
    return [torch.randint(2, vocab, (int(length),), generator=g).tolist() for length in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


def assert_same_or_tie(model, prompt: list[int], ours: list[int], ref: list[int]) -> None:
    """Token-for-token equality; a difference is tolerated only at a true near-tie (top-2 within 1e-4)."""
    if ours == ref:
        return
    i = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b) if len(ours) == len(ref) else None
    assert i is not None, f"lengths differ: {len(ours)} vs {len(ref)}"
    with torch.inference_mode():
        top2 = model(torch.tensor([prompt + ref[:i]])).logits[0, -1].topk(2).values
    assert float(top2[0] - top2[1]) < 1e-4, f"diverged at generated token {i}: {ours[i]} vs {ref[i]}"


# -- greedy ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_greedy_matches_target_only(generator, hf_target, k):
    """20 prompts x K, real draft engine, against transformers' generate(do_sample=False), float32."""
    for prompt in make_prompts(20, generator.target.vocab_size):
        ours = generator.generate(GenerationRequest(prompt_ids=prompt, max_new_tokens=24, num_draft_tokens=k))
        assert_same_or_tie(hf_target, prompt, ours.token_ids, hf_greedy(hf_target, prompt, 24))
        assert ours.stats["num_rounds"] > 0


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_greedy_with_high_acceptance_matches_target_only(generator, hf_target, k):
    """Drafts that are mostly right exercise every accepted length, the bonus token and the KV crop."""
    oracle = OracleDraft(hf_target, corrupt=0.25, seed=k)
    accepted = 0
    for prompt in make_prompts(20, generator.target.vocab_size, seed=1):
        oracle.expect(prompt[0])
        request = GenerationRequest(prompt_ids=prompt, max_new_tokens=24, num_draft_tokens=k)
        tokens, event = [], None
        for event in run_rounds(generator.target, oracle, request, max_context=generator.target.max_context):
            tokens.extend(event.new_tokens)
        assert_same_or_tie(hf_target, prompt, tokens, hf_greedy(hf_target, prompt, 24))
        accepted += event.stats.num_accepted_tokens
        assert sum(event.stats.accepted_per_position) == event.stats.num_accepted_tokens
    assert accepted > 0
    assert generator.target.num_sessions == 0


def test_target_only_mode_matches(generator, hf_target):
    for prompt in make_prompts(5, generator.target.vocab_size, seed=2):
        ours = generator.generate(GenerationRequest(prompt_ids=prompt, max_new_tokens=16, speculate=False))
        assert ours.stats["num_draft_tokens"] == 0
        assert_same_or_tie(hf_target, prompt, ours.token_ids, hf_greedy(hf_target, prompt, 16))


def test_verify_crops_the_kv_cache_to_the_committed_length(generator):
    target = generator.target
    prompt = [5, 6, 7, 8, 9]
    first = target.prefill("crop", prompt, SamplingParams()).token
    result = target.verify("crop", first, [3, 3, 3, 3])  # almost surely rejected at once
    committed = len(prompt) + 1 + len(result.accepted)
    session = target.sessions.get("crop")
    assert session.length == committed and len(session.blocks) * target.kv_pool.BLOCK >= committed
    assert result.features.shape == (len(result.accepted) + 1, 3 * target.hidden_size)
    assert target.release("crop")


# -- stop conditions ------------------------------------------------------------------------------


def test_stop_conditions(generator):
    prompt = [10, 20, 30]
    free = generator.generate(GenerationRequest(prompt_ids=prompt, max_new_tokens=20, ignore_eos=True))
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    stop = free.token_ids[6]
    cut = generator.generate(
        GenerationRequest(prompt_ids=prompt, max_new_tokens=20, ignore_eos=True, stop_token_ids=[stop])
    )
    first = free.token_ids.index(stop)
    assert cut.token_ids == free.token_ids[: first + 1]
    assert cut.finish_reason == "stop"


def test_eos_stops_generation_like_transformers(tiny_dir, hf_target):
    """The target's EOS ids come from its generation_config; output stops at EOS and keeps it, as HF does."""
    generator = InProcessGenerator(tiny_dir / "target", tiny_dir / "draft", draft_cost=0)
    assert generator.target.eos_token_ids == [1]
    prompt = [10, 20, 30]
    free = generator.generate(GenerationRequest(prompt_ids=prompt, max_new_tokens=20, ignore_eos=True))
    eos = free.token_ids[7]  # a token the tiny target does produce stands in for its EOS
    generator.target.eos_token_ids = [eos]
    stopped = generator.generate(GenerationRequest(prompt_ids=prompt, max_new_tokens=20))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]
    ref = hf_target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, eos_token_id=eos)
    assert stopped.token_ids == ref[0, len(prompt):].tolist()


# -- sampling is lossless -------------------------------------------------------------------------


def chi_square_p_value(observed: dict, expected_probs: dict, n: int, min_expected: float = 5.0) -> float:
    """Goodness of fit of observed counts to exact probabilities; rare cells pooled into one."""
    stat, cells, pooled_obs, pooled_exp = 0.0, 0, 0, 0.0
    for cell, prob in expected_probs.items():
        expected = prob * n
        if expected >= min_expected:
            stat += (observed.get(cell, 0) - expected) ** 2 / expected
            cells += 1
        else:
            pooled_obs += observed.get(cell, 0)
            pooled_exp += expected
    pooled_obs += sum(count for cell, count in observed.items() if cell not in expected_probs)
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    df = cells - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def exact_first_two(model, prompt: list[int], params: SamplingParams) -> dict[tuple[int, int], float]:
    with torch.inference_mode():
        p1 = target_probs(model(torch.tensor([prompt])).logits[0, -1:], params)[0]
        support = p1.nonzero().flatten().tolist()
        batch = torch.tensor([prompt + [t] for t in support])
        p2 = target_probs(model(batch).logits[:, -1], params)
    joint = {}
    for row, t in enumerate(support):
        for u in p2[row].nonzero().flatten().tolist():
            joint[(t, u)] = float(p1[t] * p2[row, u])
    return joint


def test_sampling_is_lossless(generator, hf_target):
    """2000 seeded runs at temperature 1 and top-p 0.9: the joint law of the first 2 tokens equals the
    target's own (chi-square, p > 0.001).

    The draft sends no q (a point mass): it proposes the target's argmax half the time and another top-5
    token otherwise, so both the acceptance branch and the residual resampling branch carry mass (drafts
    with their q: tests/test_speculative_sampling.py).
    """
    params = SamplingParams(temperature=1.0, top_p=0.9)
    prompt = [17, 250, 33, 104]
    oracle = OracleDraft(hf_target, corrupt=0.5, seed=7)
    runs = 2000
    observed: dict[tuple[int, int], int] = {}
    for seed in range(runs):
        oracle.expect(prompt[0])
        request = GenerationRequest(
            prompt_ids=prompt, max_new_tokens=3, num_draft_tokens=1, ignore_eos=True,
            sampling=params.model_copy(update={"seed": seed}),
        )
        tokens = [t for event in run_rounds(generator.target, oracle, request) for t in event.new_tokens]
        observed[(tokens[0], tokens[1])] = observed.get((tokens[0], tokens[1]), 0) + 1
    p_value = chi_square_p_value(observed, exact_first_two(hf_target, prompt, params), runs)
    assert p_value > 1e-3, f"p = {p_value:.2e}"


def test_sampling_is_reproducible_with_a_seed(generator):
    request = GenerationRequest(
        prompt_ids=[4, 5, 6], max_new_tokens=16, sampling=SamplingParams(temperature=0.8, top_k=20, seed=123)
    )
    assert generator.generate(request).token_ids == generator.generate(request).token_ids


# -- the draft ------------------------------------------------------------------------------------


def naive_drafts(model: Eagle3Draft, features: torch.Tensor, tokens: list[int], k: int) -> list[int]:
    """Recompute the draft over the whole sequence, no cache, for every rollout step."""
    hidden = model.fc(features)  # [m, H]
    seq_tokens = list(tokens)
    drafts = []
    with torch.inference_mode():
        for _ in range(k):
            positions = torch.arange(len(seq_tokens))[None]
            a = model(hidden[None], torch.tensor([seq_tokens]), positions)[0]  # [S, H]
            draft = int(model.to_target_ids(model.draft_logits(a[-1]).argmax()))
            drafts.append(draft)
            hidden = torch.cat([hidden, a[-1:]])
            seq_tokens.append(draft)
    return drafts


def test_cached_draft_matches_naive_recompute(tiny_dir, hf_target):
    target = TargetEngine(tiny_dir / "target")
    recorder = RecordingDraft(DraftEngine(tiny_dir / "draft", tiny_dir / "target"))
    # mostly-accepted rounds so that the committed pairs come from several verify results
    oracle = OracleDraft(hf_target, corrupt=0.3, seed=3)

    class Mixed(StepByStep):
        """Feed the real draft every committed pair; take the oracle's drafts for verification."""

        def propose(self, session_id, features, next_tokens, k, create=False):
            recorder.propose(session_id, features, next_tokens, k, create)
            return oracle.propose(session_id, features, next_tokens, k, create)

        def release(self, session_id):
            oracle.release(session_id)
            return recorder.release(session_id)

    prompt = [9, 8, 7, 6, 5, 4]
    oracle.expect(prompt[0])
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=30, num_draft_tokens=4, ignore_eos=True)
    list(run_rounds(target, Mixed(), request))
    assert len(recorder.calls) > 3
    all_features, all_tokens = [], []
    for features, tokens, k, drafts in recorder.calls:
        all_features.append(features)
        all_tokens.extend(tokens)
        assert drafts == naive_drafts(recorder.engine.model, torch.cat(all_features), all_tokens, k)
    assert sum(len(t) for _, t, _, _ in recorder.calls) > len(recorder.calls) + len(prompt)  # multi-token extends


def test_reference_and_speculators_layouts_give_identical_drafts(tiny_dir):
    reference = DraftEngine(tiny_dir / "draft", tiny_dir / "target")
    speculators = DraftEngine(tiny_dir / "draft-speculators")  # carries its own embed_tokens
    assert reference.layout == "reference" and speculators.layout == "speculators"
    # the reference file has no embed_tokens: the engine took the target's
    assert torch.equal(reference.model.embed_tokens.weight, read_target_embedding(tiny_dir / "target"))
    target = TargetEngine(tiny_dir / "target")
    prefill = target.prefill("s", [11, 12, 13, 14, 15], SamplingParams())
    pairs = (prefill.features, [12, 13, 14, 15, prefill.token])
    assert reference.propose("a", *pairs, 6, create=True) == speculators.propose("b", *pairs, 6, create=True)


def _save_variant(tiny_dir, out, *, target_hidden=None, vocab=None, aux=None):
    from transformers import AutoConfig

    target_config = AutoConfig.from_pretrained(tiny_dir / "target")
    config = tiny_draft_config(target_config, draft_vocab_size=256)
    if target_hidden:
        config.target_hidden_size = target_hidden
    if vocab:
        config.layer.vocab_size = vocab
    config.aux_layer_ids = aux
    save_draft(Eagle3Draft(config), out, layout=REFERENCE, include_embeddings=True)
    return out


@pytest.mark.parametrize(
    "variant, message",
    [
        ({"target_hidden": 32}, "hidden size"),
        ({"vocab": 600}, "vocabulary"),
        ({"aux": [2, 4, 99]}, "layer ids"),
    ],
)
def test_mismatched_draft_is_refused_at_load(tiny_dir, tmp_path, variant, message):
    draft_dir = _save_variant(tiny_dir, tmp_path / "bad", **variant)
    with pytest.raises(PairMismatch, match=message):
        DraftEngine(draft_dir, tiny_dir / "target")
    with pytest.raises(PairMismatch, match=message):
        InProcessGenerator(tiny_dir / "target", draft_dir)


def test_draft_layer_ids_override_the_target_default(tiny_dir, tmp_path):
    draft_dir = _save_variant(tiny_dir, tmp_path / "ids", aux=[1, 3, 6])
    generator = InProcessGenerator(tiny_dir / "target", draft_dir)
    assert generator.target.aux_layer_ids == (1, 3, 6)
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]


def test_default_capture_layers_are_input_of_layer(tiny_dir, hf_target):
    """Features = HF hidden_states[2], [L//2], [L-3] concatenated (the input of those layers)."""
    target = TargetEngine(tiny_dir / "target")
    assert target.aux_layer_ids == (2, 4, 5)
    prompt = [3, 14, 15, 92, 65]
    features = target.prefill("f", prompt, SamplingParams()).features
    with torch.inference_mode():
        hidden = hf_target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[2], hidden[4], hidden[5]], dim=-1)[0]
    torch.testing.assert_close(features, expected)


# -- CLI ------------------------------------------------------------------------------------------


def test_cli_generate_in_process_json(tiny_dir, generator):
    out = subprocess.run(
        [sys.executable, "-m", "tandem_tools.cli", "generate", "--in-process", "--target", str(tiny_dir / "target"),
         "--draft", str(tiny_dir / "draft"), "--prompt-ids", "5,6,7", "--max-new-tokens", "12",
         "--num-draft-tokens", "3", "--json"],
        capture_output=True, text=True, check=True,
    )
    result = json.loads(out.stdout)
    assert set(result) >= {"token_ids", "text", "finish_reason", "stats"}
    assert set(result["stats"]) >= {
        "num_rounds", "num_draft_tokens", "num_accepted_tokens", "mean_acceptance_length", "accepted_per_position",
    }
    expected = generator.generate(GenerationRequest(prompt_ids=[5, 6, 7], max_new_tokens=12, num_draft_tokens=3))
    assert result["token_ids"] == expected.token_ids


def test_cli_make_tiny_writes_both_layouts(tmp_path):
    subprocess.run([sys.executable, "-m", "tandem_tools.cli", "make-tiny", str(tmp_path)], check=True, capture_output=True)
    assert (tmp_path / "target" / "tokenizer.json").is_file()
    assert json.loads((tmp_path / "draft-speculators" / "config.json").read_text())["speculators_model_type"] == "eagle3"
    from safetensors import safe_open

    with safe_open(tmp_path / "draft" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "embed_tokens.weight" not in keys and "midlayer.hidden_norm.weight" in keys and "d2t" in keys


@pytest.mark.parametrize(
    "change, message",
    [
        ({"fc_norm": True}, "sets fc_norm but it has no fc_norm"),  # a flag the weights do not carry
        ({"transformer_layer_config": {"num_hidden_layers": 2}}, "is 2 but it has weights of 1 decoder layer"),
        ({"eagle_aux_hidden_state_layer_ids": [1, 2, 3, 4]}, "captures three"),
    ],
)
def test_speculators_heads_that_do_not_fit_are_refused_with_the_reason(tiny_dir, tmp_path, change, message):
    import shutil

    from draft_server.checkpoint import DraftLoadError

    draft_dir = tmp_path / "spec"
    shutil.copytree(tiny_dir / "draft-speculators", draft_dir)
    config = json.loads((draft_dir / "config.json").read_text())
    for key, value in change.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    (draft_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftLoadError, match=message):
        DraftEngine(draft_dir, tiny_dir / "target")
