"""Which tokens each position of a generation may take: structured outputs (a JSON schema, JSON, a regex, a
choice, a grammar) and min_tokens, as one bitmask per position the target scores.

The round loop (tandem/rounds.py) keeps one `Constraint` per generation and advances it on the committed
tokens, so the matcher runs where the loop runs: in the coordinator for the services (it has the
tokenizer, sees every draft before the target does, and costs the target nothing but a mask), in-process
for `run_rounds`. For each verify it walks the drafts: the row of t is what the committed text allows next,
the row of d_j what t, d_1..d_j allow; a draft its row forbids ends the chain there, before the verify
(the target would reject it with certainty: its p is 0 under the mask). The walk is then rolled back; the
tokens the target commits are consumed after it. The target applies the rows in one op per batch
(target_server/logits.py): every distribution it accepts or samples from is the masked one, so what is
committed is exactly what the target alone would commit under the same constraint, greedy or sampled.

A mask row is ceil(V / 32) little-endian uint32 words over the target's vocabulary V, bit i of the row
set where token i is allowed (llguidance's layout). The grammar engine is llguidance (Earley parsing over
the tokenizer's token trie, lazily: a grammar is parsed once per request at a few milliseconds, and its
compiled form is cached here, keyed by the grammar's text).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence


class _Numpy:
    """numpy, imported at a grammar's first use: the coordinator starts without loading it."""

    def __getattr__(self, name: str):
        import numpy

        return getattr(numpy, name)


np = _Numpy()

from tandem.errors import InvalidRequest
from tandem.params import GrammarSpec

GRAMMAR_CACHE = 256  # compiled grammars kept per tokenizer (a client's schema comes back request after request)

# JSON as json.dumps writes it: flexible whitespace lets a weak model emit blanks until max_tokens
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    import llguidance

    return llguidance


def grammar_text(spec: GrammarSpec) -> str:
    """The spec as an llguidance grammar; InvalidRequest naming what is wrong with a schema or choice list."""
    llg = _llguidance()
    if spec.kind in ("json_schema", "json_object"):
        if spec.kind == "json_object" and not spec.value:
            schema: object = {"type": "object"}
        else:
            try:
                schema = json.loads(spec.value)
            except json.JSONDecodeError as exc:
                raise InvalidRequest(f"the JSON schema is not JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequest(f"a JSON schema is an object, got {type(schema).__name__}")
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        try:
            choices = json.loads(spec.value)
        except json.JSONDecodeError:
            choices = None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequest("a choice is a non-empty list of non-empty strings")
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    from llguidance.gbnf_to_lark import any_to_lark

    try:  # GBNF (llama.cpp's, xgrammar's EBNF, vLLM's guided_grammar) becomes Lark; Lark stays as it is
        text = any_to_lark(spec.value)
    except Exception as exc:  # noqa: BLE001 - its message names the problem
        raise InvalidRequest(f"the grammar is not valid GBNF or Lark: {exc}") from None
    return llg.LLMatcher.grammar_from_lark(text)


class Grammars:
    """One tokenizer's grammars, each compiled once (`matcher` copies a cached one). `tokenizer_json`: the
    tokenizer as tokenizer.json holds it; `vocab_size`: the target's (mask rows cover all of it); `eos_ids`:
    what ends a generation where the grammar is complete."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]):
        llg = _llguidance()
        self.vocab_size = vocab_size
        self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids) or None)
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, spec: GrammarSpec):
        """A fresh matcher at the start of `spec`; InvalidRequest naming what is wrong with it."""
        key = (spec.kind, spec.value)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled.deep_copy()
        llg = _llguidance()
        matcher = llg.LLMatcher(self.tokenizer, grammar_text(spec), log_level=0)
        if matcher.is_error():
            what = {"json_schema": "JSON schema", "json_object": "JSON schema", "regex": "regex",
                    "choice": "choice", "grammar": "grammar"}[spec.kind]
            raise InvalidRequest(f"the {what} cannot be used: {matcher.get_error().strip()}")
        with self._lock:
            self._compiled[key] = matcher.deep_copy()
            while len(self._compiled) > GRAMMAR_CACHE:
                self._compiled.popitem(last=False)
        return matcher


def words(vocab_size: int) -> int:
    """uint32 words in one mask row."""
    return (vocab_size + 31) // 32


class Constraint:
    """One generation's masks: a grammar's matcher (None: none) and min_tokens over its stop ids. State:
    the committed tokens so far (`commit`); `rows` gives the mask of each position a step scores."""

    def __init__(self, matcher, vocab_size: int, stop_ids: Sequence[int], min_tokens: int = 0):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.stop_ids = np.asarray(sorted(stop_ids), dtype=np.int64)
        self.min_tokens = min_tokens
        self.produced = 0
        self.seconds = 0.0  # spent computing masks (the profile's grammar share)
        full = np.full(words(vocab_size) * 32, 1, dtype=np.uint8)
        full[vocab_size:] = 0
        self._full = np.packbits(full, bitorder="little").view(np.uint32)

    @property
    def active(self) -> bool:
        """Whether the next positions are masked at all (a min_tokens alone stops masking once met)."""
        return self.matcher is not None or self.produced < self.min_tokens

    def _row(self, produced: int) -> np.ndarray:
        """The mask after the matcher's current state, the `produced`-th token next."""
        if self.matcher is not None:
            # llguidance's row may carry a spare word past the vocabulary
            row = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint32)[: self._full.size].copy()
            if self.matcher.is_accepting():  # the grammar is complete: every stop id may end it
                _set(row, self.stop_ids, True)
        else:
            row = self._full.copy()
        if produced < self.min_tokens:
            _set(row, self.stop_ids, False)
        return row

    def first(self) -> bytes | None:
        """The mask of the prefill's token (t = x_n), or None: nothing masked."""
        if not self.active:
            return None
        return self._row(self.produced).tobytes()

    def chain(self, drafts: Sequence[int], room: int = 0) -> tuple[int, list[int], bytes | None]:
        """A verify of t (committed) and `drafts` -> (how many drafts to keep: those before the first one its
        row forbids, up to a stop id; the tokens the grammar forces after them, at most `room`: where a row allows one token
        only, that token is the draft, as the argmax of the draft's q masked by the row would be, and the
        target takes it with certainty; the rows of t, the kept and the forced drafts, or None: nothing
        masked)."""
        if not self.active:
            return len(drafts), [], None
        started = time.perf_counter()
        rows = [self._row(self.produced)]
        kept, forced, consumed = 0, [], 0
        for d in drafts:
            if not _allowed(rows[-1], d):
                break
            if d in self.stop_ids:  # the end, if accepted: nothing after it counts (nor is the matcher walked past it)
                kept += 1
                rows.append(rows[-1])
                break
            if self.matcher is not None and not self.matcher.consume_token(d):
                break
            kept += 1
            consumed += 1
            rows.append(self._row(self.produced + kept))
        while self.matcher is not None and kept == consumed and len(forced) < room - kept \
                and (only := _single(rows[-1])) is not None and only not in self.stop_ids \
                and self.matcher.consume_token(only):
            forced.append(only)
            consumed += 1
            rows.append(self._row(self.produced + kept + len(forced)))
        if self.matcher is not None and consumed:
            self.matcher.rollback(consumed)
        self.seconds += time.perf_counter() - started
        return kept, forced, np.stack(rows).tobytes()

    def tree(self, drafts: Sequence[int], parents: Sequence[int]) -> bytes | None:
        """A verify of t and a draft tree (Drafts.parents) -> each node's row (t's first). A node its parent's
        row forbids is never accepted (its p is 0), so its row, and its subtree's, repeat the parent's; so do a
        stop id's (nothing after the end counts)."""
        if not self.active:
            return None
        started = time.perf_counter()
        rows = [self._row(self.produced)]
        paths: list[list[int]] = [[]]  # per node, the drafts' indices from the root to it ([] for t)
        alive = [True]
        path: list[int] = []  # the drafts the matcher has consumed
        for i, parent in enumerate(parents):
            up = parent + 1
            # a node its row forbids is never accepted; one that is a stop id ends its path: either way no
            # row below it counts, and the matcher is not walked into it
            if not alive[up] or not _allowed(rows[up], drafts[i]) or drafts[i] in self.stop_ids:
                rows.append(rows[up])
                paths.append(paths[up])
                alive.append(False)
                continue
            want = [*paths[up], i]
            if self.matcher is not None:
                common = 0
                while common < min(len(path), len(want)) and path[common] == want[common]:
                    common += 1
                if len(path) > common:
                    self.matcher.rollback(len(path) - common)
                for j in want[common:]:
                    self.matcher.consume_token(drafts[j])
            path = want
            alive.append(True)
            paths.append(want)
            rows.append(self._row(self.produced + len(want)))
        if self.matcher is not None and path:
            self.matcher.rollback(len(path))
        self.seconds += time.perf_counter() - started
        return np.stack(rows).tobytes()

    def walk(self) -> Walk:
        """The rows along a rollout's drafts from the committed text (the draft picks each from its q masked
        by them); the caller closes it."""
        return Walk(self)

    def commit(self, tokens: Sequence[int], stop_ids: Sequence[int] = ()) -> None:
        """Tokens the target committed, in order (each allowed by its row). A stop id the grammar does not
        take is not consumed: it ends the generation."""
        for token in tokens:
            self.produced += 1
            if self.matcher is not None and not (token in stop_ids and not _allowed_by(self.matcher, token)):
                self.matcher.consume_token(token)


class Walk:
    """A draft rollout's path through the grammar from the committed text: `row()` is the mask of the next
    position, `take(d)` follows the draft picked there. A draft the row forbids (one outside the draft's
    vocabulary where the row allows none inside it) ends the walk: the round loop cuts the chain there
    anyway. `close()` rolls the matcher back to the committed text."""

    def __init__(self, constraint: Constraint):
        self.constraint = constraint
        self.taken = 0
        self.ended = False
        self._row: np.ndarray | None = None

    def row(self) -> np.ndarray | None:
        """The next position's row, or None once the walk ended."""
        if self.ended:
            return None
        c = self.constraint
        started = time.perf_counter()
        self._row = c._row(c.produced + self.taken)
        c.seconds += time.perf_counter() - started
        return self._row

    def take(self, token: int) -> None:
        if self.ended:
            return
        matcher = self.constraint.matcher
        if self._row is None or not _allowed(self._row, token) or token in self.constraint.stop_ids or (
                matcher is not None and not matcher.consume_token(token)):
            self.ended = True  # forbidden (cut there), or the end: no draft after it counts
            return
        self.taken += 1

    def close(self) -> None:
        if self.constraint.matcher is not None and self.taken:
            self.constraint.matcher.rollback(self.taken)
        self.taken, self.ended = 0, True


def allowed_among(row: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Which of the token ids `ids` (int64) a row allows -> bool, as `ids`' shape."""
    return ((row[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).astype(bool)


def _allowed(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def _single(row: np.ndarray) -> int | None:
    """The one token a row allows, or None (none or several)."""
    nonzero = np.flatnonzero(row)
    if nonzero.size != 1:
        return None
    word = int(row[nonzero[0]])
    if word & (word - 1):
        return None
    return int(nonzero[0]) * 32 + word.bit_length() - 1


def _allowed_by(matcher, token: int) -> bool:
    return _allowed(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32), token)


def _set(row: np.ndarray, ids: np.ndarray, value: bool) -> None:
    if not ids.size:
        return
    ids = ids[ids < row.size * 32]
    bits = (np.uint32(1) << (ids & 31).astype(np.uint32))
    for word, bit in zip((ids >> 5).tolist(), bits.tolist(), strict=True):
        row[word] = (row[word] | bit) if value else (row[word] & ~np.uint32(bit))


def unpack_rows(data: bytes, vocab_size: int) -> np.ndarray:
    """Mask rows as bytes -> bool [rows, vocab_size] (numpy; the target unpacks with torch)."""
    width = words(vocab_size)
    flat = np.frombuffer(data, dtype=np.uint8).reshape(-1, width * 4)
    return np.unpackbits(flat, axis=1, bitorder="little")[:, :vocab_size].astype(bool)
