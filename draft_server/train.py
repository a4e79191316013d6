"""Training an EAGLE-3 head for a local Hugging Face target, with training-time test (TTT) as in EAGLE-3.

The frozen target gives, for a training sequence x_0..x_{T-1}, the captured features F_i [3Ht] and the
logits L_i, which predict x_{i+1} (draft_server/teacher.py: the teacher; train_data.py: the sequences, the batches).

TTT step 1 is DraftEngine.propose's extend: index i holds (fc(F_i), x_{i+1}) at RoPE position i, attends
causally, and predicts the target at i+1 (L_{i+1}). Step j > 1 is rollout step j of a round whose last
committed pair is index i: it feeds (a^{j-1}_i, x_{i+j}) at position i+j-1, where a^{j-1}_i is the previous
step's pre-norm output at the same index, and predicts L_{i+j}. Its query sees the step-1 keys of indices
<= i (the committed KV) and, of each rollout step 2..j, only the key at index i (that round's rollout KV):
the reference's diagonal mask, and exactly what propose computes at inference. Every step is one call of
the draft's own forward (draft_server/model.py), with that mask.

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
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from draft_server.checkpoint import REFERENCE, save_draft
from draft_server.model import DraftKV, Eagle3Config, Eagle3Draft
from draft_server.teacher import Teacher
from draft_server.train_data import Batches, draft_vocabulary, training_sequences
from tandem.dtypes import TORCH_DTYPES

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
    kv = DraftKV()  # [committed | step 2 | ... | step j], S keys each
    a = draft(draft.fuse(features[:, :s]), ids[:, 1:], index[None].expand(b, s), kv)  # causal extend
    outputs = [a]
    causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
    own = torch.eye(s, dtype=torch.bool, device=ids.device)  # a rollout step's key at the query's own index
    for j in range(2, ttt_steps + 1):
        tokens = F.pad(ids[:, j:], (0, j - 1))  # [B, S]: x_{i+j}
        mask = torch.cat([causal, *[own] * (j - 1)], dim=1)  # [S, j*S]
        a = draft(a, tokens, (index + j - 1)[None].expand(b, s), kv, attn_mask=mask)
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
    chats: Sequence[Sequence[dict]] | None = None,
    init_from_target: bool = True,
    aux_layer_ids: Sequence[int] | None = None,
    decay: float = 0.8,
    seed: int = 0,
    device: str = "cpu",
    target_dtype: str = "float32",
    head_dtype: str = "float32",
    cache_bytes: int = 2 << 30,
    progress: bool = True,
    history: list[StepStats] | None = None,
    parallel=None,
) -> Path:
    """Train an EAGLE-3 head for the target in `target_dir`; save it to `out_dir` (reference layout, no
    embed_tokens) and return that path.

    data: texts (tokenized with the target's tokenizer), token-id sequences, or None. With None, or texts and
      self_distill=True, the training sequences are `num_sequences` continuations the target writes itself
      from prompts cut from the texts (None: the standard library's sources); otherwise the data itself is
      used, with the target's distribution at every position as the label.
    chats: conversations (OpenAI-style message lists) in place of data: each rendered with the target's chat
      template and answered by the target (at most `num_sequences` of them, answers up to `seq_len` tokens).
    Training stops after `steps` optimizer steps (`epochs` passes over the data, when given) or once the whole
    call has run `seconds`, whichever comes first; the learning rate follows a cosine over that budget.
    draft_vocab_size: the head's vocabulary, the most frequent tokens of the data (default: the target's).
    init_from_target: start norm and lm_head from the target's (see init_draft).
    aux_layer_ids: the target layers whose features the head fuses (default: EAGLE-3's for the target's depth).
    target_dtype: the frozen target's dtype ("bfloat16" halves its memory on a GPU, and is several times faster
      on a CPU with AVX512-BF16); the target's features are cached in it.
    head_dtype: the head's weights and optimizer are float32; "bfloat16" computes its forward and backward
      under autocast.
    history: when given, receives one StepStats per step.
    parallel: a draft_server.train_parallel.ParallelDrafting: train a P-EAGLE head (all drafts in one forward,
      COD sampling) instead of TTT; ttt_steps and decay are then unused.
    """
    started = time.monotonic()
    if ttt_steps < 1:
        raise ValueError(f"ttt_steps must be >= 1, got {ttt_steps}")
    torch.manual_seed(seed)
    teacher = Teacher(target_dir, device=device, aux_layer_ids=aux_layer_ids, dtype=TORCH_DTYPES[target_dtype])
    sequences = training_sequences(
        teacher, data, self_distill=self_distill, num_sequences=num_sequences, seq_len=seq_len, seed=seed,
        chats=chats, progress=progress,
    )
    draft_vocab_size = min(draft_vocab_size or teacher.vocab_size, teacher.vocab_size)
    d2t, t2d = draft_vocabulary(sequences, teacher.vocab_size, draft_vocab_size, teacher.eos_token_ids)
    # the head names the hidden states it was trained on, so that any server captures those (save_draft
    # records their convention)
    config = draft_config_for(teacher.config, draft_vocab_size, teacher.aux_layer_ids)
    if parallel is not None:
        config = parallel.head_config(config, teacher.config)
    draft = init_draft(teacher, config, d2t, t2d, init_from_target).to(teacher.device).train()
    batches = Batches(teacher, sequences, batch_size, t2d, cache_bytes)
    batches.fill(progress)
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
        with torch.autocast(teacher.device.type, dtype=TORCH_DTYPES[head_dtype], enabled=head_dtype != "float32"):
            if parallel is not None:
                loss, stats = parallel.loss(draft, ids, lengths, features, target_probs, target_best)
            else:
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
    """A head for `tiny_dir/target` (laid out as tandem_tools/tiny.py writes it), trained on the target's own
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
