"""Training an EAGLE-3 head for a local Hugging Face target, with training-time test (TTT) as in EAGLE-3.

The target is frozen and only read: one forward over a training sequence x_0..x_{T-1} gives the captured
features F_i [3Ht] (TargetEngine's hooks and layer ids) and the logits L_i, which predict x_{i+1}.

TTT step 1 is DraftEngine.propose's extend: index i holds (fc(F_i), x_{i+1}) at RoPE position i, attends
causally, and predicts the target at i+1 (L_{i+1}). Step j > 1 is rollout step j of a round whose last
committed pair is index i: it feeds (a^{j-1}_i, x_{i+j}) at position i+j-1, where a^{j-1}_i is the previous
step's pre-norm output at the same index, and predicts L_{i+j}. Its query sees the step-1 keys of indices
<= i (the committed KV) and, of each rollout step 2..j, only the key at index i (that round's rollout KV):
the reference's diagonal mask, and exactly what propose computes at inference.

The loss of step j is the cross entropy against the target's softmax over the draft vocabulary, weighted
by decay**(j-1). The embeddings are the target's and stay frozen; the head is saved without them in the
reference layout, so it loads like a published one: DraftEngine(out_dir, target_dir).
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from draft_server.checkpoint import REFERENCE, save_draft
from draft_server.model import DraftKV, Eagle3Config, Eagle3Draft
from draft_server.train_cli import add_train_parser, cmd_train_draft  # noqa: F401 (the CLI, torch-free, lives there)
from tandem.tiny import draft_vocab_from_counts, stdlib_text
from target_server.capture import FeatureCapture, default_layer_ids
from target_server.engine import DTYPES

# -- the frozen target -------------------------------------------------------------------------------------


class Teacher:
    """The frozen target: features and logits of whole sequences, captured as TargetEngine captures them."""

    def __init__(
        self,
        target_dir: str | Path,
        device: str = "cpu",
        layer_ids: Sequence[int] | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        self.target_dir = Path(target_dir)
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(self.target_dir, dtype=dtype)
        self.model.to(self.device).eval().requires_grad_(False)
        self.config = self.model.config
        layers = self.model.get_decoder().layers
        self.num_layers = len(layers)
        self.layer_ids = tuple(layer_ids) if layer_ids else default_layer_ids(self.num_layers)
        self.capture = FeatureCapture(layers, self.layer_ids)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.config, "eos_token_id", None)
        self.eos_token_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, T], right-padded -> features [B, T, 3Ht], logits [B, T, V]."""
        logits = self.model(input_ids=ids.to(self.device), use_cache=False).logits
        return self.capture.take(), logits

    @torch.inference_mode()
    def continue_sequences(
        self, prompts: torch.Tensor, new_tokens: int, temperature: float = 0.0, generator=None
    ) -> torch.Tensor:
        """The target's own continuations of prompts [B, P] -> [B, P + new_tokens]. EOS does not end a row,
        as it does not with ignore_eos."""
        ids = prompts.to(self.device)
        cache = DynamicCache(config=self.config)
        step = ids
        for _ in range(new_tokens):
            logits = self.model(input_ids=step, past_key_values=cache, use_cache=True).logits[:, -1]  # [B, V]
            self.capture.take()  # the hooks fire on every forward; drop what they kept
            if temperature > 0:
                step = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator)
            else:
                step = logits.argmax(-1, keepdim=True)  # [B, 1]
            ids = torch.cat([ids, step], dim=1)
        return ids.cpu()

    def remove(self) -> None:
        self.capture.remove()


# -- data --------------------------------------------------------------------------------------------------


def tokenize_texts(target_dir: str | Path, texts: Sequence[str], seq_len: int) -> list[list[int]]:
    """Texts -> token sequences of at most seq_len tokens (a long text is cut into consecutive chunks)."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    out: list[list[int]] = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        out.extend(ids[start : start + seq_len] for start in range(0, len(ids), seq_len))
    return [s for s in out if len(s) >= 3]


def text_prompts(
    target_dir: str | Path,
    count: int,
    length: int,
    seed: int,
    texts: Sequence[str] | None = None,
    skip_files: int = 0,
) -> torch.Tensor:
    """`count` prompts of `length` tokens cut at random places from `texts`, or by default from text every
    machine with Python has (the standard library's sources, from the `skip_files`-th file on) -> [count, length]."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    if texts is None:
        texts = [stdlib_text(max_bytes=200_000, skip=skip_files)]
    ids = [i for text in texts for i in tokenizer(text)["input_ids"]]
    if len(ids) <= length:
        raise ValueError(f"the prompt text has {len(ids)} tokens; prompts of {length} need more")
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(ids) - length) for _ in range(count)]
    return torch.tensor([ids[s : s + length] for s in starts])


def self_distilled(
    teacher: Teacher,
    num_sequences: int,
    seq_len: int,
    *,
    prompt_len: int = 16,
    texts: Sequence[str] | None = None,
    sampled_fraction: float = 0.25,
    temperature: float = 0.8,
    seed: int = 0,
    batch_size: int = 256,
) -> list[list[int]]:
    """Sequences the target writes itself from text prompts (EAGLE-3 trains on the target's own answers):
    greedy continuations, and a `sampled_fraction` of them sampled at `temperature` for variety."""
    prompts = text_prompts(teacher.target_dir, num_sequences, prompt_len, seed, texts=texts)
    generator = torch.Generator(device=teacher.device).manual_seed(seed)
    num_greedy = num_sequences - round(num_sequences * sampled_fraction)
    sequences: list[list[int]] = []
    for start in range(0, num_sequences, batch_size):
        stop = min(start + batch_size, num_sequences)
        for lo, hi, temp in ((start, min(stop, num_greedy), 0.0), (max(start, num_greedy), stop, temperature)):
            if lo < hi:
                out = teacher.continue_sequences(prompts[lo:hi], seq_len - prompt_len, temp, generator)
                sequences.extend(out.tolist())
    return sequences


def draft_vocabulary(
    sequences: Sequence[Sequence[int]], vocab_size: int, draft_vocab_size: int, always: Sequence[int] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """d2t [draft_vocab], t2d [vocab] from the token counts of the training data; the `always` ids (EOS)
    are kept whatever their count, so the head can always propose the end."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        counts += torch.bincount(torch.as_tensor(seq, dtype=torch.long), minlength=vocab_size)
    for token in always:
        counts[token] = counts.max() + 1
    return draft_vocab_from_counts(counts, draft_vocab_size)


def pad_batch(sequences: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ids [B, T] right-padded with 0, lengths [B]. Right padding is harmless: causal attention keeps the
    real positions from seeing it, and the loss masks it."""
    lengths = torch.tensor([len(s) for s in sequences])
    ids = torch.zeros(len(sequences), int(lengths.max()), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.as_tensor(seq)
    return ids, lengths


# -- the head ----------------------------------------------------------------------------------------------


def draft_config_for(
    target_config, draft_vocab_size: int, aux_layer_ids: Sequence[int] | None = None
) -> Eagle3Config:
    """A one-layer head shaped like one decoder layer of the target, as the published heads are."""
    t = target_config
    rope = dict(getattr(t, "rope_parameters", None) or {}) or {"rope_type": "default", "rope_theta": 10000.0}
    layer = LlamaConfig(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=getattr(t, "num_key_value_heads", None) or t.num_attention_heads,
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
        max_position_embeddings=t.max_position_embeddings,
        rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6),
        rope_parameters=rope,
        bos_token_id=t.bos_token_id,
        eos_token_id=t.eos_token_id,
        tie_word_embeddings=False,
    )
    return Eagle3Config(
        layer=layer,
        target_hidden_size=int(t.hidden_size),
        draft_vocab_size=draft_vocab_size,
        aux_layer_ids=list(aux_layer_ids) if aux_layer_ids is not None else None,
    )


def init_draft(
    teacher: Teacher, config: Eagle3Config, d2t: torch.Tensor, t2d: torch.Tensor, from_target: bool = True
) -> Eagle3Draft:
    """A fresh head reading the target's embeddings, which stay frozen (they are not saved). With
    `from_target` (and equal widths) norm and lm_head start as the target's final norm and its lm_head rows
    of the draft vocabulary: the head then begins by reading its output as the target reads its own."""
    draft = Eagle3Draft(config)
    target = teacher.model
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
        final_norm = getattr(target.get_decoder(), "norm", None)
        if from_target and config.hidden_size == teacher.hidden_size and final_norm is not None:
            draft.lm_head.weight.copy_(target.get_output_embeddings().weight[t2d])
            draft.norm.weight.copy_(final_norm.weight)
    draft.embed_tokens.requires_grad_(False)
    return draft


# -- training-time test ------------------------------------------------------------------------------------


def _rollout_step(
    draft: Eagle3Draft,
    hidden: torch.Tensor,  # [B, S, H] the previous step's a
    tokens: torch.Tensor,  # [B, S]
    positions: torch.Tensor,  # [B, S]
    committed: DraftKV,  # step 1's keys and values, [B, nkv, S, hd]
    rollout: list[tuple[torch.Tensor, torch.Tensor]],  # keys and values of steps 2..j-1, [B, nh, S, hd]; grows
) -> torch.Tensor:
    """Eagle3Draft.forward for TTT step j >= 2 with its attention written out: query i sees the committed keys
    0..i and, of each rollout step so far (this one included), the key at index i only. The same as attending
    over [committed | step 2 | ... | step j] with the mask [causal | eye | ... | eye], without computing the
    S x S blocks that mask would throw away."""
    layer = draft.midlayer
    attn = layer.self_attn
    b, s, _ = hidden.shape
    embeds = draft.embed_tokens(tokens).to(hidden.dtype)
    cos, sin = draft.rotary_emb(hidden, positions)
    normed = layer.hidden_norm(hidden)
    residual = normed if layer.norm_before_residual else hidden
    x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)  # [B, S, 2H]
    q = attn.q_proj(x).view(b, s, attn.num_heads, attn.head_dim).transpose(1, 2)  # [B, nh, S, hd]
    k = attn.k_proj(x).view(b, s, attn.num_kv_heads, attn.head_dim).transpose(1, 2)  # [B, nkv, S, hd]
    v = attn.v_proj(x).view(b, s, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    n_rep = attn.num_heads // attn.num_kv_heads
    rollout.append((repeat_kv(k, n_rep), repeat_kv(v, n_rep)))
    k1, v1 = repeat_kv(committed.k, n_rep), repeat_kv(committed.v, n_rep)
    scale = attn.head_dim**-0.5  # scaled_dot_product_attention's default
    causal = torch.ones(s, s, dtype=torch.bool, device=hidden.device).tril()
    scores = (q @ k1.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))  # [B, nh, S, S]
    own = torch.stack([(q * km).sum(-1) * scale for km, _ in rollout], dim=-1)  # [B, nh, S, j-1]
    probs = torch.softmax(torch.cat([scores, own], dim=-1), dim=-1)
    out = probs[..., :s] @ v1  # [B, nh, S, hd]
    for m, (_, vm) in enumerate(rollout):
        out = out + probs[..., s + m, None] * vm
    a = residual + attn.o_proj(out.transpose(1, 2).reshape(b, s, -1))
    return a + layer.mlp(layer.post_attention_layernorm(a))


def ttt_forward(
    draft: Eagle3Draft,
    ids: torch.Tensor,  # [B, T] target ids x_0..x_{T-1}
    features: torch.Tensor,  # [B, T, 3Ht] the target's F_0..F_{T-1}
    ttt_steps: int,
) -> list[torch.Tensor]:
    """-> the pre-norm outputs a of TTT steps 1..ttt_steps, [B, T-1, H] each.

    Index i of step j is rollout step j of a round whose last committed pair is (F_i, x_{i+1}): it reads the
    token x_{i+j} (0 past the end) at RoPE position i+j-1, and its logits guess x_{i+j+1}."""
    b, t = ids.shape
    s = t - 1
    index = torch.arange(s, device=ids.device)
    committed = DraftKV()
    a = draft(draft.fc(features[:, :s]), ids[:, 1:], index[None].expand(b, s), committed)  # causal extend
    outputs = [a]
    rollout: list[tuple[torch.Tensor, torch.Tensor]] = []
    for j in range(2, ttt_steps + 1):
        tokens = F.pad(ids[:, j:], (0, j - 1))  # [B, S]: x_{i+j}
        a = _rollout_step(draft, a, tokens, (index + j - 1)[None].expand(b, s), committed, rollout)
        outputs.append(a)
    return outputs


@dataclass
class StepStats:
    loss: float
    accuracy: list[float]  # per TTT step: how often the draft's pick is the target's argmax


def ttt_loss(
    draft: Eagle3Draft,
    ids: torch.Tensor,  # [B, T] target ids, right-padded
    lengths: torch.Tensor,  # [B]
    features: torch.Tensor,  # [B, T, 3Ht]
    target_probs: torch.Tensor,  # [B, T, Vd] the target's softmax over the draft vocabulary (its t2d columns)
    target_best: torch.Tensor,  # [B, T] the target's argmax over its whole vocabulary (target ids)
    ttt_steps: int,
    decay: float = 0.8,
) -> tuple[torch.Tensor, StepStats]:
    """Step j at index i is scored against the target at i+j, whose logits predict x_{i+j+1}."""
    s = ids.shape[1] - 1
    index = torch.arange(s, device=ids.device)
    total = features.new_zeros(())
    weights = 0.0
    accuracy = []
    for j, a in enumerate(ttt_forward(draft, ids, features, ttt_steps), start=1):
        p = F.pad(target_probs[:, j:], (0, 0, 0, j - 1))  # [B, S, Vd]
        best = F.pad(target_best[:, j:], (0, j - 1))  # [B, S]
        valid = (index[None] + j) < lengths.to(ids.device)[:, None]  # [B, S]
        logits = draft.draft_logits(a)  # [B, S, Vd]
        log_q = F.log_softmax(logits, dim=-1)
        # as the reference: a position whose target argmax the draft cannot propose teaches nothing
        mask = valid & draft.t2d[best]
        ce = -(p * log_q).sum(-1)  # [B, S]
        total = total + decay ** (j - 1) * (ce * mask).sum() / mask.sum().clamp(min=1)
        weights += decay ** (j - 1)
        with torch.no_grad():
            picks = draft.to_target_ids(logits.argmax(-1))
            accuracy.append(float(((picks == best) & valid).sum() / valid.sum().clamp(min=1)))
    loss = total / weights
    return loss, StepStats(loss=loss.item(), accuracy=accuracy)


# -- the trainer -------------------------------------------------------------------------------------------


@dataclass
class _Batches:
    """Fixed groups of sequences with the frozen target's outputs, cached while they fit in `cache_bytes`."""

    teacher: Teacher
    sequences: list[list[int]]
    batch_size: int
    t2d: torch.Tensor
    cache_bytes: int
    _cache: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    _cached_bytes: int = 0

    def __len__(self) -> int:
        return math.ceil(len(self.sequences) / self.batch_size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        if index in self._cache:
            return self._cache[index]
        ids, lengths = pad_batch(self.sequences[index * self.batch_size : (index + 1) * self.batch_size])
        features, logits = self.teacher(ids)
        device = features.device
        # new tensors made outside inference mode, so that autograd may save them; the head trains in float32
        batch = (
            ids.to(device),
            lengths.to(device),
            features.float(),
            torch.softmax(logits[..., self.t2d.to(device)].float(), dim=-1),  # the draft proposes only these
            logits.argmax(-1).clone(),
        )
        size = sum(t.numel() * t.element_size() for t in batch)
        if self._cached_bytes + size <= self.cache_bytes:
            self._cache[index] = batch
            self._cached_bytes += size
        return batch


def train_draft(
    target_dir: str | Path,
    data: Sequence[str] | Sequence[Sequence[int]] | None,
    out_dir: str | Path,
    *,
    steps: int = 1000,
    epochs: float | None = None,
    seconds: float | None = None,
    ttt_steps: int = 4,
    lr: float = 1e-3,
    batch_size: int = 16,
    seq_len: int = 128,
    draft_vocab_size: int | None = None,
    num_sequences: int = 1024,
    self_distill: bool | None = None,
    init_from_target: bool = True,
    layer_ids: Sequence[int] | None = None,
    decay: float = 0.8,
    seed: int = 0,
    device: str = "cpu",
    target_dtype: str = "float32",
    cache_bytes: int = 2 << 30,
    progress: bool = True,
    history: list[StepStats] | None = None,
) -> Path:
    """Train an EAGLE-3 head for the target in `target_dir`; save it to `out_dir` (reference layout, no
    embed_tokens) and return that path.

    data: texts (tokenized with the target's tokenizer), token-id sequences, or None. With None, or texts and
      self_distill=True, the training sequences are `num_sequences` continuations the target writes itself
      from prompts cut from the texts (None: the standard library's sources); otherwise the data itself is
      used, with the target's distribution at every position as the label.
    Training stops after `steps` optimizer steps (`epochs` passes over the data, when given) or once the whole
    call has run `seconds`, whichever comes first; the learning rate follows a cosine over that budget.
    draft_vocab_size: the head's vocabulary, the most frequent tokens of the data (default: the target's).
    init_from_target: start norm and lm_head from the target's (see init_draft).
    target_dtype: the frozen target's dtype ("bfloat16" halves its memory on a GPU); the head trains in float32.
    history: when given, receives one StepStats per step.
    """
    started = time.monotonic()
    if ttt_steps < 1:
        raise ValueError(f"ttt_steps must be >= 1, got {ttt_steps}")
    torch.manual_seed(seed)
    teacher = Teacher(target_dir, device=device, layer_ids=layer_ids, dtype=DTYPES[target_dtype])
    texts = list(data) if data is not None and len(data) and isinstance(data[0], str) else None
    if self_distill is None:
        self_distill = data is None
    if self_distill and data is not None and texts is None:
        raise ValueError("self_distill cuts prompts from texts: give texts, or no data")
    if self_distill:
        sequences = self_distilled(teacher, num_sequences, seq_len, texts=texts, seed=seed)
    elif texts is not None:
        sequences = tokenize_texts(target_dir, texts, seq_len)
    else:
        sequences = [[int(t) for t in seq][:seq_len] for seq in data or []]
        sequences = [s for s in sequences if len(s) >= 3]
    if not sequences:
        raise ValueError("no training sequence has 3 tokens or more")
    bad = [t for s in sequences for t in s if not 0 <= t < teacher.vocab_size]
    if bad:
        raise ValueError(f"training data has token ids outside the target's vocabulary: {bad[:5]}")

    draft_vocab_size = min(draft_vocab_size or teacher.vocab_size, teacher.vocab_size)
    d2t, t2d = draft_vocabulary(sequences, teacher.vocab_size, draft_vocab_size, teacher.eos_token_ids)
    default_layers = tuple(teacher.layer_ids) == tuple(default_layer_ids(teacher.num_layers))
    config = draft_config_for(teacher.config, draft_vocab_size, None if default_layers else teacher.layer_ids)
    draft = init_draft(teacher, config, d2t, t2d, init_from_target).to(teacher.device).train()
    batches = _Batches(teacher, sequences, batch_size, t2d, cache_bytes)
    if epochs is not None:
        steps = max(1, math.ceil(epochs * len(batches)))
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, min(50, steps // 20))
    rng = random.Random(seed)
    order: list[int] = []
    train_started = time.monotonic()
    budget = None if seconds is None else max(0.0, seconds - (train_started - started))

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc="train-draft", unit="step", file=sys.stderr)
    step = 0
    while step < steps:
        elapsed = time.monotonic() - train_started
        if budget is not None and elapsed >= budget:
            break
        if not order:  # shuffle the order of the (fixed) batches once per epoch
            order = list(range(len(batches)))
            rng.shuffle(order)
        ids, lengths, features, target_probs, target_best = batches[order.pop()]
        done = max(step / steps, elapsed / budget if budget else 0.0)
        scale = min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(done, 1.0))))
        for group in optimizer.param_groups:
            group["lr"] = lr * scale
        loss, stats = ttt_loss(draft, ids, lengths, features, target_probs, target_best, ttt_steps, decay)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        if history is not None:
            history.append(stats)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{stats.loss:.3f}", acc="/".join(f"{a:.2f}" for a in stats.accuracy))
    if bar is not None:
        bar.close()
    teacher.remove()
    out = save_draft(draft.eval(), out_dir, layout=REFERENCE)
    if progress:
        print(
            f"train-draft: {step} steps on {len(sequences)} sequences in {time.monotonic() - started:.1f}s; "
            f"wrote {out}",
            file=sys.stderr,
        )
    return out


def train_tiny_draft(
    tiny_dir: str | Path, out_dir: str | Path, *, steps: int = 400, seconds: float | None = None, **kwargs
) -> Path:
    """A head for `tiny_dir/target` (laid out as tandem.tiny.make_tiny writes it), trained on the target's own
    continuations; about half a minute of two CPU cores.

    A target with random weights is only as predictable as its weights make it. make_tiny's (initializer_range
    0.15, untied) computes a next-token function no one-layer head follows: its own logit lens one layer
    before the end agrees with it half the time, and a head trained for minutes proposes the right token about
    5% of the time. tests/test_train.py re-draws it smaller and with tied embeddings, which settles into
    patterns (runs, recurring transitions) that a head learns here to a mean acceptance length above 3."""
    options = {
        "ttt_steps": 3,
        "lr": 1e-2,
        "batch_size": 16,
        "seq_len": 64,
        "num_sequences": 2048,
        "draft_vocab_size": 384,
        "progress": False,
    }
    options.update(kwargs)
    return train_draft(Path(tiny_dir) / "target", None, out_dir, steps=steps, seconds=seconds, **options)
