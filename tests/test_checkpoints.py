"""Published head layouts, loaded by the real loader and checked against the EAGLE-3 math written out here
in plain torch (not the project's model): every layout, each EAGLE-3.1 option, Qwen3 layers, biases, a
decoupled head_dim, heads of several layers, and P-EAGLE heads (all drafts in one forward). The heads are written by tests/published_heads.py with the trainers' own names."""

from __future__ import annotations

import json

import pytest
import torch
from published_heads import (
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    KV_HEADS,
    LAYERS,
    VOCAB,
    canonical_weights,
    layer_fields,
    write_modelopt,
    write_nemo,
    write_reference,
    write_specforge,
    write_speculators,
)
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig, Phi3Config, Qwen3Config

from draft_server.checkpoint import load_draft
from draft_server.engine import DraftEngine

# -- the EAGLE-3 math, written out -----------------------------------------------------------------------


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, position, theta):
    """x [n, hd] at one position: the rotate-half RoPE of Llama and Qwen3."""
    hd = x.shape[-1]
    angle = position / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    cos, sin = torch.cat([angle.cos()] * 2).float(), torch.cat([angle.sin()] * 2).float()
    return x * cos + torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], dim=-1) * sin


class ReferenceHead:
    """One EAGLE-3 draft layer over canonical weights `w`, one position at a time with its own KV list."""

    def __init__(self, w, embed, *, head_dim=HIDDEN // HEADS, eps=1e-5, theta=10000.0, norm_before_residual=False,
                 qk_norm=False, fc_norm=False, input_norm=False, norm_output=False, layers=1, mask_token=None):
        self.w, self.embed, self.hd, self.eps, self.theta = w, embed, head_dim, eps, theta
        self.nbr, self.qk_norm, self.fc_norm, self.input_norm, self.norm_output = (
            norm_before_residual, qk_norm, fc_norm, input_norm, norm_output)
        self.layers, self.mask_token = layers, mask_token  # mask_token: a P-EAGLE head's
        self.kv = [([], []) for _ in range(layers)]  # per layer: the keys and values of every position

    def linear(self, x, name):
        y = x @ self.w[name + ".weight"].T
        return y + self.w[name + ".bias"] if name + ".bias" in self.w else y

    def fuse(self, features):  # [3Ht] -> [H]
        if self.input_norm:
            features = rms(features, self.w["input_norm.weight"], self.eps)
        if self.fc_norm:
            features = torch.cat([rms(c, self.w[f"fc_norm.{i}.weight"], self.eps)
                                  for i, c in enumerate(features.chunk(3))])
        return self.linear(features, "fc")

    def attention(self, x, m, layer, position):
        """Layer `layer`'s attention (weights under prefix m) of input x at `position` over all it has seen."""
        q = self.linear(x, m + "self_attn.q_proj").view(HEADS, self.hd)
        k = self.linear(x, m + "self_attn.k_proj").view(KV_HEADS, self.hd)
        v = self.linear(x, m + "self_attn.v_proj").view(KV_HEADS, self.hd)
        if self.qk_norm:
            q = rms(q, self.w[m + "self_attn.q_norm.weight"], self.eps)
            k = rms(k, self.w[m + "self_attn.k_norm.weight"], self.eps)
        q, k = rope(q, position, self.theta), rope(k, position, self.theta)
        seen_k, seen_v = self.kv[layer]
        seen_k.append(k)
        seen_v.append(v)
        keys, values = torch.stack(seen_k, 1), torch.stack(seen_v, 1)  # [KV_HEADS, T, hd]
        group = HEADS // KV_HEADS
        heads = []
        for i in range(HEADS):  # query head i reads key/value head i // group
            scores = keys[i // group] @ q[i] / self.hd**0.5
            heads.append(scores.softmax(-1) @ values[i // group])
        return self.linear(torch.cat(heads), m + "self_attn.o_proj")

    def mlp(self, a, m):
        mlp_in = rms(a, self.w[m + "post_attention_layernorm.weight"], self.eps)
        gate = self.linear(mlp_in, m + "mlp.gate_proj")
        up = self.linear(mlp_in, m + "mlp.up_proj")
        return a + self.linear(torch.nn.functional.silu(gate) * up, m + "mlp.down_proj")

    def step(self, h, token, position):
        """(h [H], target id, position) -> the state the next step reads, and the draft logits."""
        m = "midlayer."
        normed = rms(h, self.w[m + "hidden_norm.weight"], self.eps)
        residual = normed if self.nbr else h
        x = torch.cat([rms(self.embed[token], self.w[m + "input_layernorm.weight"], self.eps), normed])
        a = self.mlp(residual + self.attention(x, m, 0, position), m)
        for n in range(1, self.layers):  # plain pre-norm Llama layers over H
            p = f"layers.{n}."
            a = a + self.attention(rms(a, self.w[p + "input_layernorm.weight"], self.eps), p, n, position)
            a = self.mlp(a, p)
        final = rms(a, self.w["norm.weight"], self.eps)
        return (final if self.norm_output else a), final @ self.w["lm_head.weight"].T

    def target_id(self, logits):
        draft = int(logits.argmax())
        return draft + int(self.w["d2t"][draft])

    def drafts(self, features, tokens, k):
        """The committed pairs (features[i], tokens[i]) at positions 0..m-1, then k rollout steps; a P-EAGLE
        head: then k-1 masked positions (mask_hidden through fc, the mask token), each giving one draft."""
        logits_seen = []
        for i, token in enumerate(tokens):
            state, logits = self.step(self.fuse(features[i]), token, i)
            logits_seen.append(logits)
        out = []
        for n in range(k):
            out.append(self.target_id(logits))
            if self.mask_token is None:
                state, logits = self.step(state, out[-1], len(tokens) + n)
            elif n + 1 < k:
                _, logits = self.step(self.fuse(self.w["mask_hidden"].reshape(-1)), self.mask_token, len(tokens) + n)
        return out, torch.stack(logits_seen)


# -- the heads ---------------------------------------------------------------------------------------------


def _target_embedding(tiny_dir):
    with safe_open(tiny_dir / "target" / "model.safetensors", "pt") as f:
        return f.get_tensor("model.embed_tokens.weight")


def _family(cls, **extra):
    base = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "max_position_embeddings": 2048}
    return cls(**base, **extra)


def _case(name, tmp, tiny_dir):
    """-> (head directory, canonical weights, ReferenceHead options, embedding the head runs with)."""
    embed = _target_embedding(tiny_dir)
    out = tmp / name
    if name == "reference":
        w = canonical_weights(1)
        return write_reference(out, w), w, {}, embed
    if name == "specforge-norm_before_fc-in-eagle_config":  # the flag nested, as vLLM also reads it
        w = canonical_weights(3, input_norm=True)
        head = write_specforge(out, w)
        config = json.loads((head / "config.json").read_text())
        config["eagle_config"]["norm_before_fc"] = True
        (head / "config.json").write_text(json.dumps(config))
        return head, w, {"input_norm": True}, embed
    if name.startswith("specforge"):
        flags = {"specforge": {}, "specforge-fc_norm": {"fc_norm": True},
                 "specforge-norm_output": {"norm_output": True},
                 "specforge-3.1": {"fc_norm": True, "norm_output": True}}[name]
        w = canonical_weights(2, fc_norm=flags.get("fc_norm", False))
        return write_specforge(out, w, **flags), w, flags, embed
    if name == "modelopt":
        w = canonical_weights(4)
        return write_modelopt(out, w), w, {}, embed
    if name == "nemo-llama":  # mlp_bias, a rope_theta of its own, its own embedding
        w = canonical_weights(5, mlp_bias=True, embed=True)
        family = _family(LlamaConfig, mlp_bias=True, rope_theta=500000.0).to_dict()
        return write_nemo(out, w, family), w, {"theta": 500000.0}, w["embed_tokens.weight"]
    if name == "nemo-qwen3-3.1":  # attention_bias, head_dim 32 of hidden 64 / 4 heads, EAGLE-3.1 options
        w = canonical_weights(6, head_dim=32, attention_bias=True, fc_norm=True, embed=True)
        family = _family(Qwen3Config, head_dim=32, attention_bias=True, rms_norm_eps=1e-6).to_dict()
        opts = {"head_dim": 32, "eps": 1e-6, "fc_norm": True, "norm_output": True}
        return write_nemo(out, w, family, fc_norm=True, norm_output=True), w, opts, w["embed_tokens.weight"]
    if name == "nemo-phi3":
        w = canonical_weights(7, embed=True)
        family = _family(Phi3Config, rope_theta=10000.0, pad_token_id=0).to_dict()
        return write_nemo(out, w, family), w, {}, w["embed_tokens.weight"]
    if name.startswith("speculators-llama"):
        flags = {"speculators-llama": {}, "speculators-llama-fc_norm": {"fc_norm": True},
                 "speculators-llama-norm_output": {"norm_output": True}}[name]
        w = canonical_weights(8, fc_norm=flags.get("fc_norm", False), embed=True)
        layer = LlamaConfig(**layer_fields(), num_hidden_layers=1).to_diff_dict()
        head = write_speculators(out, w, {**layer, "model_type": "llama"}, **flags)
        return head, w, {"norm_before_residual": True, **flags}, w["embed_tokens.weight"]
    if name.startswith("speculators-qwen3"):  # speculators' default layer: q_norm, k_norm; Qwen3's own defaults
        input_norm = name.endswith("norm_before_fc")
        w = canonical_weights(9, head_dim=32, qk_norm=True, input_norm=input_norm)
        fields = {k: v for k, v in layer_fields(head_dim=32).items() if k != "rms_norm_eps"}  # Qwen3's 1e-6
        layer = {**Qwen3Config(**fields, num_hidden_layers=1).to_diff_dict(), "model_type": "qwen3"}
        head = write_speculators(out, w, layer, norm_before_residual=False, norm_before_fc=input_norm)
        return head, w, {"head_dim": 32, "eps": 1e-6, "qk_norm": True, "input_norm": input_norm}, embed
    if name == "speculators-3-layers-llama":  # an EAGLE-3 chain head of three layers
        w = canonical_weights(10, embed=True, layers=3)
        layer = LlamaConfig(**layer_fields(), num_hidden_layers=3).to_diff_dict()
        head = write_speculators(out, w, {**layer, "model_type": "llama"})
        return head, w, {"norm_before_residual": True, "layers": 3}, w["embed_tokens.weight"]
    if name == "nemo-llama-peagle-2-layers":  # NeMo Automodel's P-EAGLE: model.layers.1.*, mask_hidden on top
        w = canonical_weights(11, layers=2, mask_hidden=True)
        head = write_nemo(out, w, _family(LlamaConfig, rms_norm_eps=1e-5).to_dict(), parallel_drafting=True, mask_token_id=3,
                          num_depths=6, down_sample_ratio=0.7, down_sample_ratio_min=0.2)
        return head, w, {"layers": 2, "mask_token": 3}, embed
    if name == "speculators-peagle-2-layers-fc_norm":  # speculators' "peagle", with an EAGLE-3.1 toggle
        w = canonical_weights(12, embed=True, layers=2, mask_hidden=True, fc_norm=True)
        layer = LlamaConfig(**layer_fields(), num_hidden_layers=2).to_diff_dict()
        head = write_speculators(out, w, {**layer, "model_type": "llama"}, speculators_model_type="peagle",
                                 architectures=["PEagleSpeculator"], mask_token_id=7, fc_norm=True, num_depths=8)
        return head, w, {"norm_before_residual": True, "layers": 2, "mask_token": 7, "fc_norm": True}, \
            w["embed_tokens.weight"]
    raise KeyError(name)


CASES = ["reference", "specforge", "specforge-fc_norm", "specforge-norm_output", "specforge-3.1",
         "specforge-norm_before_fc-in-eagle_config", "modelopt", "nemo-llama", "nemo-qwen3-3.1", "nemo-phi3",
         "speculators-llama", "speculators-llama-fc_norm", "speculators-llama-norm_output", "speculators-qwen3",
         "speculators-qwen3-norm_before_fc", "speculators-3-layers-llama", "nemo-llama-peagle-2-layers",
         "speculators-peagle-2-layers-fc_norm"]


@pytest.mark.parametrize("name", CASES)
def test_published_layout_loads_and_matches_the_reference_math(name, tiny_dir, tmp_path):
    head, w, options, embed = _case(name, tmp_path, tiny_dir)
    torch.manual_seed(0)
    m, k = 7, 5
    features = torch.randn(m, 3 * HIDDEN) * 2
    tokens = torch.randint(0, VOCAB, (m,)).tolist()
    expected_drafts, expected_logits = ReferenceHead(w, embed, **options).drafts(features, tokens, k)

    model = load_draft(head, tiny_dir / "target")  # the real loader
    with torch.no_grad():
        a = model(model.fuse(features)[None], torch.tensor([tokens]), torch.arange(m)[None])
        torch.testing.assert_close(model.draft_logits(a)[0], expected_logits, atol=2e-4, rtol=1e-4)
    engine = DraftEngine(head, tiny_dir / "target")  # and the real engine, rollout included
    assert engine.propose("s", features[:4], tokens[:4], k, create=True) == ReferenceHead(w, embed, **options).drafts(
        features[:4], tokens[:4], k)[0]
    # the next round's pairs after the first's: the committed pairs' KV was kept, the drafts' dropped
    assert engine.propose("s", features[4:], tokens[4:], k) == expected_drafts


# -- where the embedding and the lm_head come from -------------------------------------------------------


def _multimodal_target(out, tiny_dir, architecture, embed_key, lm_head_key, fmt="safetensors"):
    """A target laid out as Llama-4, Qwen3-VL or Mistral-3 publish theirs: text_config, a vision tower, the
    text model's tensors under a prefix, sharded with an index. Only what the draft reads is real."""
    out.mkdir(parents=True)
    with safe_open(tiny_dir / "target" / "model.safetensors", "pt") as f:
        embed, lm_head = f.get_tensor("model.embed_tokens.weight"), f.get_tensor("lm_head.weight")
    text = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "max_position_embeddings": 8192}
    (out / "config.json").write_text(json.dumps({"architectures": [architecture], "text_config": text,
                                                 "vision_config": {"hidden_size": 32}}))
    shards = {"vision_tower.patch_embed.weight": ("a", torch.randn(32, 3)),
              "vision_tower.embed_tokens.weight": ("a", torch.randn(7, 32)),  # not the text model's
              embed_key: ("a", embed), lm_head_key: ("b", lm_head)}
    suffix = ".safetensors" if fmt == "safetensors" else ".bin"
    index = {"metadata": {}, "weight_map": {k: f"model-{s}{suffix}" for k, (s, _) in shards.items()}}
    for shard in ("a", "b"):
        tensors = {k: v for k, (s, v) in shards.items() if s == shard}
        if fmt == "safetensors":
            save_file(tensors, out / f"model-{shard}.safetensors")
        else:
            torch.save(tensors, out / f"model-{shard}.bin")
    name = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    (out / name).write_text(json.dumps(index))
    return out, embed, lm_head


MULTIMODAL = [
    ("Llama4ForConditionalGeneration", "language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
     "safetensors"),
    ("Qwen3VLForConditionalGeneration", "model.language_model.embed_tokens.weight", "lm_head.weight", "safetensors"),
    ("Mistral3ForConditionalGeneration", "language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
     "bin"),
]


@pytest.mark.parametrize("architecture, embed_key, lm_head_key, fmt", MULTIMODAL)
def test_the_embedding_of_a_multimodal_target_is_found(architecture, embed_key, lm_head_key, fmt, tiny_dir, tmp_path):
    target, embed, lm_head = _multimodal_target(tmp_path / "target", tiny_dir, architecture, embed_key, lm_head_key,
                                                fmt)
    w = canonical_weights(21)
    head = write_reference(tmp_path / "head", w)
    torch.manual_seed(1)
    features, tokens = torch.randn(5, 3 * HIDDEN), [4, 8, 15, 16, 23]
    drafts = DraftEngine(head, target).propose("s", features, tokens, 4, create=True)
    assert drafts == DraftEngine(head, tiny_dir / "target").propose("s", features, tokens, 4, create=True)
    # a head with no lm_head shares the target's: the rows of its draft vocabulary
    del w["lm_head.weight"]
    model = load_draft(write_reference(tmp_path / "shared", w), target)
    torch.testing.assert_close(model.lm_head.weight, lm_head[torch.arange(len(w["d2t"])) + w["d2t"]])
    torch.testing.assert_close(model.embed_tokens.weight, embed)


def test_a_head_that_ties_its_lm_head_reads_its_embedding_rows(tiny_dir, tmp_path):
    w = canonical_weights(22, embed=True)
    del w["lm_head.weight"]
    head = write_reference(tmp_path / "tied", w, tie_word_embeddings=True)
    model = load_draft(head)  # needs nothing from the target
    torch.testing.assert_close(model.lm_head.weight, w["embed_tokens.weight"][torch.arange(len(w["d2t"])) + w["d2t"]])


def test_a_pickle_free_bin_head_loads_as_its_safetensors(tiny_dir, tmp_path):
    w = canonical_weights(23)
    head = write_reference(tmp_path / "bin", w)
    expected = load_draft(head, tiny_dir / "target").state_dict()
    torch.save(w, head / "pytorch_model.bin")
    (head / "model.safetensors").unlink()
    for key, tensor in load_draft(head, tiny_dir / "target").state_dict().items():
        assert torch.equal(tensor, expected[key]), key


# -- what Tandem cannot run, refused with the reason -------------------------------------------------------


def _refused(tmp_path, kind):
    w = canonical_weights(31)
    out = tmp_path / kind
    if kind == "nemo-parallel-drafting-without-mask_hidden":
        return write_nemo(out, w, _family(LlamaConfig).to_dict(), parallel_drafting=True, mask_token_id=0), \
            "parallel_drafting is set but it has no mask_hidden"
    if kind == "nemo-peagle-without-mask_token_id":
        w = canonical_weights(33, layers=2, mask_hidden=True)
        return write_nemo(out, w, _family(LlamaConfig).to_dict(), parallel_drafting=True), "without mask_token_id"
    if kind == "modelopt-eagle1":
        head = write_modelopt(out, w)
        config = json.loads((head / "config.json").read_text())
        config["eagle_config"]["use_aux_hidden_state"] = False
        (head / "config.json").write_text(json.dumps(config))
        return head, "use_aux_hidden_state is false"
    if kind == "speculators-two-layers":
        w |= {k.replace("midlayer.", "layers.1."): v.clone() for k, v in w.items() if k.startswith("midlayer.")}
        layer = {**LlamaConfig(**layer_fields(), num_hidden_layers=1).to_diff_dict(), "model_type": "llama"}
        return write_speculators(out, w, layer), "num_hidden_layers is 1 but it has weights of 2 decoder layers"
    if kind == "speculators-four-aux":
        layer = {**LlamaConfig(**layer_fields(), num_hidden_layers=1).to_diff_dict(), "model_type": "llama"}
        return write_speculators(out, w, layer, aux_ids=[2, 3, 4, 5]), "4 fused hidden states"
    if kind == "partial-rotary":
        family = _family(Phi3Config, partial_rotary_factor=0.75).to_dict()
        return write_nemo(out, w, family), "partial_rotary_factor"
    if kind == "fc_norm-weights-without-the-flag":
        return write_specforge(out, canonical_weights(32, fc_norm=True)), "does not set fc_norm"
    if kind == "mla":  # lightseekorg/kimi-k2.6-eagle3.1-mla, ModelOpt's kimik2 heads
        mla = {k: v for k, v in w.items() if "q_proj" not in k and "k_proj" not in k}
        mla["midlayer.self_attn.kv_a_proj_with_mqa.weight"] = torch.zeros(8, 2 * HIDDEN)
        return write_reference(out, mla, architectures=["Eagle3DeepseekV2ForCausalLM"]), "MLA attention"
    if kind == "no-d2t":
        del w["d2t"]
        return write_reference(out, w), "no d2t"
    raise KeyError(kind)


@pytest.mark.parametrize("kind", ["nemo-parallel-drafting-without-mask_hidden", "nemo-peagle-without-mask_token_id",
                                  "modelopt-eagle1", "speculators-two-layers",
                                  "speculators-four-aux", "partial-rotary", "fc_norm-weights-without-the-flag",
                                  "mla", "no-d2t"])
def test_a_head_tandem_cannot_run_is_refused_with_the_reason(kind, tiny_dir, tmp_path):
    from draft_server.checkpoint import DraftLoadError

    head, reason = _refused(tmp_path, kind)
    with pytest.raises(DraftLoadError, match=reason) as error:
        load_draft(head, tiny_dir / "target")
    assert "layout" in str(error.value)  # and names the layout it read
