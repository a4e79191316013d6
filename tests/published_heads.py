"""Miniature EAGLE-3 heads written as each trainer writes them, for the tiny target (hidden 64, 8 layers,
vocabulary 512). Written here from the published files' field and key names, not with Tandem's save_draft:

  reference    SafeAILab/EAGLE eagle/traineagle3/config.json (its fields), cnets.py (midlayer.*, d2t, t2d)
  specforge    sgl-project/SpecForge configs/llama3-8B-eagle3.json, gpt-oss-120B-eagle3.json (eagle_config ids),
               qwen3-30B-A3B-eagle3.1.json (fc_norm, norm_output, head_dim); modeling/draft/llama3_eagle.py keys
  modelopt     NVIDIA/Model-Optimizer modelopt/torch/export/plugins/hf_spec_configs.py (llama template),
               hf_spec_export.py (LLAMA_EAGLE_SINGLE_LAYER keys: layers.0.*, fc, norm, d2t, lm_head)
  nemo         NVIDIA-NeMo/Automodel recipes/llm/train_eagle3.py (the target's config + draft fields),
               components/speculative/eagle/draft_llama.py (model.* keys, model.fc_norm.N)
  speculators  vllm-project/speculators src/speculators/models/eagle3/config.py, core.py (layers.N.*, input_norm,
               fc_norm.N; Qwen3 layers' q_norm / k_norm)
  P-EAGLE      NeMo components/speculative/eagle/draft_llama.py, peagle_draft.py (parallel_drafting, mask_hidden
               [1, 1, 3H], mask_token_id, num_depths, down_sample_ratio; model.layers.N.* plain Llama layers for
               N >= 1); speculators models/peagle/config.py (speculators_model_type "peagle", mask_token_id)

Every head holds the same canonical tensors (`canonical_weights`), renamed per layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

VOCAB, HIDDEN, LAYERS, DRAFT_VOCAB = 512, 64, 8, 384
HEADS, KV_HEADS, INTERMEDIATE = 4, 2, 96
OUTPUT_IDS = [1, LAYERS // 2 - 1, LAYERS - 4]  # SpecForge's / ModelOpt's default: outputs of layers 1, 3, 4


def layer_fields(head_dim: int | None = None) -> dict:
    fields = {"hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-05, "vocab_size": VOCAB, "hidden_act": "silu",
              "max_position_embeddings": 2048}
    if head_dim is not None:
        fields["head_dim"] = head_dim
    return fields


def canonical_weights(seed: int, head_dim: int = HIDDEN // HEADS, *, attention_bias=False, mlp_bias=False,
                      qk_norm=False, fc_norm=False, input_norm=False, embed=False, layers: int = 1,
                      mask_hidden: bool = False) -> dict[str, torch.Tensor]:
    """Random tensors under Eagle3 reference names (midlayer.*; layers.N.* for the plain layers of a head of
    several, mask_hidden for a P-EAGLE head), sized for the tiny target."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.15):
        return torch.randn(*shape, generator=g) * scale

    def norm(n):
        return 1.0 + rand(n, scale=0.1)

    w = {
        "fc.weight": rand(HIDDEN, 3 * HIDDEN, scale=0.08),
        "midlayer.hidden_norm.weight": norm(HIDDEN),
        "midlayer.input_layernorm.weight": norm(HIDDEN),
        "midlayer.post_attention_layernorm.weight": norm(HIDDEN),
        "midlayer.self_attn.q_proj.weight": rand(HEADS * head_dim, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": rand(KV_HEADS * head_dim, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": rand(KV_HEADS * head_dim, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": rand(HIDDEN, HEADS * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(INTERMEDIATE, HIDDEN),
        "midlayer.mlp.up_proj.weight": rand(INTERMEDIATE, HIDDEN),
        "midlayer.mlp.down_proj.weight": rand(HIDDEN, INTERMEDIATE),
        "norm.weight": norm(HIDDEN),
        "lm_head.weight": rand(DRAFT_VOCAB, HIDDEN, scale=0.5),
    }
    if attention_bias:
        for name, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
            w[f"midlayer.self_attn.{name}_proj.bias"] = rand(rows * head_dim)
        w["midlayer.self_attn.o_proj.bias"] = rand(HIDDEN)
    if mlp_bias:
        w |= {"midlayer.mlp.gate_proj.bias": rand(INTERMEDIATE), "midlayer.mlp.up_proj.bias": rand(INTERMEDIATE),
              "midlayer.mlp.down_proj.bias": rand(HIDDEN)}
    if qk_norm:
        w |= {"midlayer.self_attn.q_norm.weight": norm(head_dim), "midlayer.self_attn.k_norm.weight": norm(head_dim)}
    if fc_norm:
        w |= {f"fc_norm.{i}.weight": norm(HIDDEN) for i in range(3)}
    if input_norm:
        w["input_norm.weight"] = norm(3 * HIDDEN)
    if embed:
        w["embed_tokens.weight"] = rand(VOCAB, HIDDEN, scale=1.0)
    for n in range(1, layers):  # plain Llama layers over H
        p = f"layers.{n}."
        w |= {p + "input_layernorm.weight": norm(HIDDEN), p + "post_attention_layernorm.weight": norm(HIDDEN),
              p + "self_attn.q_proj.weight": rand(HEADS * head_dim, HIDDEN),
              p + "self_attn.k_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
              p + "self_attn.v_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
              p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * head_dim),
              p + "mlp.gate_proj.weight": rand(INTERMEDIATE, HIDDEN), p + "mlp.up_proj.weight": rand(INTERMEDIATE, HIDDEN),
              p + "mlp.down_proj.weight": rand(HIDDEN, INTERMEDIATE)}
        if qk_norm:
            w |= {p + "self_attn.q_norm.weight": norm(head_dim), p + "self_attn.k_norm.weight": norm(head_dim)}
    if mask_hidden:
        w["mask_hidden"] = rand(1, 1, 3 * HIDDEN, scale=1.0)
    target_ids = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
    w["d2t"] = target_ids - torch.arange(DRAFT_VOCAB)  # target id = draft id + d2t[draft id]
    w["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
    w["t2d"][target_ids] = True
    return w


def _write(out: Path, config: dict, weights: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _renamed(weights: dict, prefix: str, top: tuple[str, ...] = ()) -> dict:
    """midlayer.* -> layers.0.*, then `prefix` before every name except those in `top`."""
    out = {}
    for key, value in weights.items():
        name = "layers.0." + key.removeprefix("midlayer.") if key.startswith("midlayer.") else key
        out[name if key in top else prefix + name] = value
    return out


def write_reference(out: Path, weights: dict, **fields) -> Path:
    config = {"architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 0, "eos_token_id": 1,
              "initializer_range": 0.02, "model_type": "llama", "num_hidden_layers": 1, "pad_token_id": 0,
              "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.28.1",
              "use_cache": True, "draft_vocab_size": DRAFT_VOCAB, **layer_fields(), **fields}
    return _write(out, config, weights)


def write_specforge(out: Path, weights: dict, aux_ids=OUTPUT_IDS, **fields) -> Path:
    config = {"architectures": ["LlamaForCausalLMEagle3"],
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_ids},
              "head_dim": HIDDEN // HEADS, "model_type": "llama", "num_hidden_layers": 1, "pad_token_id": 0,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
              "draft_vocab_size": DRAFT_VOCAB, **layer_fields(), **fields}
    return _write(out, config, weights)


def write_modelopt(out: Path, weights: dict, aux_ids=OUTPUT_IDS, **fields) -> Path:
    config = {"architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 0, "eos_token_id": 1,
              "initializer_range": 0.02, "model_type": "llama", "num_hidden_layers": 1, "pad_token_id": None,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.55.0",
              "use_cache": True, "draft_vocab_size": DRAFT_VOCAB, "rope_scaling": None, "attention_bias": False,
              "attention_dropout": 0.0, "head_dim": HIDDEN // HEADS, "mlp_bias": False, "pretraining_tp": 1,
              "rope_theta": 10000.0,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True,
                               "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
                               "use_mtp_layernorm": False, "next_layer_regular": True, "parallel_draft_step": 1,
                               "parallel_draft_heads_num_layers": 1},
              **layer_fields(), **fields}
    kept = {k: v for k, v in weights.items() if k not in ("t2d", "embed_tokens.weight")}  # not exported
    return _write(out, config, _renamed(kept, ""))


def write_nemo(out: Path, weights: dict, family_config: dict, **fields) -> Path:
    """`family_config`: the target's config dict (LlamaConfig / Phi3Config / Qwen3Config .to_dict())."""
    config = {**family_config, "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": HIDDEN,
              "architectures": ["LlamaEagle3DraftModel"], "tie_word_embeddings": False, "attn_implementation": "eager",
              "fc_norm": False, "norm_output": False, "parallel_drafting": False, **fields}
    return _write(out, config, _renamed(weights, "model.", top=("lm_head.weight", "d2t", "t2d", "mask_hidden")))


def write_speculators(out: Path, weights: dict, layer_config: dict, aux_ids=None, **fields) -> Path:
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "speculators_version": "0.3.0",
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
                                     "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}},
              "transformer_layer_config": layer_config, "draft_vocab_size": DRAFT_VOCAB, "norm_before_residual": True,
              "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": aux_ids, "norm_before_fc": False,
              "fc_norm": False, "norm_output": False, "embed_requires_grad": False, **fields}
    return _write(out, config, _renamed(weights, ""))
