"""The EAGLE-3 draft network. Module names mirror the reference checkpoint's keys
(`fc`, `midlayer.*`, `norm`, `lm_head`, `embed_tokens`, `d2t`, `t2d`), so loading is a straight mapping.

One step, for draft sequence index i holding the pair (h_i, x_{i+1}) at RoPE position i:
  h_i = fc(F_i) for committed positions (F_i: the target's 3 captured states, [3*Ht]),
        or the draft's own pre-norm output a for rollout steps ([H]);
  x   = cat(input_layernorm(embed(x_{i+1})), hidden_norm(h_i))            [2H]
  a   = residual + attn(x);  a = a + mlp(post_attention_layernorm(a))       [H]
  logits over the draft vocabulary = lm_head(norm(a)); target id = d + d2t[d].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)


@dataclass
class Eagle3Config:
    layer: LlamaConfig  # the decoder layer's shape, RoPE and norms
    target_hidden_size: int  # Ht: fc takes 3*Ht
    draft_vocab_size: int
    norm_before_residual: bool = False  # speculators: the residual is hidden_norm(h), not h
    aux_layer_ids: list[int] | None = None  # the target layers the head was trained on

    @property
    def hidden_size(self) -> int:
        return int(self.layer.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.layer.vocab_size)


class DraftKV:
    """The draft layer's KV for one sequence: [B, kv_heads, S, head_dim], grown by concatenation."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        if self.k is not None and self.k.shape[2] > length:
            self.k = self.k[:, :, :length]
            self.v = self.v[:, :, :length]


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v projections read 2H (token embedding and hidden state)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = bool(getattr(config, "attention_bias", False))
        in_dim = 2 * config.hidden_size
        self.q_proj = nn.Linear(in_dim, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

    def forward(self, x, cos, sin, kv: DraftKV | None, attn_mask: torch.Tensor | None):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)  # [B, nh, S, hd]
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, nkv, S, hd]
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        past = 0
        if kv is not None:
            past = kv.length
            k, v = kv.append(k, v)
        if attn_mask is None:
            # causal over [cached | new]: new query j sees keys 0..past+j
            attn_mask = torch.ones(s, past + s, dtype=torch.bool, device=x.device).tril(diagonal=past)
        n_rep = self.num_heads // self.num_kv_heads
        out = F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=attn_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        layer = config.layer
        self.norm_before_residual = config.norm_before_residual
        self.hidden_norm = LlamaRMSNorm(layer.hidden_size, eps=layer.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(layer.hidden_size, eps=layer.rms_norm_eps)
        self.self_attn = Eagle3Attention(layer)
        self.post_attention_layernorm = LlamaRMSNorm(layer.hidden_size, eps=layer.rms_norm_eps)
        self.mlp = LlamaMLP(layer)

    def forward(self, embeds, hidden, cos, sin, kv, attn_mask):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, S, 2H]
        a = residual + self.self_attn(x, cos, sin, kv, attn_mask)
        return a + self.mlp(self.post_attention_layernorm(a))


class Eagle3Draft(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        layer = config.layer
        h = layer.hidden_size
        self.embed_tokens = nn.Embedding(layer.vocab_size, h)
        self.fc = nn.Linear(3 * config.target_hidden_size, h, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = LlamaRMSNorm(h, eps=layer.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(layer)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(layer.vocab_size, dtype=torch.bool))

    def forward(
        self,
        hidden: torch.Tensor,  # [B, S, H]: fc(features) or the previous step's output a
        tokens: torch.Tensor,  # [B, S] target ids x_{i+1}
        positions: torch.Tensor,  # [B, S] RoPE positions i
        kv: DraftKV | None = None,
        attn_mask: torch.Tensor | None = None,  # [S, past + S] bool, True attends; None: causal (TTT: its own)
    ) -> torch.Tensor:
        """-> a [B, S, H], the pre-norm output that feeds the next step."""
        embeds = self.embed_tokens(tokens).to(hidden.dtype)
        cos, sin = self.rotary_emb(hidden, positions)
        return self.midlayer(embeds, hidden, cos, sin, kv, attn_mask)

    def draft_logits(self, a: torch.Tensor) -> torch.Tensor:
        """a [..., H] -> logits over the draft vocabulary [..., draft_vocab]."""
        return self.lm_head(self.norm(a))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]
