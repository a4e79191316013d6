"""Reading the published EAGLE-3 heads as they are, and writing Tandem's own in two of their layouts.

The layouts and what each one's fields mean: draft_server/layouts.py. Which target hidden states a head's
layer ids name: tandem/aux_layers.py (read here into hidden-states ids, the ones the target captures).
What a head may leave out, and where Tandem then takes it from:
  embed_tokens  the target's token embedding (that one tensor: draft_server/weights.py finds it)
  lm_head       with tie_word_embeddings, the head's embedding; else the target's lm_head (vLLM shares it,
                ModelOpt's export copies it in); the rows of the draft vocabulary either way
  d2t           none: a draft over the whole vocabulary (draft id = target id)
  t2d           the target ids d2t reaches
  input_norm    all ones (speculators loads a norm_before_fc head without it so)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from draft_server.layouts import (
    LAYER_FIELDS,
    REFERENCE,
    SPECULATORS,
    HeadFormatError,
    canonical_weights,
    parse,
)
from draft_server.model import Eagle3Config, Eagle3Draft
from draft_server.weights import (
    WeightsError,
    read_all,
    read_target_embedding,
    read_target_output_embedding,
    tensor_names,
)
from tandem import aux_layers

__all__ = ["REFERENCE", "SPECULATORS", "DraftLoadError", "head_kind", "load_draft", "read_config",
           "read_target_embedding", "save_draft"]


class DraftLoadError(ValueError):
    """The draft checkpoint is malformed or does not fit the target; the message says how."""


def read_config(
    draft_dir: str | Path, target_dir: str | Path | None = None, aux_layer_convention: str | None = None
) -> tuple[Eagle3Config, str]:
    """(the head's Eagle3Config, its layout). aux_layer_ids come out as hidden-states ids, converted from the
    head's convention (`aux_layer_convention` overrides it); `target_dir` gives the target's depth, which
    settles an id equal to it (tandem/aux_layers.py)."""
    directory = Path(draft_dir)
    try:
        raw = aux_layers.read_head_config(directory)
        config, layout = parse(raw, tensor_names(directory), str(directory))
        num_layers = aux_layers.target_num_layers(target_dir) if target_dir is not None else None
        ids = aux_layers.resolve(raw, num_layers, aux_layer_convention).hidden_state_ids
    except (HeadFormatError, WeightsError) as exc:
        raise DraftLoadError(str(exc)) from None
    except ValueError as exc:
        raise DraftLoadError(f"draft {directory}: {exc}") from None
    config.aux_layer_ids = list(ids) if ids is not None else None
    return config, layout


def head_kind(draft_dir: str | Path) -> str:
    """The kind of head in `draft_dir` in words (Eagle3Config.kind), from its config and weight names alone."""
    return read_config(draft_dir)[0].kind


def _explain_keys(config: Eagle3Config, missing: list[str], unexpected: list[str]) -> str:
    """Why the keys do not fit: the flag a key belongs to, rather than the bare lists."""
    hints = []
    flags = (("fc_norm", "fc_norm."), ("norm_before_fc", "input_norm."), ("qk_norm", "midlayer.self_attn.q_norm"))
    for flag, prefix in flags:
        on = getattr(config, flag)
        if on and any(k.startswith(prefix) for k in missing):
            hints.append(f"its config sets {flag} but it has no {prefix}* weights")
        if not on and any(k.startswith(prefix) for k in unexpected):
            name = flag if flag != "qk_norm" else "a Qwen3 layer (transformer_layer_config model_type qwen3)"
            hints.append(f"it has {prefix}* weights but its config does not set {name}")
    if any(k.endswith(".bias") for k in missing):
        hints.append("its config sets attention_bias or mlp_bias but it has no biases")
    if any(k.endswith(".bias") for k in unexpected):
        hints.append("it has biases but its config sets neither attention_bias nor mlp_bias")
    lists = "; ".join(f"{what} {keys[:8]}{' ...' if len(keys) > 8 else ''}"
                      for what, keys in (("missing", missing), ("unexpected", unexpected)) if keys)
    return "; ".join(hints + [lists])


def _complete(weights: dict[str, torch.Tensor], config: Eagle3Config, target_dir, where: str) -> None:
    """Fill in what a head may leave out (the module docstring), in Eagle3Draft's key names."""
    if "d2t" not in weights:
        if config.draft_vocab_size != config.vocab_size:
            raise DraftLoadError(f"{where}: a draft vocabulary of {config.draft_vocab_size} of {config.vocab_size} "
                                 f"tokens and no d2t to map it")
        weights["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
    target_ids = weights["d2t"].long() + torch.arange(config.draft_vocab_size)
    if len(target_ids) and (int(target_ids.min()) < 0 or int(target_ids.max()) >= config.vocab_size):
        raise DraftLoadError(f"{where}: d2t maps draft ids outside the vocabulary of {config.vocab_size}")
    if "t2d" not in weights:
        weights["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool)
        weights["t2d"][target_ids] = True
    if "embed_tokens.weight" not in weights:
        if target_dir is None:
            raise DraftLoadError(f"{where} has no embed_tokens.weight; give the target checkpoint to read its "
                                 f"token embedding from")
        weights["embed_tokens.weight"] = read_target_embedding(target_dir)
    if "lm_head.weight" not in weights:
        if config.layer.tie_word_embeddings:
            rows = weights["embed_tokens.weight"]
        elif target_dir is not None:
            rows = read_target_output_embedding(target_dir)
        else:
            raise DraftLoadError(f"{where} has no lm_head.weight and does not tie it to embed_tokens; give the "
                                 f"target checkpoint to read its lm_head from")
        if rows.shape[0] != config.vocab_size:
            raise DraftLoadError(f"{where} has no lm_head.weight; the one it shares has {rows.shape[0]} rows, "
                                 f"the vocabulary {config.vocab_size}")
        weights["lm_head.weight"] = rows[target_ids]
    if config.norm_before_fc and "input_norm.weight" not in weights:
        weights["input_norm.weight"] = torch.ones(3 * config.target_hidden_size)


def load_draft(
    draft_dir: str | Path,
    target_dir: str | Path | None = None,
    device: str = "cpu",
    dtype=torch.float32,
    aux_layer_convention: str | None = None,
) -> Eagle3Draft:
    directory = Path(draft_dir)
    config, layout = read_config(directory, target_dir, aux_layer_convention)
    where = f"draft {directory} ({layout} layout)"
    try:
        weights = canonical_weights(read_all(directory))
        _complete(weights, config, target_dir, where)
    except WeightsError as exc:
        raise DraftLoadError(f"{where}: {exc}") from None
    model = Eagle3Draft(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        why = _explain_keys(config, missing, unexpected)
        raise DraftLoadError(f"{where}: the weights do not fit its config: {why}")
    for key, tensor in weights.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise DraftLoadError(f"{where}: {key} has shape {list(tensor.shape)}, its config implies "
                                 f"{list(expected[key].shape)}")
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in weights.items()})
    return model.to(device=device, dtype=dtype).eval()


def _layer_fields(config: Eagle3Config) -> dict:
    layer = {k: v for k, v in config.layer.to_dict().items() if k in LAYER_FIELDS and v is not None}
    layer["model_type"] = "qwen3" if config.qk_norm else "llama"
    rope = config.layer.to_dict().get("rope_parameters") or {}
    layer["rope_theta"] = float(rope.get("rope_theta", 10000.0))  # top-level, as published checkpoints write it
    if rope.get("rope_type", "default") != "default":
        layer["rope_scaling"] = rope
    return layer


def save_draft(
    model: Eagle3Draft, out_dir: str | Path, layout: str = REFERENCE, include_embeddings: bool = False,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write `model` as a published EAGLE-3 head would be: config.json + model.safetensors, its floating
    weights in `dtype` (d2t and t2d as they are). Its layer ids are written as hidden-states ids, with that
    convention recorded (aux_layers.RECORD_FIELD)."""
    out = Path(out_dir)
    config = model.config
    layer = _layer_fields(config)
    state = {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous()
             for k, v in model.state_dict().items()}
    dtype_name = str(dtype).removeprefix("torch.")
    if not include_embeddings:
        state.pop("embed_tokens.weight")
    ids = {}
    if config.aux_layer_ids:
        ids = {"eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
               aux_layers.RECORD_FIELD: aux_layers.HIDDEN_STATES}
    options = {name: True for name in ("norm_before_fc", "fc_norm", "norm_output") if getattr(config, name)}
    parallel = {}
    if config.parallel_drafting:  # P-EAGLE: NeMo's and speculators' field names
        parallel = {"parallel_drafting": True, "mask_token_id": config.mask_token_id, "num_depths": config.num_depths,
                    "down_sample_ratio": config.down_sample_ratio,
                    "down_sample_ratio_min": config.down_sample_ratio_min}
    if layout == REFERENCE:
        if config.qk_norm:
            raise ValueError("a head with a Qwen3 layer (q_norm, k_norm) is written in the speculators layout")
        raw = {
            "architectures": ["LlamaForCausalLMEagle3"],
            **layer,
            "num_hidden_layers": config.num_layers,
            "draft_vocab_size": config.draft_vocab_size,
            "target_hidden_size": config.target_hidden_size,
            "torch_dtype": dtype_name,
            **options,  # top-level, as SpecForge writes them
            **parallel,
        }
        if config.norm_before_residual:
            raw["norm_before_residual"] = True
        if ids:
            raw["eagle_config"] = ids
    elif layout == SPECULATORS:
        state = {("layers.0." + k.removeprefix("midlayer.")) if k.startswith("midlayer.") else k: v
                 for k, v in state.items()}
        parallel.pop("parallel_drafting", None)  # speculators says it by its model type
        raw = {
            "architectures": ["PEagleSpeculator" if config.parallel_drafting else "Eagle3Speculator"],
            "speculators_model_type": "peagle" if config.parallel_drafting else "eagle3",
            "speculators_version": "0.1.0",
            "transformer_layer_config": {**layer, "num_hidden_layers": config.num_layers},
            **parallel,
            "draft_vocab_size": config.draft_vocab_size,
            "target_hidden_size": config.target_hidden_size,
            "norm_before_residual": config.norm_before_residual,
            "eagle_aux_hidden_state_layer_ids": None,
            **{name: getattr(config, name) for name in ("norm_before_fc", "fc_norm", "norm_output")},
            **ids,
        }
    else:
        raise ValueError(f"layout must be {REFERENCE!r} or {SPECULATORS!r}, got {layout!r}")
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True))
    return out
