"""Reading and writing EAGLE-3 heads in the two published layouts.

reference (SafeAILab/EAGLE, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): config.json is a LlamaConfig with
  num_hidden_layers 1, draft_vocab_size, maybe target_hidden_size; keys `midlayer.*`.
speculators (vLLM's speculators): config has speculators_model_type "eagle3", transformer_layer_config,
  draft_vocab_size, target_hidden_size, eagle_aux_hidden_state_layer_ids, norm_before_residual;
  keys `layers.0.*`.
Both: fc.weight [H, 3Ht], norm.weight, lm_head.weight [draft_vocab, H], d2t int64 [draft_vocab]
(target = draft + d2t[draft]), t2d bool [vocab], usually no embed_tokens (then the target's
`model.embed_tokens.weight` is read, that one tensor only).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from draft_server.model import Eagle3Config, Eagle3Draft

REFERENCE = "reference"
SPECULATORS = "speculators"
TARGET_EMBED_KEY = "model.embed_tokens.weight"


# The LlamaConfig fields a published head's config carries (everything else is a transformers default).
_LAYER_KEYS = (
    "hidden_act", "hidden_size", "intermediate_size", "max_position_embeddings", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "bos_token_id", "eos_token_id",
    "pad_token_id", "tie_word_embeddings", "attention_bias", "mlp_bias",
)


# Newer speculators heads can normalise around fc or the output; this head does neither.
_UNSUPPORTED_SPECULATORS_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


class DraftLoadError(ValueError):
    """The draft checkpoint is malformed or does not fit the target; the message says how."""


def read_config(draft_dir: str | Path) -> tuple[Eagle3Config, str]:
    path = Path(draft_dir) / "config.json"
    if not path.is_file():
        raise DraftLoadError(f"draft checkpoint {draft_dir} has no config.json")
    raw = json.loads(path.read_text())
    if raw.get("speculators_model_type") is not None:
        if raw["speculators_model_type"] != "eagle3":
            raise DraftLoadError(f"speculators_model_type is {raw['speculators_model_type']!r}, not 'eagle3'")
        layout = SPECULATORS
        unsupported = [flag for flag in _UNSUPPORTED_SPECULATORS_FLAGS if raw.get(flag)]
        if unsupported:  # each changes the head's math; loading the weights anyway would be silently wrong
            raise DraftLoadError(f"draft {draft_dir}: speculators options {unsupported} are not supported")
        layer_raw = dict(raw["transformer_layer_config"])
    else:
        layout = REFERENCE
        layer_raw = {k: v for k, v in raw.items() if k not in ("architectures", "draft_vocab_size")}
    # The reference config often has no rope_theta: the head was trained with 10000.
    if "rope_parameters" not in layer_raw and "rope_scaling" not in layer_raw:
        layer_raw.setdefault("rope_theta", 10000.0)
    layer_raw["num_hidden_layers"] = 1
    layer_raw.pop("model_type", None)
    layer = LlamaConfig(**layer_raw)
    aux = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    config = Eagle3Config(
        layer=layer,
        target_hidden_size=int(raw.get("target_hidden_size") or layer.hidden_size),
        draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        aux_layer_ids=[int(i) for i in aux] if aux else None,
    )
    return config, layout


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if single.is_file():
        return load_file(single)
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            tensors.update(load_file(directory / shard))
        return tensors
    binary = directory / "pytorch_model.bin"
    if binary.is_file():
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise DraftLoadError(f"{directory} has no model.safetensors, safetensors index or pytorch_model.bin")


def read_target_embedding(target_dir: str | Path) -> torch.Tensor:
    """The one tensor the draft needs from the target checkpoint, without loading the rest."""
    directory = Path(target_dir)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shard = json.loads(index.read_text())["weight_map"].get(TARGET_EMBED_KEY)
        if shard is None:
            raise DraftLoadError(f"{index} has no {TARGET_EMBED_KEY}")
        path = directory / shard
    else:
        path = directory / "model.safetensors"
        if not path.is_file():
            raise DraftLoadError(f"target checkpoint {directory} has no model.safetensors to read embeddings from")
    with safe_open(path, framework="pt") as f:
        if TARGET_EMBED_KEY not in set(f.keys()):
            raise DraftLoadError(f"{path} has no {TARGET_EMBED_KEY}")
        return f.get_tensor(TARGET_EMBED_KEY)


def load_draft(
    draft_dir: str | Path, target_dir: str | Path | None = None, device: str = "cpu", dtype=torch.float32
) -> Eagle3Draft:
    directory = Path(draft_dir)
    config, layout = read_config(directory)
    weights = _read_weights(directory)
    if layout == SPECULATORS:
        weights = {k.replace("layers.0.", "midlayer.", 1): v for k, v in weights.items()}
    if "embed_tokens.weight" not in weights:
        if target_dir is None:
            raise DraftLoadError(
                f"draft {directory} has no embed_tokens.weight; give the target checkpoint to read "
                f"{TARGET_EMBED_KEY} from"
            )
        weights["embed_tokens.weight"] = read_target_embedding(target_dir)
    if "d2t" not in weights:  # a draft over the full vocabulary
        weights["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
    if "t2d" not in weights:
        weights["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    model = Eagle3Draft(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise DraftLoadError(f"draft {directory} ({layout} layout): missing keys {missing}, unexpected {unexpected}")
    for key, tensor in weights.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise DraftLoadError(
                f"draft {directory}: {key} has shape {list(tensor.shape)}, config implies {list(expected[key].shape)}"
            )
    model.load_state_dict({k: v.to(expected[k].dtype) if v.is_floating_point() else v for k, v in weights.items()})
    d2t_targets = model.d2t + torch.arange(config.draft_vocab_size)
    if int(d2t_targets.min()) < 0 or int(d2t_targets.max()) >= config.vocab_size:
        raise DraftLoadError(f"draft {directory}: d2t maps draft ids outside the vocabulary of {config.vocab_size}")
    return model.to(device=device, dtype=dtype).eval()


def save_draft(
    model: Eagle3Draft, out_dir: str | Path, layout: str = REFERENCE, include_embeddings: bool = False
) -> Path:
    """Write `model` as a published EAGLE-3 head would be: config.json + model.safetensors."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = model.config
    layer = {k: v for k, v in config.layer.to_dict().items() if k in _LAYER_KEYS and v is not None}
    layer["model_type"] = "llama"
    rope = config.layer.to_dict().get("rope_parameters") or {}
    layer["rope_theta"] = float(rope.get("rope_theta", 10000.0))  # top-level, as published checkpoints write it
    if rope.get("rope_type", "default") != "default":
        layer["rope_scaling"] = rope
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if not include_embeddings:
        state.pop("embed_tokens.weight")
    if layout == REFERENCE:
        raw = {
            "architectures": ["LlamaForCausalLMEagle3"],
            **layer,
            "num_hidden_layers": 1,
            "draft_vocab_size": config.draft_vocab_size,
            "target_hidden_size": config.target_hidden_size,
            "torch_dtype": "float32",
        }
        if config.norm_before_residual:
            raw["norm_before_residual"] = True
        if config.aux_layer_ids:
            raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": config.aux_layer_ids}
    elif layout == SPECULATORS:
        state = {k.replace("midlayer.", "layers.0.", 1): v for k, v in state.items()}
        raw = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.1.0",
            "transformer_layer_config": {**layer, "num_hidden_layers": 1, "model_type": "llama"},
            "draft_vocab_size": config.draft_vocab_size,
            "target_hidden_size": config.target_hidden_size,
            "norm_before_residual": config.norm_before_residual,
            "eagle_aux_hidden_state_layer_ids": config.aux_layer_ids,
        }
    else:
        raise ValueError(f"layout must be {REFERENCE!r} or {SPECULATORS!r}, got {layout!r}")
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True))
    return out
