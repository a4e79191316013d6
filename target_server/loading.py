"""Loading a target checkpoint for EAGLE-3: the model, its feature capture and its EOS ids.

The one loader of a target: the target engine serves with it, the trainer's teacher
(draft_server/teacher.py) reads features and logits with it, so both capture the same layers
and stop on the same EOS ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig
from transformers.utils import logging as hf_logging

from tandem.aux_layers import capture_ids
from tandem.pairing import default_aux_layer_ids
from target_server.capture import FeatureCapture

hf_logging.disable_progress_bar()  # a service logs; it does not draw progress bars


@dataclass
class LoadedTarget:
    model: nn.Module  # the causal LM, in eval mode, frozen
    capture: FeatureCapture  # hooked on the aux layers: every forward keeps their inputs
    eos_token_ids: list[int]

    @property
    def config(self) -> PretrainedConfig:
        return self.model.config

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self.capture.aux_layer_ids

    @property
    def num_layers(self) -> int:
        return len(self.model.get_decoder().layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])


def load_target(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    aux_layer_ids: Sequence[int] | None = None,
) -> LoadedTarget:
    """A local HF checkpoint (config.json + safetensors, single or sharded) on `device`, capturing
    `aux_layer_ids` (None: EAGLE-3's default for its depth)."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"target checkpoint {model_dir} has no config.json")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.to(device).eval().requires_grad_(False)
    layers = model.get_decoder().layers
    ids = tuple(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(len(layers))
    return LoadedTarget(model, FeatureCapture(layers, ids), eos_token_ids(model_dir, model.config))


def eos_token_ids(model_dir: Path, config: PretrainedConfig) -> list[int]:
    """generation_config.json's EOS ids (chat models list several), else config.json's, else none."""
    eos = None
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        pass
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def aux_layer_ids_from_draft(draft_dir: str | Path, target_dir: str | Path | None = None,
                             convention: str | None = None) -> list[int] | None:
    """The hidden states a draft asks for (its `eagle_aux_hidden_state_layer_ids`, converted from its
    convention: tandem/aux_layers.py), if it names any."""
    ids = capture_ids(draft_dir, target_dir, convention)
    return list(ids) if ids is not None else None
