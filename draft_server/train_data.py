"""What the EAGLE-3 trainer (draft_server/train.py) learns from: the training sequences, the draft
vocabulary, and the batches of the frozen target's features and logits (the target: draft_server/teacher.py).
"""

from __future__ import annotations

import math
import random
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer

from draft_server.teacher import Teacher

# -- the training sequences --------------------------------------------------------------------------------


def stdlib_text(max_bytes: int = 400_000, skip: int = 0) -> str:
    """Text every machine with Python has: the standard library's sources, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.glob("*.py"))[skip:]:
        text = path.read_text(encoding="utf-8", errors="ignore")
        parts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    return "\n".join(parts)[:max_bytes]


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
    chats: Sequence[Sequence[int]] | None = None,
    sampled_fraction: float = 0.25,
    temperature: float = 0.8,
    seed: int = 0,
    batch_size: int = 256,
    progress: bool = False,
) -> list[list[int]]:
    """Sequences the target writes itself (EAGLE-3 trains on the target's own answers): greedy
    continuations, and a `sampled_fraction` of them sampled at `temperature` for variety.

    The prompts are `prompt_len` tokens cut from `texts`, or the rendered chat prompts `chats` (each
    answered once, in their order, up to `num_sequences` of them; each sequence is its prompt and at most
    seq_len tokens of answer, ending at EOS)."""
    if chats is not None:
        prompts = list(chats)[:num_sequences]
        num_sequences, new_tokens, batch_size = len(prompts), seq_len, min(batch_size, 64)
    else:
        prompts = text_prompts(teacher.target_dir, num_sequences, prompt_len, seed, texts=texts)
        new_tokens = seq_len - prompt_len
    generator = torch.Generator(device=teacher.device).manual_seed(seed)
    num_greedy = num_sequences - round(num_sequences * sampled_fraction)
    sequences: list[list[int]] = []
    bar = _bar(num_sequences, "target answers", progress)
    for start in range(0, num_sequences, batch_size):
        stop = min(start + batch_size, num_sequences)
        for lo, hi, temp in ((start, min(stop, num_greedy), 0.0), (max(start, num_greedy), stop, temperature)):
            if lo < hi:
                if chats is not None:
                    sequences.extend(teacher.answer(prompts[lo:hi], new_tokens, temp, generator))
                else:
                    sequences.extend(teacher.continue_sequences(prompts[lo:hi], new_tokens, temp, generator).tolist())
                if bar is not None:
                    bar.update(hi - lo)
    if bar is not None:
        bar.close()
    return sequences


def _bar(total: int, desc: str, progress: bool, unit: str = "seq"):
    if not progress:
        return None
    import sys

    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)


def chat_prompts(target_dir: str | Path, conversations: Sequence[Sequence[dict]]) -> list[list[int]]:
    """Conversations (OpenAI-style messages, the last one the user's) rendered with the target's chat
    template, ready for the answer -> token ids."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    if not tokenizer.chat_template:
        raise ValueError(f"{target_dir} has no chat template: train on texts instead of chats")
    return [list(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                               return_dict=False)) for messages in conversations]


def training_sequences(
    teacher: Teacher,
    data: Sequence[str] | Sequence[Sequence[int]] | None,
    *,
    self_distill: bool | None,
    num_sequences: int,
    seq_len: int,
    seed: int,
    chats: Sequence[Sequence[dict]] | None = None,
    progress: bool = False,
) -> list[list[int]]:
    """The sequences train_draft learns from (its docstring says which data gives which)."""
    if chats is not None:
        if data is not None:
            raise ValueError("give chats or data, not both")
        return self_distilled(teacher, num_sequences, seq_len, chats=chat_prompts(teacher.target_dir, chats),
                              seed=seed, progress=progress)
    texts = list(data) if data is not None and len(data) and isinstance(data[0], str) else None
    if self_distill is None:
        self_distill = data is None
    if self_distill and data is not None and texts is None:
        raise ValueError("self_distill cuts prompts from texts: give texts, or no data")
    if self_distill:
        sequences = self_distilled(teacher, num_sequences, seq_len, texts=texts, seed=seed, progress=progress)
    elif texts is not None:
        sequences = tokenize_texts(teacher.target_dir, texts, seq_len)
    else:
        sequences = [[int(t) for t in seq][:seq_len] for seq in data or []]
        sequences = [s for s in sequences if len(s) >= 3]
    if not sequences:
        raise ValueError("no training sequence has 3 tokens or more")
    bad = [t for s in sequences for t in s if not 0 <= t < teacher.vocab_size]
    if bad:
        raise ValueError(f"training data has token ids outside the target's vocabulary: {bad[:5]}")
    return sequences


# -- the draft vocabulary ----------------------------------------------------------------------------------


def draft_vocab_from_counts(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The most frequent target ids -> (d2t offsets [draft_vocab], t2d mask [vocab])."""
    keep = torch.sort(torch.topk(counts.float(), draft_vocab_size).indices).values  # target ids, ascending
    d2t = keep - torch.arange(draft_vocab_size)
    t2d = torch.zeros(counts.numel(), dtype=torch.bool)
    t2d[keep] = True
    return d2t, t2d


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


# -- batches -----------------------------------------------------------------------------------------------


def pad_batch(sequences: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ids [B, T] right-padded with 0, lengths [B]. Right padding is harmless: causal attention keeps the
    real positions from seeing it, and the loss masks it."""
    lengths = torch.tensor([len(s) for s in sequences])
    ids = torch.zeros(len(sequences), int(lengths.max()), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.as_tensor(seq)
    return ids, lengths


@dataclass
class Batches:
    """Fixed groups of sequences with the frozen target's outputs, computed once (`fill`, or on first use)
    and cached while they fit in `cache_bytes`, so that epochs after the first cost the head only.

    The cache keeps, per batch, the features and the final hidden state in the target's dtype and the
    target's argmax; the softmax over the draft vocabulary is hidden @ its output rows at use, which keeps a
    token's entry at (3 + 1) x Ht values instead of 3 x Ht + Vd.

    Each batch: ids [B, T], lengths [B], features [B, T, 3Ht] (float32), the target's softmax over the draft
    vocabulary [B, T, Vd], and its argmax over the whole vocabulary [B, T] (target ids)."""

    teacher: Teacher
    sequences: list[list[int]]
    batch_size: int
    t2d: torch.Tensor
    cache_bytes: int
    _cache: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    _cached_bytes: int = 0
    _rows: torch.Tensor | None = None

    def __len__(self) -> int:
        return math.ceil(len(self.sequences) / self.batch_size)

    def fill(self, progress: bool = False) -> int:
        """Run the target over every batch that fits in the cache, now -> how many are cached."""
        bar = _bar(len(self), "target features", progress, unit="batch")
        for index in range(len(self)):
            if self._stored(index) is None:
                break
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return len(self._cache)

    def _stored(self, index: int) -> tuple[torch.Tensor, ...] | None:
        if index in self._cache:
            return self._cache[index]
        ids, lengths = pad_batch(self.sequences[index * self.batch_size : (index + 1) * self.batch_size])
        features, hidden, best = self.teacher.outputs(ids)
        # new tensors made outside inference mode, so that autograd may save them
        stored = (ids.to(features.device), lengths.to(features.device), features.clone(), hidden.clone(),
                  best.clone())
        size = sum(t.numel() * t.element_size() for t in stored)
        if self._cached_bytes + size > self.cache_bytes:
            self._uncached = stored
            return None
        self._cache[index] = stored
        self._cached_bytes += size
        return stored

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        stored = self._stored(index)
        if stored is None:
            stored, self._uncached = self._uncached, None
        ids, lengths, features, hidden, best = stored
        if self._rows is None:
            self._rows = self.teacher.output_rows(self.t2d)
        # the head trains in float32; the draft proposes only the t2d tokens
        probs = torch.softmax(hidden.float() @ self._rows.T, dim=-1)
        return ids, lengths, features.float(), probs, best


# -- the target's answers to chat prompts, kept on disk ----------------------------------------------------


def answer_prompts(
    teacher: Teacher,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    *,
    batch_size: int = 32,
    sampled_every: int = 4,
    temperature: float = 0.8,
    seed: int = 0,
    cache: str | Path | None = None,
    progress: bool = False,
) -> list[list[int]]:
    """The target's own answers to rendered chat prompts (EAGLE-3 trains on them): each prompt followed by
    at most `new_tokens` tokens of answer, ending at EOS.

    The prompts go in fixed batches of `batch_size`, in their order; every `sampled_every`-th batch is sampled
    at `temperature` (seeded by its number), the others are greedy, so the first n batches come out the same
    whatever the number asked for. With `cache` (a JSONL file) each batch is appended as it is done and a
    later call with the same arguments starts after the batches already there."""
    import json

    prompts = [list(map(int, p)) for p in prompts]
    done: list[list[int]] = []
    path = Path(cache) if cache is not None else None
    if path is not None and path.is_file():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if len(done) < len(prompts) and row["prompt"] == prompts[len(done)]:
                done.append(row["ids"])
            else:
                raise ValueError(f"{path} holds answers to other prompts: remove it, or give the same ones")
        done = done[: len(done) - len(done) % batch_size] if len(done) < len(prompts) else done
    bar = _bar(len(prompts), "target answers", progress)
    if bar is not None:
        bar.update(len(done))
    for start in range(len(done), len(prompts), batch_size):
        number = start // batch_size
        sampled = sampled_every > 0 and number % sampled_every == sampled_every - 1
        generator = torch.Generator(device=teacher.device).manual_seed(seed * 100_003 + number)
        batch = prompts[start : start + batch_size]
        answers = teacher.answer(batch, new_tokens, temperature if sampled else 0.0, generator)
        done.extend(answers)
        if path is not None:
            with open(path, "a") as out:
                out.write("".join(json.dumps({"prompt": p, "ids": a}) + "\n" for p, a in zip(batch, answers)))
        if bar is not None:
            bar.update(len(batch))
    if bar is not None:
        bar.close()
    return done
