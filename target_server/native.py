"""A target model of our own for the Llama family: Llama 2/3.x, Mistral (full attention), Qwen2/2.5
(q/k/v bias) and Qwen3 (per-head q/k RMSNorm), nanoGPT-style.

Parameter names mirror the checkpoint's keys (model.embed_tokens.weight, model.layers.N.self_attn.q_proj.weight,
..., model.norm.weight, lm_head.weight), so the same safetensors load with load_state_dict. What a library
already does is taken from it: the config (transformers' config classes), the RoPE inverse frequencies
(transformers' ROPE_INIT_FUNCTIONS: llama3, yarn, linear scaling), the tensors (safetensors).

The forward takes a flattened batch (all new tokens of all sequences, one after another) and reads and
writes the paged KV pool in place (target_server/paged.py). It returns the EAGLE-3 features with the
hidden states: hidden-states id k < L is the input of layer k (0: the embeddings), id L the last layer's
output before the final norm (target_server/capture.py), captured here rather than by hooks.
`load_native` answers None for what it does not support, and the engine falls back to transformers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig, PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from tandem.packed import concatenated
from tandem.pairing import default_aux_layer_ids
from target_server.capture import check_aux_layer_ids
from target_server.paged import PagedBatch, open_batch, paged_attention

ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
ROPE_TYPES = {"default", "linear", "llama3", "yarn"}  # static frequencies; dynamic/longrope depend on the length


class RMSNorm(nn.Module):
    """As transformers computes it: in float32, the weight applied in the input's dtype; through torch's
    F.rms_norm rather than transformers' six ops (same bits here; faster at 16 tokens, about even at one)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half layout. x [1, heads, T, D], cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int, bias: bool, qk_norm: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * head_dim, hidden, bias=bool(getattr(config, "attention_bias", False)))
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None  # Qwen3: per head, before RoPE
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.qkv: nn.Linear | None = None  # q, k and v in one product (fuse_projections)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, batch: PagedBatch) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv is not None:
            q, k, v = self.qkv(x).split_with_sizes([self.heads * self.head_dim, *[self.kv_heads * self.head_dim] * 2], -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # [1, heads, T, D], attention's layout, made by RoPE itself (inductor's CPU flex template reads the
        # shape of its inputs' buffers: a view of a 3-d buffer fails it)
        q, k = rotate(torch.cat([q, k], dim=1).transpose(0, 1)[None], cos, sin).split_with_sizes([self.heads, self.kv_heads], 1)
        out = paged_attention(q, k, v.transpose(0, 1)[None], layer, batch)  # [1, Hq, T, D]
        return self.o_proj(out[0].transpose(0, 1).reshape(t, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.gate_up: nn.Linear | None = None  # gate and up in one product (fuse_projections)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int, bias: bool, qk_norm: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, head_dim, bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)


class Decoder(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int, bias: bool, qk_norm: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, head_dim, bias, qk_norm) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class NativeCausalLM(nn.Module):
    """`model.*` and `lm_head` as in the checkpoint; `inv_freq` and the capture ids are not parameters."""

    def __init__(self, config: PretrainedConfig, aux_layer_ids: Sequence[int]):
        super().__init__()
        self.config = config
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        family = config.architectures[0]
        bias = family == "Qwen2ForCausalLM" or bool(getattr(config, "attention_bias", False))
        self.model = Decoder(config, self.head_dim, bias, qk_norm=family == "Qwen3ForCausalLM")
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        inv_freq, self.rope_scaling = rope_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D/2], float32 whatever the dtype
        self.aux_layer_ids = tuple(int(i) for i in aux_layer_ids)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, positions [T] (the flattened batch) -> hidden states after the final norm [T, H] and the
        features [T, 3H]. Writes the new tokens' KV into the pool rows `batch.slots`."""
        batch = open_batch(batch, positions, self.config.num_attention_heads // self.config.num_key_value_heads)
        x = self.model.embed_tokens(ids)  # [T, H]
        freqs = positions[:, None].float() * self.inv_freq[None]  # [T, D/2], as transformers: in float32
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos = (emb.cos() * self.rope_scaling).to(x.dtype)
        sin = (emb.sin() * self.rope_scaling).to(x.dtype)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in self.aux_layer_ids:
                captured[i] = x
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, i, batch)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        captured[self.num_layers] = x
        features = torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1)  # [T, 3H]
        return self.model.norm(x), features


def fuse_projections(decoder: nn.Module) -> None:
    """For an eager forward: each layer's q, k and v projections become one product, and gate and up another
    (weights and biases concatenated, the three and two dropped), as vLLM's QKVParallelLinear and
    MergedColumnParallelLinear do: 3 products a layer fewer, a decode and a verify a little faster on the demo
    target and on SmolLM2-135M (16 decodes about even). A compiled forward keeps them apart: inductor plans
    its own kernels."""
    for layer in decoder.layers:
        attention, mlp = layer.self_attn, layer.mlp
        attention.qkv = concatenated(attention.q_proj, attention.k_proj, attention.v_proj)
        attention.q_proj = attention.k_proj = attention.v_proj = None
        mlp.gate_up = concatenated(mlp.gate_proj, mlp.up_proj)
        mlp.gate_proj = mlp.up_proj = None


def rope_frequencies(config: PretrainedConfig) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies [D/2] (float32, on the CPU) and its attention scaling, as transformers
    computes them for the config's rope_parameters."""
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    init = LlamaRotaryEmbedding.compute_default_rope_parameters
    if rope_type != "default":
        init = ROPE_INIT_FUNCTIONS[rope_type]
    with torch.device("cpu"):
        inv_freq, scaling = init(config)
    return inv_freq.float(), float(scaling)


def unsupported(config: PretrainedConfig) -> str | None:
    """Why the native model cannot run this checkpoint (None: it can)."""
    family = (getattr(config, "architectures", None) or ["?"])[0]
    if family not in ARCHITECTURES:
        return f"architecture {family}"
    window = getattr(config, "sliding_window", None)
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if (window and window < config.max_position_embeddings) or types != {"full_attention"}:
        return f"sliding-window attention (window {window}, layers {sorted(types)})"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in ROPE_TYPES:
        return f"RoPE type {rope.get('rope_type')}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act}"
    return None


def checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a single or sharded safetensors checkpoint."""
    index = model_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(model_dir / name))
    return tensors


def load_native(model_dir: str | Path, device: torch.device, dtype: torch.dtype,
                aux_layer_ids: Sequence[int]) -> NativeCausalLM | None:
    """The checkpoint as a NativeCausalLM on `device` capturing `aux_layer_ids` (empty: EAGLE-3's default
    for its depth), or None when the family or a feature of it is not supported (the engine then runs
    transformers' model)."""
    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    if unsupported(config) is not None:
        return None
    layers = config.num_hidden_layers
    aux_layer_ids = check_aux_layer_ids(aux_layer_ids or default_aux_layer_ids(layers), layers)
    with torch.device("meta"):
        model = NativeCausalLM(config, aux_layer_ids)
    tensors = checkpoint_tensors(model_dir)
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}  # older checkpoints
    if config.tie_word_embeddings:  # one tensor under both names
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    model.load_state_dict(tensors, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    model.inv_freq = rope_frequencies(config)[0].to(device)  # built on meta above; float32 after the cast
    return model
