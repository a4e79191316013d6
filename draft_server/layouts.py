"""The published EAGLE-3 head layouts, read into one Eagle3Config and one set of weight names.

Field and key names are copied from the trainers' own files (the README's table has the sources):

reference   SafeAILab/EAGLE (yuhuili/EAGLE3-*, AngelSlim): config.json a LlamaConfig with architectures
            ["LlamaForCausalLMEagle3"], num_hidden_layers 1, draft_vocab_size, maybe target_hidden_size;
            keys fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d, maybe embed_tokens.weight.
specforge   sgl-project/SpecForge (llama3_eagle.py): the reference layout, plus eagle_config
            {eagle_aux_hidden_state_layer_ids} (outputs of layers) and top-level fc_norm / norm_output
            (EAGLE-3.1; keys fc_norm.{0,1,2}.weight).
modelopt    NVIDIA ModelOpt (export/plugins/hf_spec_export.py, hf_spec_configs.py): architectures
            ["LlamaForCausalLMEagle3"], eagle_config {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state,
            use_input_layernorm_in_first_layer, use_last_layernorm, use_mtp_layernorm, next_layer_regular,
            parallel_draft_step, ...}; keys layers.0.*, fc, norm, lm_head, d2t (no t2d, no embed_tokens).
nemo        NeMo Automodel (speculative/eagle/draft_llama.py, recipes/llm/train_eagle3.py): the target's own
            config (model_type llama / phi3 / qwen3, its num_hidden_layers, attention_bias, mlp_bias, a
            head_dim decoupled from hidden/heads) with architectures ["LlamaEagle3DraftModel"],
            draft_vocab_size, target_hidden_size, fc_norm, norm_output, parallel_drafting; keys under a
            `model.` prefix (model.fc.weight, model.layers.0.hidden_norm.weight, model.fc_norm.0.weight,
            model.embed_tokens.weight, model.norm.weight) and lm_head.weight, d2t, t2d at the top.
speculators vllm-project/speculators (models/eagle3/config.py, core.py): speculators_model_type "eagle3",
            transformer_layer_config (model_type llama or qwen3: Qwen3's q_norm / k_norm), draft_vocab_size,
            target_hidden_size, norm_before_residual, eagle_aux_hidden_state_layer_ids, norm_before_fc
            (key input_norm.weight), fc_norm, norm_output; keys layers.N.*, fc, norm, lm_head, d2t, t2d.

Heads of N decoder layers: layer 0 the fused one, layers 1..N-1 plain Llama layers (keys layers.{i}.*,
model.layers.{i}.* in NeMo's); N is counted from the weights, and speculators' transformer_layer_config
num_hidden_layers must agree (the other layouts' num_hidden_layers is not read: NeMo's config is the
target's, with the target's depth).

P-EAGLE (parallel drafting; speculators PR #480, NeMo's peagle_draft.py): NeMo and the reference layout set
`parallel_drafting` true, speculators writes speculators_model_type "peagle"; both hold the key
`mask_hidden` [1, 1, 3 * target_hidden_size] and the fields mask_token_id (older speculators: ptd_token_id),
num_depths (para_depths), down_sample_ratio, down_sample_ratio_min. A head without mask_token_id is refused.

Every layout maps onto Eagle3Draft's keys by one rule: drop a leading `model.`, read `layers.0.` as
`midlayer.`. What Tandem cannot run is refused with the reason: other than three fused hidden states (its
feature path carries 3 x hidden), ModelOpt's parallel draft heads, partial rotary embeddings, sliding-window
draft attention.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from transformers import AutoConfig, LlamaConfig

from draft_server.model import Eagle3Config
from tandem.aux_layers import RECORD_FIELD, config_field, trainer_of

REFERENCE, SPECFORGE, MODELOPT, NEMO, SPECULATORS = "reference", "specforge", "modelopt", "nemo", "speculators"
LAYOUTS = (REFERENCE, SPECFORGE, MODELOPT, NEMO, SPECULATORS)

# The decoder layer's fields, copied into the LlamaConfig the draft is built from (the rest are a model
# family's own: sliding windows, MoE sizes, vision towers).
LAYER_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rms_norm_eps", "hidden_act", "max_position_embeddings", "attention_bias", "mlp_bias", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "pad_token_id",
)
_LAYER_KEY = re.compile(r"^(?:model\.)?(?:layers\.(\d+)|midlayer)\.")
# Saved by some trainers, derived from the config here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class HeadFormatError(ValueError):
    """A head Tandem cannot run as it is; the message names the layout and the field or key."""


def canonical_key(key: str) -> str:
    """A head's weight name -> Eagle3Draft's: `model.` dropped (NeMo), `layers.0.` read as `midlayer.`."""
    key = key.removeprefix("model.")
    return "midlayer." + key[len("layers.0."):] if key.startswith("layers.0.") else key


def canonical_weights(weights: dict) -> dict:
    return {canonical_key(k): v for k, v in weights.items() if not k.endswith(_IGNORED_SUFFIXES)}


def detect_layout(raw: dict, keys: Iterable[str]) -> str:
    keys = list(keys)
    trainer = trainer_of(raw)
    if trainer == "speculators":
        return SPECULATORS
    if trainer == NEMO or any(k.startswith("model.") for k in keys):
        return NEMO
    if trainer == MODELOPT or any(k.startswith("layers.") for k in keys):
        return MODELOPT
    if config_field(raw, RECORD_FIELD) is not None:  # written by Tandem (draft_server/checkpoint.py)
        return REFERENCE
    if config_field(raw, "eagle_aux_hidden_state_layer_ids") or raw.get("fc_norm") or raw.get("norm_output"):
        return SPECFORGE
    return REFERENCE


def _layer_indices(keys: Iterable[str]) -> set[int]:
    found = set()
    for key in keys:
        match = _LAYER_KEY.match(key)
        if match:
            found.add(int(match[1] or 0))
    return found


def _layer_config(layer_raw: dict, model_type: str, where: str) -> LlamaConfig:
    """The decoder layer's shape as the trainer built it: its model family's config class with that class's
    defaults (speculators writes only the fields that differ from them), copied into a LlamaConfig."""
    fields = {k: v for k, v in layer_raw.items() if k not in ("architectures", "model_type", "auto_map")}
    try:
        family = AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError, TypeError) as exc:
        raise HeadFormatError(f"{where}: model_type {model_type!r} cannot be read ({exc})") from None
    rope = dict(getattr(family, "rope_parameters", None) or {})
    partial = rope.get("partial_rotary_factor", getattr(family, "partial_rotary_factor", 1.0)) or 1.0
    if float(partial) != 1.0:
        raise HeadFormatError(f"{where}: partial_rotary_factor {partial}: Tandem's draft layer rotates every "
                              f"dimension of a head")
    if "rope_theta" not in layer_raw and "rope_parameters" not in layer_raw and "rope_scaling" not in layer_raw:
        rope = {"rope_type": "default", "rope_theta": 10000.0}  # the reference heads were trained with it
    copied = {k: getattr(family, k) for k in LAYER_FIELDS if getattr(family, k, None) is not None}
    copied.setdefault("head_dim", family.hidden_size // family.num_attention_heads)
    return LlamaConfig(**copied, num_hidden_layers=1, rope_parameters=rope or None)


def _flag(raw: dict, name: str, default: bool = False) -> bool:
    value = config_field(raw, name)
    return default if value is None else bool(value)


def _refuse(where: str, reason: str) -> None:
    raise HeadFormatError(f"{where}: {reason}")


def parse(raw: dict, keys: Iterable[str], directory: str = "draft") -> tuple[Eagle3Config, str]:
    """A head's config.json and weight names -> (Eagle3Config, layout). aux_layer_ids is left as written:
    draft_server/checkpoint.py converts it (tandem/aux_layers.py)."""
    keys = list(keys)
    layout = detect_layout(raw, keys)
    where = f"draft {directory} ({layout} layout)"
    mla = [k for k in keys if "kv_a_proj_with_mqa" in k or "q_a_proj" in k]
    if mla or any("Deepseek" in a for a in raw.get("architectures") or []):
        _refuse(where, f"MLA attention ({(raw.get('architectures') or ['?'])[0]}, {mla[:1]}): Tandem's draft layer is "
                       f"Llama or Qwen3 attention")
    parallel = False
    layer_count = None  # the decoder layers the config says it has, where it says so
    if layout == SPECULATORS:
        if raw["speculators_model_type"] not in ("eagle3", "peagle"):
            _refuse(where, f"speculators_model_type is {raw['speculators_model_type']!r}; Tandem runs 'eagle3' "
                           f"and 'peagle'")
        parallel = raw["speculators_model_type"] == "peagle"
        layer_raw = dict(raw.get("transformer_layer_config") or {})
        model_type = layer_raw.get("model_type", "qwen3")  # speculators' default transformer_layer_config
        if model_type not in ("llama", "qwen3"):
            _refuse(where, f"transformer_layer_config.model_type {model_type!r}: Tandem runs llama and qwen3 layers")
        layer_count = ("transformer_layer_config.num_hidden_layers", int(layer_raw.get("num_hidden_layers", 1)))
        if layer_raw.get("use_sliding_window") or "sliding_attention" in (layer_raw.get("layer_types") or []):
            _refuse(where, "sliding-window attention in transformer_layer_config: Tandem's draft attends to all "
                           "of its context")
        qk_norm = model_type == "qwen3"
        # vLLM reads a speculators config without the field as norm_before_residual true (speculators/algos.py)
        norm_before_residual = bool(raw.get("norm_before_residual", True))
    else:
        # NeMo builds the layer from the target's config class; the others from a LlamaConfig
        model_type = (raw.get("model_type") or "llama") if layout == NEMO else "llama"
        layer_raw, qk_norm = dict(raw), False
        norm_before_residual = _flag(raw, "norm_before_residual")
        parallel = _flag(raw, "parallel_drafting")
        if layout == MODELOPT:
            eagle = raw.get("eagle_config") or {}
            if eagle.get("use_aux_hidden_state") is False:
                _refuse(where, "eagle_config.use_aux_hidden_state is false: an EAGLE-1/2 head, not EAGLE-3")
            if eagle.get("use_last_layernorm") is False:
                _refuse(where, "eagle_config.use_last_layernorm is false: the head has no final norm")
            if eagle.get("use_mtp_layernorm"):
                _refuse(where, "eagle_config.use_mtp_layernorm is true: an MTP-style head, not EAGLE-3")
            if int(eagle.get("parallel_draft_step") or 1) > 1:
                _refuse(where, f"eagle_config.parallel_draft_step is {eagle['parallel_draft_step']}: Tandem "
                               f"drafts one token per step")
    layers = _layer_indices(keys) or {0}
    if layers != set(range(len(layers))):
        _refuse(where, f"weights of decoder layers {sorted(layers)}: expected layers 0..{len(layers) - 1}")
    if layer_count is not None and layer_count[1] != len(layers):
        _refuse(where, f"{layer_count[0]} is {layer_count[1]} but it has weights of {len(layers)} decoder "
                       f"layer{'s' if len(layers) > 1 else ''}")
    masked = any(k.removeprefix("model.") == "mask_hidden" for k in keys)
    if masked != parallel:
        _refuse(where, "it has a mask_hidden weight but its config does not set parallel_drafting" if masked else
                "parallel_drafting is set but it has no mask_hidden weight")
    mask_token_id = config_field(raw, "mask_token_id", config_field(raw, "ptd_token_id"))
    if parallel and mask_token_id is None:
        _refuse(where, "parallel_drafting (P-EAGLE) without mask_token_id: the masked positions' token is not known")
    num_depths = config_field(raw, "num_depths", config_field(raw, "para_depths", 8))  # speculators' default
    num_aux = config_field(raw, "num_aux_hidden_states")
    ids = config_field(raw, "eagle_aux_hidden_state_layer_ids")
    if num_aux is None and ids:
        num_aux = len(ids)
    if num_aux is not None and int(num_aux) != 3:
        _refuse(where, f"{num_aux} fused hidden states (eagle_aux_hidden_state_layer_ids {ids}): Tandem's target "
                       f"captures three (the feature path carries 3 x hidden)")
    layer = _layer_config(layer_raw, model_type, where)
    config = Eagle3Config(
        layer=layer,
        target_hidden_size=int(config_field(raw, "target_hidden_size") or layer.hidden_size),
        draft_vocab_size=int(config_field(raw, "draft_vocab_size") or layer.vocab_size),
        norm_before_residual=norm_before_residual,
        aux_layer_ids=[int(i) for i in ids] if ids else None,
        norm_before_fc=_flag(raw, "norm_before_fc"),
        fc_norm=_flag(raw, "fc_norm"),
        norm_output=_flag(raw, "norm_output"),
        qk_norm=qk_norm,
        num_layers=len(layers),
        parallel_drafting=parallel,
        mask_token_id=int(mask_token_id or 0),
        num_depths=int(num_depths) if parallel else 1,
        down_sample_ratio=float(config_field(raw, "down_sample_ratio", 0.7)),
        down_sample_ratio_min=float(config_field(raw, "down_sample_ratio_min", 0.2)),
    )
    return config, layout
