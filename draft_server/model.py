"""The EAGLE-3 draft network. Module names mirror the reference checkpoint's keys
(`fc`, `midlayer.*`, `norm`, `lm_head`, `embed_tokens`, `d2t`, `t2d`), so loading is a straight mapping.

One step, for draft sequence index i holding the pair (h_i, x_{i+1}) at RoPE position i:
  h_i = fc(F_i) for committed positions (F_i: the target's 3 captured states, [3*Ht]),
        or the draft's own pre-norm output a for rollout steps ([H]);
  x   = cat(input_layernorm(embed(x_{i+1})), hidden_norm(h_i))            [2H]
  a   = residual + attn(x);  a = a + mlp(post_attention_layernorm(a))       [H]
  logits over the draft vocabulary = lm_head(norm(a)); target id = d + d2t[d].

EAGLE-3.1 options (vLLM's and speculators' config fields; SpecForge and NeMo write the same keys):
  norm_before_fc   fc(input_norm(F)), one RMSNorm over the concatenated 3Ht            (key input_norm)
  fc_norm          fc(cat(fc_norm[0](F_low), fc_norm[1](F_mid), fc_norm[2](F_high)))  (keys fc_norm.{0,1,2})
  norm_output      the step's output is norm(a): the next step reads the post-norm state, and the logits
                   are lm_head of it (no second norm)
Qwen3 decoder layer (speculators' default transformer_layer_config): RMSNorm over each head of q and k
before RoPE (q_norm, k_norm).

Heads of N decoder layers (speculators' num_hidden_layers, NeMo's P-EAGLE heads): layer 0 is the one above
(`midlayer`, reading 2H); layers 1..N-1 are plain pre-norm Llama layers over H (`layers.{i}.*`), each with its
own KV. The step's output a is the last layer's.

P-EAGLE (parallel drafting, `parallel_drafting`): one learnable `mask_hidden` [1, 1, 3Ht] stands in for the
target's features at every masked depth, through the same fuse (fc, fc_norm, input_norm) as real ones, with
the token `mask_token_id`. One forward over the round's new pairs and K-1 masked positions after them
(positions continuing the pairs', attending causally) gives all K drafts: d_1 from the last pair's output,
d_{1+j} from masked position j. The masked positions' KV is dropped after the forward, as a rollout's is.
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
)


@dataclass
class Eagle3Config:
    layer: LlamaConfig  # the decoder layer's shape, RoPE and norms
    target_hidden_size: int  # Ht: fc takes 3*Ht
    draft_vocab_size: int
    norm_before_residual: bool = False  # speculators: the residual is hidden_norm(h), not h
    aux_layer_ids: list[int] | None = None  # the target hidden states it fuses (hidden-states ids, aux_layers.py)
    norm_before_fc: bool = False  # EAGLE-3.1 options: see the module docstring
    fc_norm: bool = False
    norm_output: bool = False
    qk_norm: bool = False  # Qwen3 layer: q_norm and k_norm
    num_layers: int = 1  # decoder layers: the first reads 2H, the others are plain Llama layers over H
    parallel_drafting: bool = False  # P-EAGLE: all drafts of a round in one forward (the module docstring)
    mask_token_id: int = 0  # P-EAGLE: the token at every masked depth
    num_depths: int = 1  # P-EAGLE: the drafts one forward was trained to give (depth 0 and num_depths-1 masked)
    down_sample_ratio: float = 0.7  # P-EAGLE training (COD): depth d keeps max(ratio**d, ratio_min) of the anchors
    down_sample_ratio_min: float = 0.2

    @property
    def hidden_size(self) -> int:
        return int(self.layer.hidden_size)

    @property
    def kind(self) -> str:
        """The head's kind in words, as bench and profile show it: 'eagle3, 1 layer', 'p-eagle, 2 layers, 5 depths'."""
        layers = f"{self.num_layers} layer{'s' if self.num_layers > 1 else ''}"
        return f"p-eagle, {layers}, {self.num_depths} depths" if self.parallel_drafting else f"eagle3, {layers}"

    @property
    def vocab_size(self) -> int:
        return int(self.layer.vocab_size)


class DraftKV:
    """The draft layer's KV for one sequence or a batch: [B, kv_heads, S, head_dim], grown by concatenation,
    or (`over`) written in place into buffers of a fixed width, the same storage every step, which is what a
    CUDA graph replays over (draft_server/batch.py). A head of several layers keeps layer 0's here and each
    deeper layer's in `deeper` (made on first use)."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.deeper: dict[int, DraftKV] = {}
        self.store: tuple[torch.Tensor, torch.Tensor] | None = None  # `over`'s buffers, k and v

    @classmethod
    def over(cls, stores: list[tuple[torch.Tensor, torch.Tensor]], filled: int) -> DraftKV:
        """A KV over each layer's buffers (k, v) [B, kv_heads, columns, head_dim], whose first `filled` columns
        hold keys and values already: `append` writes the next columns in place and returns views."""
        kv = cls()
        for index, (k, v) in enumerate(stores):
            layer = kv.layer(index)
            layer.store = (k, v)
            layer.k, layer.v = k[:, :, :filled], v[:, :, :filled]
        return kv

    def layer(self, index: int) -> DraftKV:
        """The KV of decoder layer `index` (0: this one)."""
        if index == 0:
            return self
        return self.deeper.setdefault(index, DraftKV())

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.store is None:
            self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
            self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
            return self.k, self.v
        store_k, store_v = self.store
        start, end = self.length, self.length + k.shape[2]
        if end > store_k.shape[2]:
            raise ValueError(f"the draft KV's buffer holds {store_k.shape[2]} columns; {end} asked for")
        store_k[:, :, start:end] = k
        store_v[:, :, start:end] = v
        self.k, self.v = store_k[:, :, :end], store_v[:, :, :end]
        return self.k, self.v

    def tensors(self, layers: int) -> tuple[torch.Tensor, ...]:
        """Each decoder layer's k and v, layer after layer (k0, v0, k1, v1, ...): a compiled call's inputs."""
        return tuple(t for i in range(layers) for t in (self.layer(i).k, self.layer(i).v))

    def put(self, tensors) -> DraftKV:
        """Each layer's k and v set from what `tensors()` flattened -> self."""
        for i in range(len(tensors) // 2):
            self.layer(i).k, self.layer(i).v = tensors[2 * i], tensors[2 * i + 1]
        return self

    def crop(self, length: int) -> None:
        if self.k is not None and self.k.shape[2] > length:
            self.k = self.k[:, :, :length]
            self.v = self.v[:, :, :length]
        for deeper in self.deeper.values():
            deeper.crop(length)


class Float32Rotary(LlamaRotaryEmbedding):
    """Llama's RoPE whose inverse frequencies stay float32 whatever the head is cast to. `.to(bfloat16)`
    casts buffers too, and inv_freq in bf16 keeps 3 significant digits: at position 3000, cos(3000 f) was
    off by up to 1.7 and acceptance fell with context. The target keeps them float32 already
    (from_pretrained(dtype=) casts weights, not the buffers its modules compute in float)."""

    def _apply(self, fn, recurse=True):
        inv_freq, original = self.inv_freq, self.original_inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)  # moved with the module, never cast
        self.original_inv_freq = original.to(self.original_inv_freq.device)
        return self


class RMSNorm(LlamaRMSNorm):
    """Llama's RMSNorm (its weight, epsilon and float32 arithmetic) in torch's one op, not Llama's five: the
    rollout runs four norms a step, and a step's cost on a CPU is mostly per-op overhead (the demo head is 192
    wide)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.variance_epsilon)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.variance_epsilon).to(x.dtype)


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v projections read 2H (token embedding and hidden state)."""

    def __init__(self, config: LlamaConfig, qk_norm: bool = False, fused: bool = True):
        """`fused`: the projections read 2H (layer 0); else H (a deeper layer's plain Llama attention)."""
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = bool(getattr(config, "attention_bias", False))
        in_dim = (2 if fused else 1) * config.hidden_size
        self.q_proj = nn.Linear(in_dim, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps) if qk_norm else None

    def forward(self, x, cos, sin, kv: DraftKV | None, attn_mask: torch.Tensor | None):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)  # [B, nh, S, hd]
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, nkv, S, hd]
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:  # over head_dim, the last axis
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        past = 0
        if kv is not None:
            past = kv.length
            k, v = kv.append(k, v)
        if attn_mask is None and s > 1:
            # causal over [cached | new]: new query j sees keys 0..past+j (one query sees them all)
            attn_mask = torch.ones(s, past + s, dtype=torch.bool, device=x.device).tril(diagonal=past)
        # grouped-query attention without repeated KV: a batch's KV repeated for its mask was a copy of it a step
        # (docs/benchmarks.md, "The draft's batched propose")
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        layer = config.layer
        self.norm_before_residual = config.norm_before_residual
        self.hidden_norm = RMSNorm(layer.hidden_size, eps=layer.rms_norm_eps)
        self.input_layernorm = RMSNorm(layer.hidden_size, eps=layer.rms_norm_eps)
        self.self_attn = Eagle3Attention(layer, qk_norm=config.qk_norm)
        self.post_attention_layernorm = RMSNorm(layer.hidden_size, eps=layer.rms_norm_eps)
        self.mlp = LlamaMLP(layer)

    def forward(self, embeds, hidden, cos, sin, kv, attn_mask):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, S, 2H]
        a = residual + self.self_attn(x, cos, sin, kv, attn_mask)
        return a + self.mlp(self.post_attention_layernorm(a))


class DeeperLayer(nn.Module):
    """Layer i >= 1 of a head of several: a plain pre-norm Llama layer over H (speculators' and NeMo's)."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        layer = config.layer
        self.input_layernorm = RMSNorm(layer.hidden_size, eps=layer.rms_norm_eps)
        self.self_attn = Eagle3Attention(layer, qk_norm=config.qk_norm, fused=False)
        self.post_attention_layernorm = RMSNorm(layer.hidden_size, eps=layer.rms_norm_eps)
        self.mlp = LlamaMLP(layer)

    def forward(self, a, cos, sin, kv, attn_mask):
        a = a + self.self_attn(self.input_layernorm(a), cos, sin, kv, attn_mask)
        return a + self.mlp(self.post_attention_layernorm(a))


class Eagle3Draft(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        layer = config.layer
        h = layer.hidden_size
        self.embed_tokens = nn.Embedding(layer.vocab_size, h)
        ht = config.target_hidden_size
        self.input_norm = RMSNorm(3 * ht, eps=layer.rms_norm_eps) if config.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList(RMSNorm(ht, eps=layer.rms_norm_eps) for _ in range(3)) if config.fc_norm else None
        )
        self.fc = nn.Linear(3 * ht, h, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        # layers 1..N-1, keyed as the published heads key them (layers.1.*, ...)
        self.layers = nn.ModuleDict({str(i): DeeperLayer(config) for i in range(1, config.num_layers)})
        if config.parallel_drafting:  # at the width of the features it stands in for
            self.mask_hidden = nn.Parameter(torch.randn(1, 1, 3 * ht))
        self.norm = RMSNorm(h, eps=layer.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.rotary_emb = Float32Rotary(layer)
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
        """-> a [B, S, H], the output that feeds the next step: pre-norm (post-norm with norm_output)."""
        embeds = self.embed_tokens(tokens).to(hidden.dtype)
        cos, sin = self.rotary_emb(hidden, positions)
        a = self.midlayer(embeds, hidden, cos, sin, kv, attn_mask)
        for index, layer in self.layers.items():
            a = layer(a, cos, sin, None if kv is None else kv.layer(int(index)), attn_mask)
        return self.norm(a) if self.config.norm_output else a

    def parallel_inputs(self, next_tokens: list[int], length: int, depths: int) -> tuple[list[int], list[int]]:
        """A P-EAGLE propose's tokens and positions (host lists): the m new pairs' tokens at length.., then
        `depths - 1` masked positions."""
        masked = depths - 1
        tokens = [*next_tokens, *[self.config.mask_token_id] * masked]
        return tokens, list(range(length, length + len(tokens)))

    def mask_row(self) -> torch.Tensor:
        """fuse(mask_hidden) [1, H]: the hidden input of every masked position."""
        return self.fuse(self.mask_hidden.view(1, -1))

    def parallel_draft(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, kv: DraftKV,
                       mask_row: torch.Tensor | None = None) -> torch.Tensor:
        """P-EAGLE: a session's m new pairs (features [m, 3Ht]) appended to its KV and the masked positions
        after them in one forward (tokens, positions [m + masked] as parallel_inputs makes them; `mask_row`:
        mask_row(), computed once by the caller) -> the outputs whose logits give d_1..d_{masked+1}
        [masked + 1, H]. The KV keeps the pairs only."""
        m = features.shape[0]
        masked = tokens.shape[0] - m
        length = kv.length
        row = self.mask_row() if mask_row is None else mask_row
        hidden = torch.cat([self.fuse(features), row.to(features.dtype).expand(masked, -1)])
        a = self(hidden[None], tokens[None], positions[None], kv)[0]  # [m + masked, H]
        kv.crop(length + m)
        return a[m - 1:]

    def greedy_parallel(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                        mask_row: torch.Tensor, rounds: int, *kv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A lone greedy session's P-EAGLE propose as a pure function (rollout.ParallelPropose compiles it, a graph
        per `rounds`): parallel_draft over each layer's KV `kv` (DraftKV.tensors) -> the drafts (target ids
        [rounds]), the outputs that proposed them [rounds, H], and each layer's KV with the m pairs."""
        cache = DraftKV().put(kv)
        a = self.parallel_draft(features, tokens, positions, cache, mask_row)[:rounds]
        return self.to_target_ids(self.draft_logits(a).argmax(-1)), a, *cache.tensors(self.config.num_layers)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [..., 3Ht] (low, mid, high) -> the hidden state h [..., H]."""
        if self.input_norm is not None:
            features = self.input_norm(features)
        if self.fc_norm is not None:
            features = torch.cat([norm(f) for norm, f in zip(self.fc_norm, features.chunk(3, dim=-1), strict=True)],
                                 dim=-1)
        return self.fc(features)

    def greedy_step(self, a: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step of a lone greedy rollout as a pure function (rollout.GreedyStep compiles it): a [H] fed with
        tokens [1, 1] at positions [1, 1] over the layer's KV k, v -> the next a [H], its draft (a target id,
        [1]) and the KV grown by one. (a is one-dimensional so that its strides are always the same: the
        compiled graph is guarded on them.)"""
        kv = DraftKV()
        kv.k, kv.v = k, v
        a = self(a.view(1, 1, -1), tokens, positions, kv, None)[0, -1]
        return a, self.to_target_ids(self.draft_logits(a[None]).argmax(-1)), kv.k, kv.v

    def greedy_propose(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, rounds: int) -> tuple[torch.Tensor, ...]:
        """A lone greedy session's whole propose as a pure function (rollout.GreedyPropose compiles it, a graph
        per `rounds`): its m new pairs (features [m, 3Ht], tokens [m], positions [m]) appended to the layer's
        KV k, v, then `rounds` drafts -> the drafts (target ids [rounds]), the outputs that proposed them
        [rounds, H], and the KV with the m pairs (the rollout's own is dropped: exact features replace it)."""
        kv = DraftKV()
        kv.k, kv.v = k, v
        a = self(self.fuse(features)[None], tokens[None], positions[None], kv)[0, -1]
        committed = kv.k, kv.v
        position = positions[-1:][None] + 1
        drafts, rows = [], []
        for n in range(rounds):
            drafts.append(self.to_target_ids(self.draft_logits(a[None]).argmax(-1)))
            rows.append(a)
            if n + 1 < rounds:
                a = self(a.view(1, 1, -1), drafts[-1][:, None], position, kv, None)[0, -1]
                position = position + 1
        return torch.cat(drafts), torch.stack(rows), *committed

    def draft_logits(self, a: torch.Tensor) -> torch.Tensor:
        """a [..., H] (a step's output) -> logits over the draft vocabulary [..., draft_vocab]."""
        return self.lm_head(a if self.config.norm_output else self.norm(a))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]
