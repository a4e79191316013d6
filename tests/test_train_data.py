"""What the trainer learns from (draft_server/train_data.py): the target's answers kept on disk, and the
cache of the target's features and logits; and that the same training run gives the same head."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from draft_server.teacher import Teacher
from draft_server.train import train_draft
from draft_server.train_data import Batches, answer_prompts, draft_vocabulary

PROMPTS = [[5, 6, 7], list(range(10, 22)), [40, 41], [3, 4, 5, 6], [9, 9, 9], [30, 31, 32, 33, 34]]


def test_answers_come_out_the_same_in_batches_and_resume_from_their_file(tiny_dir, tmp_path):
    teacher = Teacher(tiny_dir / "target")
    try:
        whole = answer_prompts(teacher, PROMPTS, 6, batch_size=2, sampled_every=2, seed=3)
        for prompt, sequence in zip(PROMPTS, whole):
            assert sequence[: len(prompt)] == prompt and len(prompt) < len(sequence) <= len(prompt) + 6
        # the greedy batches (0 and 2) are each prompt's greedy answer; batch 1 is sampled
        assert whole[:2] == teacher.answer(PROMPTS[:2], 6) and whole[4:] == teacher.answer(PROMPTS[4:], 6)
        # the first batches do not depend on how many are asked for
        assert answer_prompts(teacher, PROMPTS[:4], 6, batch_size=2, sampled_every=2, seed=3) == whole[:4]

        cache = tmp_path / "answers.jsonl"
        assert answer_prompts(teacher, PROMPTS[:4], 6, batch_size=2, sampled_every=2, seed=3, cache=cache) == whole[:4]
        assert len(cache.read_text().splitlines()) == 4
        # a later call goes on from the file: its answers are read back, the rest computed
        assert answer_prompts(teacher, PROMPTS, 6, batch_size=2, sampled_every=2, seed=3, cache=cache) == whole
        assert len(cache.read_text().splitlines()) == 6
        try:
            answer_prompts(teacher, PROMPTS[::-1], 6, batch_size=2, cache=cache)
        except ValueError as exc:
            assert "answers to other prompts" in str(exc)
        else:
            raise AssertionError("a cache of other prompts was used")
    finally:
        teacher.remove()


def test_cached_batches_give_the_targets_own_softmax_over_the_draft_vocabulary(tiny_dir):
    """The cache keeps the final hidden state, not the logits: hidden @ the draft vocabulary's output rows is
    the target's own logits of those tokens."""
    teacher = Teacher(tiny_dir / "target")
    try:
        sequences = [p + [1, 2, 3] for p in PROMPTS]
        _, t2d = draft_vocabulary(sequences, teacher.vocab_size, 64)
        batches = Batches(teacher, sequences, 4, t2d, cache_bytes=1 << 30)
        assert batches.fill() == len(batches) == 2
        for index in range(len(batches)):
            ids, _lengths, features, probs, best = batches[index]
            want_features, logits = teacher(ids)
            torch.testing.assert_close(features, want_features.float())
            torch.testing.assert_close(probs, torch.softmax(logits[..., t2d], dim=-1), atol=1e-5, rtol=1e-4)
            assert torch.equal(best, logits.argmax(-1))
        # with no room in the cache every batch is computed again, and is the same
        uncached = Batches(teacher, sequences, 4, t2d, cache_bytes=0)
        assert uncached.fill() == 0
        for a, b in zip(uncached[1], batches[1]):
            torch.testing.assert_close(a, b)
    finally:
        teacher.remove()


def test_the_same_training_run_gives_the_same_head(tiny_dir, tmp_path):
    """Steps decide a head, not time: two runs with the same data and settings write the same weights,
    bfloat16 target and autocast included."""
    data = [p * 4 for p in PROMPTS]
    heads = []
    for run in range(2):
        out = train_draft(tiny_dir / "target", data, tmp_path / f"head{run}", steps=3, batch_size=2, seq_len=16,
                          draft_vocab_size=64, ttt_steps=2, target_dtype="bfloat16", head_dtype="bfloat16",
                          progress=False)
        heads.append(load_file(out / "model.safetensors"))
    assert heads[0].keys() == heads[1].keys()
    for name in heads[0]:
        assert torch.equal(heads[0][name], heads[1][name]), name
