"""Incremental detokenization and stop strings (coordinator/text.py), on the tiny byte-level tokenizer."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from tandem.rounds import RoundEvent
from tandem.stats import GenerationStats
from tandem.text import IncrementalDetokenizer, text_deltas


@pytest.fixture(scope="module")
def tokenizer(tiny_dir) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_dir / "target" / "tokenizer.json"))


def events(ids: list[int], per_round: int = 3, finish: str = "length"):
    """What run_rounds yields for `ids`, `per_round` tokens at a time; records whether it was closed."""
    stats = GenerationStats(num_rounds=1)
    chunks = [ids[i : i + per_round] for i in range(0, len(ids), per_round)]
    for i, chunk in enumerate(chunks):
        yield RoundEvent(chunk, stats, finish if i == len(chunks) - 1 else None)


def test_multibyte_characters_are_never_split(tokenizer):
    text = "héllo wörld ✓ 日本語 🎉 naïve"
    ids = tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert deltas.count("") > 0  # some tokens carried half a character and were held back


def test_deltas_concatenate_to_the_whole_decode_for_random_ids(tokenizer):
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = torch.randint(0, tokenizer.get_vocab_size(), (60,), generator=g).tolist()
        detok = IncrementalDetokenizer(tokenizer)
        deltas = [detok.add(ids[i : i + 2]) for i in range(0, len(ids), 2)] + [detok.flush()]
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
        assert not any(d.endswith("\ufffd") for d in deltas[:-1])


def test_stop_string_cuts_text_and_tokens(tokenizer):
    text = "def main():\n    return 1\n\nprint(main())"
    ids = tokenizer.encode(text).ids
    deltas = list(text_deltas(events(ids), tokenizer, stop=["\n\n"]))
    assert "".join(d.text for d in deltas) == "def main():\n    return 1"
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stats is not None
    got = [t for d in deltas for t in d.token_ids]
    assert got == ids[: len(got)] and len(got) < len(ids)
    assert "\n\n" in tokenizer.decode(got) and "\n\n" not in tokenizer.decode(got[:-1])


def test_text_that_may_start_a_stop_string_is_held_back(tokenizer):
    ids = tokenizer.encode("ab STO and more STOP tail").ids
    deltas = list(text_deltas(events(ids, per_round=1), tokenizer, stop=["STOP"]))
    emitted = ""
    for d in deltas[:-1]:
        emitted += d.text
        assert "STOP" not in emitted
    assert "".join(d.text for d in deltas) == "ab STO and more "
    assert deltas[-1].finish_reason == "stop"


def test_without_a_stop_the_finish_reason_and_text_pass_through(tokenizer):
    ids = tokenizer.encode("plain text, no stop").ids
    deltas = list(text_deltas(events(ids), tokenizer, stop=["zzz"]))
    assert "".join(d.text for d in deltas) == "plain text, no stop"
    assert deltas[-1].finish_reason == "length"


def test_finishing_closes_the_round_loop(tokenizer):
    closed = []

    def loop():
        try:
            yield from events(tokenizer.encode("one two three four five").ids, per_round=1)
        finally:
            closed.append(True)

    deltas = list(text_deltas(loop(), tokenizer, stop=[" three"]))
    assert "".join(d.text for d in deltas) == "one two"
    assert closed == [True]


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        list(text_deltas(events([1, 2, 3]), None, stop=["x"]))
