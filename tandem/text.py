"""Text for the coordinator: incremental detokenization and stop strings, with the `tokenizers`
library only (no transformers, no torch).

Byte-level BPE splits a multi-byte character over several tokens, so the text of a prefix of the
output may end in half a character, which decodes to U+FFFD. The detokenizer holds such deltas
back until the character is complete; the concatenated deltas equal the text of the whole output.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

from tandem.errors import OutOfRange
from tandem.protocol import TokenLogprob
from tandem.rounds import RoundEvent
from tandem.stats import GenerationStats

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Token ids in, text deltas out; never a delta that ends in a partial character.

    The window (prefix, read) is the last emitted stretch: decoding from `prefix` rather than from
    `read` keeps the context some decoders need (SentencePiece drops the space of a leading token).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids up to here have been emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, ids: Sequence[int]) -> str:
        self.ids.extend(ids)
        return self._delta(final=False)

    def flush(self) -> str:
        """The held-back rest at the end of the output (may contain U+FFFD if the bytes never completed)."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if not final and (after.endswith(REPLACEMENT) or not after.startswith(before)):
            return ""  # half a character (or a decoder that rewrote the window): wait for more tokens
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]


@dataclass
class TextDelta:
    """What one round adds: token ids, their text, and on the last delta the finish reason and stats."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them


def _find_stop(text: str, stop: Sequence[str], include: bool = False) -> int:
    """Where the text ends at its first stop string: before it, or after it with `include`; -1: none in it."""
    hits = [(i, s) for s in stop if (i := text.find(s)) >= 0]
    if not hits:
        return -1
    at, first = min(hits, key=lambda hit: hit[0])
    return at + len(first) if include else at


def text_deltas(
    events: Iterator[RoundEvent], tokenizer: Tokenizer | None, stop: Sequence[str] = (), include_stop: bool = False,
    skip_special_tokens: bool = True,
) -> Iterator[TextDelta]:
    """Round events -> token and text deltas.

    A stop string ends the generation: the text is cut before it (after it with `include_stop`, vLLM's
    include_stop_str_in_output), the token ids after the token that completed it, and finish_reason is
    "stop". Text that could be the start of a stop string is held back until it is not. Ends the events
    iterator (which releases the sessions) on finishing.

    With special tokens in the text (`skip_special_tokens` False), the EOS or stop token that ended the
    generation is not, unless `include_stop`: vLLM's rule.
    """
    stop = [s for s in stop if s]
    if stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer; the target has none")
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens) if tokenizer is not None else None
    hide_stop_token = not skip_special_tokens and not include_stop
    hold = max((len(s) for s in stop), default=1) - 1  # a partial stop string is at most this long
    pending = ""  # decoded, not yet emitted; never contains a whole stop string
    try:
        for event in events:
            finish = event.finish_reason
            token_ids: list[int] = []
            shown = len(event.new_tokens) - (finish == "stop" and hide_stop_token)
            for n, token in enumerate(event.new_tokens):
                token_ids.append(token)
                if detokenizer is None or n >= shown:
                    continue
                pending += detokenizer.add([token])
                if stop and (cut := _find_stop(pending, stop, include_stop)) >= 0:
                    pending, finish = pending[:cut], "stop"
                    break
            else:
                if finish is not None and detokenizer is not None:
                    pending += detokenizer.flush()
                    if stop and (cut := _find_stop(pending, stop, include_stop)) >= 0:
                        pending, finish = pending[:cut], "stop"
            logprobs = event.logprobs[: len(token_ids)] if event.logprobs is not None else None
            if finish is not None:
                yield TextDelta(token_ids, pending, finish, event.stats, logprobs)
                return
            emit = max(0, len(pending) - hold)
            text, pending = pending[:emit], pending[emit:]
            yield TextDelta(token_ids, text, None, None, logprobs)
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()


# A prompt's text is tokenized before its length can be checked against the context, and tokenizing is
# linear in the text: a prompt of a few MiB kept the coordinator busy for seconds before it was refused. No
# real prompt averages this many characters a token (English text is about 4), so past context * this
# many characters a prefix of that length alone decides.
MAX_CHARS_PER_TOKEN = 64


def encode_within(tokenizer: Tokenizer, text: str, max_tokens: int, add_special_tokens: bool = True) -> list[int]:
    """`text`'s ids; OutOfRange, after tokenizing a bounded prefix only, when they cannot fit `max_tokens`."""
    limit = max_tokens * MAX_CHARS_PER_TOKEN
    if len(text) > limit:
        head = len(tokenizer.encode(text[:limit], add_special_tokens=add_special_tokens).ids)
        if head >= max_tokens:
            raise OutOfRange(f"the prompt has {len(text)} characters, and its first {limit} are already {head} "
                             f"tokens; the model's context is {max_tokens} tokens")
    return tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
