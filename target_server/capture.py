"""Capture of the target's low/mid/high hidden states for the EAGLE-3 draft.

The aux layer ids (EAGLE-3 configs: `eagle_aux_hidden_state_layer_ids`) are the three target layers
whose hidden states the draft fuses. Convention (reference EAGLE and vLLM): an id names the *input*
of that decoder layer, i.e. HF `hidden_states[id]`, where `hidden_states[0]` is the embeddings. We
hook only those three layers instead of asking the model for all L hidden states.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class FeatureCapture:
    """Forward pre-hooks that keep the input of three decoder layers of the last forward."""

    def __init__(self, layers: nn.ModuleList, aux_layer_ids: Sequence[int]):
        num_layers = len(layers)
        if len(aux_layer_ids) != 3:
            raise ValueError(f"EAGLE-3 needs exactly 3 capture layers, got {list(aux_layer_ids)}")
        bad = [i for i in aux_layer_ids if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"capture layer ids {bad} are outside the target's {num_layers} decoder layers")
        self.aux_layer_ids = tuple(int(i) for i in aux_layer_ids)
        self._captured: list[torch.Tensor | None] = [None, None, None]
        self._handles = [
            layers[layer_id].register_forward_pre_hook(self._make_hook(slot), with_kwargs=True)
            for slot, layer_id in enumerate(self.aux_layer_ids)
        ]

    def _make_hook(self, slot: int):
        def hook(module, args, kwargs):
            self._captured[slot] = args[0] if args else kwargs["hidden_states"]

        return hook

    def take(self) -> torch.Tensor:
        """The features of the last forward: [B, S, 3H], low, mid, high concatenated."""
        if any(t is None for t in self._captured):
            raise RuntimeError("no forward pass has run since the last take()")
        features = torch.cat(self._captured, dim=-1)  # type: ignore[arg-type]
        self._captured = [None, None, None]
        return features

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
