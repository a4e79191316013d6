"""Which target hidden states a head fuses: the two conventions of `eagle_aux_hidden_state_layer_ids`.

Words, with L the target's decoder layers and HF `hidden_states` as transformers returns it:
  hidden-states id k  the tensor `hidden_states[k]` for k < L: the embeddings (k = 0) or the input of decoder
                      layer k (= the output of layer k-1); k = L is the last layer's output before the final
                      norm (vLLM's reading; HF's own `hidden_states[L]` is after that norm).
  outputs id k        the output of decoder layer k, i.e. hidden-states id k + 1.
Tandem captures in hidden-states ids (target_server/capture.py); a head's ids are converted when read.

Who writes what (read from their code; see the README's table):
  reference EAGLE (SafeAILab/EAGLE)   writes no ids; captures hidden_states[2, L//2, L-3] (modeling_llama_kv.py)
  vLLM, speculators                   index hidden_states[k], 0..L (EagleModelMixin._maybe_add_hidden_state;
                                      speculators' default [2, L//2, L-3], models/utils.py)
  SpecForge                           outputs, default [1, L//2-1, L-4] (resolve_eagle_capture_layers), written
                                      in eagle_config; SGLang adds one to explicit ids whose first id is 1
                                      (sgl-project/sglang#25454)
  NVIDIA ModelOpt                     outputs (forward hooks on layers[k], hf_eagle.py), default
                                      [1, L//2-1, L-4], written in eagle_config with use_aux_hidden_state ...
  NeMo Automodel                      outputs (forward hooks, eagle/target.py), default [1, L//2-1, L-4], not
                                      written in the head's config
Every default names the same three tensors: hidden_states[2, L//2, L-3].

No torch here: the target service, the draft service and the pairing checks all read this.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

HIDDEN_STATES = "hidden-states"
OUTPUTS = "outputs"
CONVENTIONS = (HIDDEN_STATES, OUTPUTS)
# What Tandem writes next to the ids of a head it saves (Tandem's own field: no published format has one).
RECORD_FIELD = "tandem_aux_layer_convention"
CONVENTION_HELP = ("how the head's eagle_aux_hidden_state_layer_ids count: hidden-states (hidden_states[k], "
                   "reference EAGLE, vLLM, speculators) or outputs (output of layer k: SpecForge, ModelOpt, NeMo); "
                   "default: from the head's layout")

# eagle_config fields only ModelOpt's export writes (modelopt/torch/export/plugins/hf_spec_configs.py)
MODELOPT_FIELDS = ("use_aux_hidden_state", "use_input_layernorm_in_first_layer", "use_last_layernorm",
                   "use_mtp_layernorm", "next_layer_regular", "parallel_draft_step")
NEMO_ARCHITECTURE = "LlamaEagle3DraftModel"  # NeMo Automodel's train_eagle3 recipe


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, mid and high layers for a target of this depth, in hidden-states ids."""
    return (2, num_layers // 2, num_layers - 3)


def config_field(raw: dict, name: str, default=None):
    """A field of a head's config.json, at the top level or nested in eagle_config (both are published)."""
    if raw.get(name) is not None:
        return raw[name]
    nested = raw.get("eagle_config") or {}
    return nested.get(name, default)


def trainer_of(raw: dict) -> str:
    """Which trainer's convention a head's config follows, by the fields it carries (config.json only)."""
    if raw.get("speculators_model_type") is not None:
        return "speculators"
    if NEMO_ARCHITECTURE in (raw.get("architectures") or []):
        return "nemo"
    if any(field in (raw.get("eagle_config") or {}) for field in MODELOPT_FIELDS):
        return "modelopt"
    return "reference"


@dataclass(frozen=True)
class AuxLayerIds:
    written: tuple[int, ...] | None  # as the head's config writes them; None: it names none
    convention: str  # HIDDEN_STATES or OUTPUTS
    why: str  # where the convention came from, for logs and errors

    @property
    def hidden_state_ids(self) -> tuple[int, ...] | None:
        if self.written is None:
            return None
        return self.written if self.convention == HIDDEN_STATES else tuple(i + 1 for i in self.written)

    def describe(self) -> str:
        if self.written is None:
            return "no layer ids (the default for the target's depth)"
        return f"layer ids {list(self.written)} read as {self.convention} ({self.why})"


def resolve(raw: dict, num_layers: int | None = None, override: str | None = None) -> AuxLayerIds:
    """The convention of the ids in a head's config.json `raw`: the override, else what Tandem recorded, else
    the trainer's. `num_layers` (the target's depth, when known) settles one case: an id equal to it can
    only be hidden_states[L], whatever the trainer (the gpt-oss heads [24, 30, 36] of a 36-layer target)."""
    ids = config_field(raw, "eagle_aux_hidden_state_layer_ids")
    written = tuple(int(i) for i in ids) if ids else None
    if override is not None:
        if override not in CONVENTIONS:
            raise ValueError(f"aux layer convention must be one of {CONVENTIONS}, got {override!r}")
        return AuxLayerIds(written, override, "--aux-layer-convention")
    recorded = config_field(raw, RECORD_FIELD)
    if recorded is not None:
        if recorded not in CONVENTIONS:
            raise ValueError(f"{RECORD_FIELD} must be one of {CONVENTIONS}, got {recorded!r}")
        return AuxLayerIds(written, recorded, f"{RECORD_FIELD} in the head's config")
    trainer = trainer_of(raw)
    if trainer == "speculators":
        convention, why = HIDDEN_STATES, "speculators layout: vLLM indexes hidden_states[k]"
    elif trainer in ("modelopt", "nemo"):
        name = "ModelOpt" if trainer == "modelopt" else "NeMo Automodel"
        convention, why = OUTPUTS, f"{name} head: it hooks the output of layer k"
    elif written and written[0] == 1:
        convention, why = OUTPUTS, "first id 1: SpecForge's outputs of layers, as SGLang reads them"
    else:
        convention, why = HIDDEN_STATES, "reference EAGLE's input-of-layer ids, as vLLM and SGLang read them"
    if convention == OUTPUTS and written and num_layers is not None and max(written) >= num_layers:
        convention, why = HIDDEN_STATES, f"an id is {num_layers}: only hidden_states[{num_layers}] has that index"
    return AuxLayerIds(written, convention, why)


def read_head_config(draft_dir: str | Path) -> dict:
    path = Path(draft_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"draft checkpoint {draft_dir} has no config.json")
    return json.loads(path.read_text())


def target_num_layers(target_dir: str | Path) -> int:
    """The target's decoder depth from its config.json (a multimodal one keeps it in text_config)."""
    raw = json.loads((Path(target_dir) / "config.json").read_text())
    return int(raw.get("text_config", raw)["num_hidden_layers"])


def capture_ids(
    draft_dir: str | Path, target_dir: str | Path | None = None, override: str | None = None
) -> tuple[int, ...] | None:
    """The hidden-states ids the target must capture for the head in `draft_dir` (None: the default)."""
    num_layers = target_num_layers(target_dir) if target_dir is not None else None
    return resolve(read_head_config(draft_dir), num_layers, override).hidden_state_ids
