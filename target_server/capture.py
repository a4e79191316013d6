"""Capture of the target's low/mid/high hidden states for the EAGLE-3 draft.

The aux layer ids are hidden-states ids (tandem/aux_layers.py): id k < L is HF `hidden_states[k]`, the
input of decoder layer k (0: the embeddings), and id L is the last layer's output before the final norm
(vLLM's reading). A head's own ids are converted to these when read, whatever its convention. We hook
only the three layers instead of asking the model for all L hidden states.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def check_aux_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Three hidden-states ids in 0..num_layers, or ValueError."""
    if len(aux_layer_ids) != 3:
        raise ValueError(f"EAGLE-3 needs exactly 3 capture layers, got {list(aux_layer_ids)}")
    bad = [i for i in aux_layer_ids if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(f"capture ids {bad} are outside the target's hidden states 0..{num_layers} "
                         f"({num_layers} decoder layers)")
    return tuple(int(i) for i in aux_layer_ids)


class FeatureCapture:
    """Hooks that keep the three hidden states of the last forward: the input of layer k (a forward
    pre-hook) for an id k < L, the output of the last layer (a forward hook) for the id L."""

    def __init__(self, layers: nn.ModuleList, aux_layer_ids: Sequence[int]):
        num_layers = len(layers)
        self.aux_layer_ids = check_aux_layer_ids(aux_layer_ids, num_layers)
        self._captured: list[torch.Tensor | None] = [None, None, None]
        self._handles = []
        for slot, layer_id in enumerate(self.aux_layer_ids):
            if layer_id < num_layers:
                hook = layers[layer_id].register_forward_pre_hook(self._input_hook(slot), with_kwargs=True)
            else:
                hook = layers[num_layers - 1].register_forward_hook(self._output_hook(slot))
            self._handles.append(hook)

    def _input_hook(self, slot: int):
        def hook(module, args, kwargs):
            self._captured[slot] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _output_hook(self, slot: int):
        def hook(module, args, output):
            self._captured[slot] = output[0] if isinstance(output, tuple) else output

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
