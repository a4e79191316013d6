"""Tensors from a checkpoint directory: all of a head's, or the one or two a head needs from its target.

Formats: model.safetensors, a safetensors index (model.safetensors.index.json + shards), pytorch_model.bin
or its index (pytorch_model.bin.index.json), the .bin files read pickle-free (torch.load weights_only).

Where a target keeps its token embedding (the head reads it when it has none of its own):
  model.embed_tokens.weight                 Llama, Qwen2/3, Mistral, Phi-3, gpt-oss: text-only models
  model.language_model.embed_tokens.weight  Qwen3-VL; multimodal models as transformers >= 4.52 saves them
  language_model.model.embed_tokens.weight  Llama-4, Mistral-3, Gemma-3 as published (the llava layout)
and its output embedding (for a head without lm_head): lm_head.weight, language_model.lm_head.weight, or the
embedding itself when the target ties them (tie_word_embeddings, top level or in text_config).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

EMBED_KEYS = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
)
LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight", "model.language_model.lm_head.weight")
# Parts of a multimodal checkpoint whose embeddings are not the text model's.
_NOT_TEXT = ("vision", "visual", "audio", "image", "mm_projector", "multi_modal")


class WeightsError(ValueError):
    """A checkpoint's files are missing or do not hold the tensor asked for; the message says which."""


def _index(directory: Path) -> tuple[dict[str, str] | None, str]:
    """The weight map of a sharded checkpoint (tensor name -> file) and its format, or (None, format)."""
    for name, fmt in (("model.safetensors.index.json", "safetensors"), ("pytorch_model.bin.index.json", "bin")):
        if (directory / name).is_file():
            return json.loads((directory / name).read_text())["weight_map"], fmt
    for name, fmt in (("model.safetensors", "safetensors"), ("pytorch_model.bin", "bin")):
        if (directory / name).is_file():
            return None, fmt
    raise WeightsError(
        f"{directory} has no model.safetensors, pytorch_model.bin or an index of either (model.safetensors.index.json, "
        f"pytorch_model.bin.index.json)"
    )


def _load(path: Path, fmt: str) -> dict[str, torch.Tensor]:
    if fmt == "safetensors":
        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def read_all(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (head) checkpoint."""
    directory = Path(directory)
    weight_map, fmt = _index(directory)
    if weight_map is None:
        return _load(directory / ("model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"), fmt)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        tensors.update(_load(directory / shard, fmt))
    return tensors


def tensor_names(directory: str | Path) -> dict[str, str]:
    """Every tensor name of a checkpoint -> the file holding it, without reading a tensor (safetensors)."""
    directory = Path(directory)
    weight_map, fmt = _index(directory)
    if weight_map is not None:
        return dict(weight_map)
    name = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    if fmt == "safetensors":
        with safe_open(directory / name, framework="pt") as f:
            return dict.fromkeys(f.keys(), name)
    return dict.fromkeys(_load(directory / name, fmt), name)


def read_tensor(directory: str | Path, name: str, files: dict[str, str] | None = None) -> torch.Tensor:
    directory = Path(directory)
    files = files if files is not None else tensor_names(directory)
    if name not in files:
        raise WeightsError(f"{directory} has no tensor {name}")
    path = directory / files[name]
    if path.suffix == ".safetensors":
        with safe_open(path, framework="pt") as f:
            return f.get_tensor(name)
    return _load(path, "bin")[name]


def _text_config(directory: Path) -> dict:
    path = directory / "config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    return {**raw, **(raw.get("text_config") or {})}


def find_embedding_key(directory: str | Path, files: dict[str, str] | None = None) -> str:
    """The name of a target checkpoint's token embedding: a known name (EMBED_KEYS), else the one tensor named
    *embed_tokens.weight outside a vision or audio tower."""
    directory = Path(directory)
    files = files if files is not None else tensor_names(directory)
    for key in EMBED_KEYS:
        if key in files:
            return key
    found = [k for k in files if k.endswith("embed_tokens.weight") and not any(p in k for p in _NOT_TEXT)]
    if len(found) == 1:
        return found[0]
    if not found:
        raise WeightsError(f"target checkpoint {directory} has no token embedding: none of {list(EMBED_KEYS)}")
    raise WeightsError(f"target checkpoint {directory} has several token embeddings {found}: which one is the text "
                       f"model's is not known")


def read_target_embedding(target_dir: str | Path) -> torch.Tensor:
    """The one tensor the draft needs from the target checkpoint, without loading the rest."""
    directory = Path(target_dir)
    files = tensor_names(directory)
    return read_tensor(directory, find_embedding_key(directory, files), files)


def read_target_output_embedding(target_dir: str | Path) -> torch.Tensor:
    """The target's lm_head weight [vocab, H]: its own, or its embedding when it ties the two."""
    directory = Path(target_dir)
    files = tensor_names(directory)
    for key in LM_HEAD_KEYS:
        if key in files:
            return read_tensor(directory, key, files)
    if _text_config(directory).get("tie_word_embeddings"):
        return read_tensor(directory, find_embedding_key(directory, files), files)
    raise WeightsError(f"target checkpoint {directory} has no lm_head ({list(LM_HEAD_KEYS)}) and does not tie it "
                       f"to its embedding")
