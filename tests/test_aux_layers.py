"""Which target hidden states a head's eagle_aux_hidden_state_layer_ids name, per trainer, and that the target
captures exactly those: outputs of layers where the head counts outputs, the last layer's output included."""

from __future__ import annotations

import json

import pytest
import torch
from published_heads import (
    LAYERS,
    canonical_weights,
    layer_fields,
    write_reference,
    write_specforge,
    write_speculators,
)
from transformers import LlamaConfig

from draft_server.checkpoint import SPECULATORS, read_config, save_draft
from draft_server.engine import DraftEngine
from draft_server.model import Eagle3Draft
from tandem import aux_layers
from tandem.config import ConfigError, TargetSettings, load_settings
from tandem.pairing import PairMismatch, check_pair
from tandem.params import GenerationRequest, SamplingParams
from tandem_tools.inprocess import InProcessGenerator, target_shape
from tandem_tools.tiny import tiny_draft_config
from target_server.engine import TargetEngine
from target_server.loading import aux_layer_ids_from_draft

MODELOPT_EAGLE = {"use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
                  "use_mtp_layernorm": False, "next_layer_regular": True, "parallel_draft_step": 1}


@pytest.mark.parametrize(
    "raw, num_layers, override, expected, convention",
    [
        ({}, 32, None, None, aux_layers.HIDDEN_STATES),  # SafeAILab's heads name none
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}, 32, None, (2, 16, 29),
         aux_layers.OUTPUTS),  # SpecForge's default, written as outputs
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}}, 61, None, (2, 30, 58),
         aux_layers.HIDDEN_STATES),  # first id not 1: read as SGLang reads it (#25454)
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 23, 44], **MODELOPT_EAGLE}}, 48, None,
         (2, 24, 45), aux_layers.OUTPUTS),  # a ModelOpt head (Llama-4 Maverick's ids)
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [24, 30, 36], **MODELOPT_EAGLE}}, 36, None,
         (24, 30, 36), aux_layers.HIDDEN_STATES),  # 36 of 36 layers: only hidden_states[36] exists
        ({"architectures": ["LlamaEagle3DraftModel"]}, 32, None, None, aux_layers.OUTPUTS),  # NeMo: none written
        ({"speculators_model_type": "eagle3", "eagle_aux_hidden_state_layer_ids": [1, 16, 29]}, 32, None,
         (1, 16, 29), aux_layers.HIDDEN_STATES),  # vLLM indexes hidden_states[k]
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 6], aux_layers.RECORD_FIELD: "hidden-states"}},
         8, None, (1, 3, 6), aux_layers.HIDDEN_STATES),  # what Tandem recorded wins
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}, 8, "hidden-states", (1, 3, 4),
         aux_layers.HIDDEN_STATES),  # the override wins over everything
    ],
)
def test_each_trainers_ids_are_read_in_its_convention(raw, num_layers, override, expected, convention):
    ids = aux_layers.resolve(raw, num_layers, override)
    assert ids.hidden_state_ids == expected and ids.convention == convention


@pytest.mark.parametrize("num_layers", [8, 16, 32, 36, 48, 61])
def test_every_trainers_default_names_the_same_hidden_states(num_layers):
    outputs = [1, num_layers // 2 - 1, num_layers - 4]  # SpecForge, ModelOpt, NeMo
    assert tuple(i + 1 for i in outputs) == aux_layers.default_aux_layer_ids(num_layers)  # reference, vLLM


def test_specforge_head_captures_what_the_reference_head_captures(tiny_dir, tmp_path):
    """The same weights with no ids (reference) and with SpecForge's [1, L/2-1, L-4]: the same three hidden
    states, identical drafts. Read as hidden_states ids (what Tandem did before), they were other states."""
    w = canonical_weights(11)
    reference = write_reference(tmp_path / "reference", w)
    specforge = write_specforge(tmp_path / "specforge", w, aux_ids=[1, LAYERS // 2 - 1, LAYERS - 4])
    prompt = [5, 17, 230, 44, 9, 61]
    runs = []
    for head in (reference, specforge):
        generator = InProcessGenerator(tiny_dir / "target", head, draft_cost=0)
        prefill = generator.target.prefill("p", prompt, SamplingParams())
        drafts = generator.draft.propose("d", prefill.features, [*prompt[1:], prefill.token], 5, create=True)
        result = generator.generate(GenerationRequest(prompt_ids=prompt, max_new_tokens=24, num_draft_tokens=4))
        runs.append((generator.target.aux_layer_ids, prefill.features, drafts, result.token_ids, result.stats))
    assert runs[0][0] == runs[1][0] == (2, 4, 5)
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=0, atol=0)
    assert runs[0][2:] == runs[1][2:]
    as_hidden_states = aux_layer_ids_from_draft(specforge, None, "hidden-states")
    misread = TargetEngine(tiny_dir / "target", aux_layer_ids=as_hidden_states)
    assert misread.aux_layer_ids == (1, 3, 4)
    assert not torch.equal(misread.prefill("p", prompt, SamplingParams()).features, runs[0][1])


def test_outputs_and_the_last_layers_output_are_captured(tiny_dir, tmp_path, hf_target):
    """SpecForge ids [1, 3, 7] (outputs of layers 1, 3, 7 of 8) and speculators ids [2, 4, 8] (hidden_states,
    8 = the last layer's output before the final norm, as vLLM reads it) are the same three states."""
    w = canonical_weights(12, embed=True)
    specforge = write_specforge(tmp_path / "specforge", w, aux_ids=[1, 3, LAYERS - 1])
    layer = {**LlamaConfig(**layer_fields(), num_hidden_layers=1).to_diff_dict(), "model_type": "llama"}
    speculators = write_speculators(tmp_path / "speculators", w, layer, aux_ids=[2, 4, LAYERS])
    prompt = [3, 14, 15, 92, 65, 35]
    last = {}
    hook = hf_target.model.layers[-1].register_forward_hook(lambda m, a, out: last.update(out=out))
    with torch.inference_mode():
        hidden = hf_target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    hook.remove()
    expected = torch.cat([hidden[2], hidden[4], last["out"]], dim=-1)[0]
    results = []
    for head in (specforge, speculators):
        generator = InProcessGenerator(tiny_dir / "target", head, draft_cost=0)
        assert generator.target.aux_layer_ids == (2, 4, LAYERS)
        features = generator.target.prefill("p", prompt, SamplingParams()).features
        # the native target (target_server/native.py) rounds in another order than transformers: ~2e-5 apart
        torch.testing.assert_close(features, expected, rtol=1e-4, atol=1e-4)
        request = GenerationRequest(prompt_ids=prompt, max_new_tokens=20, num_draft_tokens=3, ignore_eos=True)
        results.append(generator.generate(request))
    reference = hf_target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, eos_token_id=None)
    assert results[0].token_ids == results[1].token_ids == reference[0, len(prompt):].tolist()  # still lossless
    assert results[0].stats == results[1].stats


def test_the_target_and_the_draft_must_read_the_ids_alike(tiny_dir, tmp_path):
    head = write_specforge(tmp_path / "specforge", canonical_weights(13), aux_ids=[1, 3, 4])
    draft = DraftEngine(head, tiny_dir / "target", aux_layer_convention="hidden-states")
    target = TargetEngine(tiny_dir / "target", aux_layer_ids=aux_layer_ids_from_draft(head, tiny_dir / "target"))
    shape = target_shape(target)
    shape.aux_layer_ids = list(target.aux_layer_ids)  # as a running target service reports them
    with pytest.raises(PairMismatch, match="--aux-layer-convention"):
        check_pair(shape, draft.shape())


def test_the_convention_flag_is_a_setting(tiny_dir, tmp_path):
    head = write_specforge(tmp_path / "specforge", canonical_weights(14), aux_ids=[1, 3, 4])
    settings = load_settings(TargetSettings, model=tiny_dir / "target", draft=head, aux_layer_convention="outputs")
    assert aux_layer_ids_from_draft(head, settings.model, settings.aux_layer_convention) == [2, 4, 5]
    with pytest.raises(ConfigError, match="--aux-layer-convention / TANDEM_TARGET_AUX_LAYER_CONVENTION"):
        load_settings(TargetSettings, model=tiny_dir / "target", aux_layer_convention="inputs")
    from tandem_tools.cli import build_parser

    for command in (["serve"], ["target"], ["draft"], ["generate", "--prompt", "x"]):
        args = build_parser().parse_args([*command, "--aux-layer-convention", "outputs"])
        assert args.aux_layer_convention == "outputs"


@pytest.mark.parametrize("layout", ["reference", SPECULATORS])
def test_tandem_records_the_convention_of_the_heads_it_writes(tiny_dir, tmp_path, layout):
    from transformers import AutoConfig

    config = tiny_draft_config(AutoConfig.from_pretrained(tiny_dir / "target"), draft_vocab_size=256)
    config.aux_layer_ids = [1, 3, 6]  # a first id of 1 would read as SpecForge's outputs without the record
    head = save_draft(Eagle3Draft(config), tmp_path / layout, layout=layout, include_embeddings=True)
    raw = json.loads((head / "config.json").read_text())
    assert aux_layers.config_field(raw, aux_layers.RECORD_FIELD) == aux_layers.HIDDEN_STATES
    assert aux_layers.config_field(raw, "eagle_aux_hidden_state_layer_ids") == [1, 3, 6]
    assert read_config(head)[0].aux_layer_ids == [1, 3, 6]
