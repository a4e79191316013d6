"""Targets beyond the tiny Llama: Mistral (sliding-window attention) and Qwen3, saved sharded."""

from __future__ import annotations

import pytest
import torch
from helpers import OracleDraft
from transformers import (
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from draft_server.checkpoint import read_target_embedding
from tandem.params import GenerationRequest
from tandem_tools.inprocess import run_rounds
from target_server.engine import TargetEngine

SHAPE = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
         "num_attention_heads": 4, "num_key_value_heads": 2, "initializer_range": 0.3}
FAMILIES = {
    # a window shorter than prompt + output: rejected drafts must roll back past the window's edge
    "mistral": (MistralForCausalLM, MistralConfig(**SHAPE, sliding_window=8)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**SHAPE)),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**SHAPE, head_dim=16)),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_matches_target_only_on_sharded_family(family, tmp_path):
    cls, config = FAMILIES[family]
    torch.manual_seed(0)
    model = cls(config).eval()
    model.save_pretrained(tmp_path, max_shard_size="100KB")  # sharded, with an index
    assert (tmp_path / "model.safetensors.index.json").is_file()
    target = TargetEngine(tmp_path)
    torch.testing.assert_close(read_target_embedding(tmp_path), model.get_input_embeddings().weight)
    oracle = OracleDraft(model, corrupt=0.3)
    accepted = 0
    for i in range(4):
        prompt = torch.randint(2, 300, (5 + 4 * i,)).tolist()
        oracle.expect(prompt[0])
        request = GenerationRequest(prompt_ids=prompt, max_new_tokens=30, num_draft_tokens=4, ignore_eos=True)
        tokens, event = [], None
        for event in run_rounds(target, oracle, request):
            tokens.extend(event.new_tokens)
        ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=30, eos_token_id=None)
        assert tokens == ref[0, len(prompt):].tolist()
        accepted += event.stats.num_accepted_tokens
    assert accepted > 0
