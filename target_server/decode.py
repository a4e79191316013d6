"""Target-only decoding of several tokens a call (Verify.decode): the target's batches make a session's next
token from its last without a round trip through the coordinator.

A target-only round is one token: through the services, at 16 demo sessions, the target's batch took 4.3 ms of
an 8.5 ms round and the rest was the round trip (relay, coordinator, gRPC). Decoding n tokens a call pays that
once per n. Each token is still one step of the target's batcher, batched with every other session's steps,
with the session's own sampling: the output is what n plain target-only rounds give. The coordinator asks for
it only where nothing drafts (tandem/rounds.py) and no further than the generation's limit; it stops after a
stop id, and the coordinator's stopper cuts there as before. It also answers once ANSWER_WITHIN_S have passed,
whatever it has by then: where a token takes long (SmolLM2-135M on this CPU: ~40 ms) a client streaming the
answer gets its tokens as often as before, and where tokens are fast the round trip is paid once per many.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from tandem.protocol import VerifyResult
from tandem.sessions import InvalidRequest, SessionNotFound

MAX_DECODE = 64  # tokens a call
ANSWER_WITHIN_S = 0.05  # a decode answers with what it has once this long has passed since its first token
MAX_ANSWER_WITHIN_MS = 10_000  # the longest a caller may ask a decode to run before answering


def check_decode(decode: int, drafts: Sequence[int], want_features: bool, parents: Sequence[int] | None,
                 answer_within_ms: int = 0) -> None:
    """InvalidRequest naming what is wrong with a decode of more than one token."""
    if answer_within_ms > MAX_ANSWER_WITHIN_MS:
        raise InvalidRequest(f"answer_within_ms is {answer_within_ms}; at most {MAX_ANSWER_WITHIN_MS}")
    if decode <= 1:
        return
    if decode > MAX_DECODE:
        raise InvalidRequest(f"decode asks for {decode} tokens; at most {MAX_DECODE} a call")
    if drafts or parents:
        raise InvalidRequest("decode of more than one token is target-only: it takes no drafts")
    if want_features:
        raise InvalidRequest("decode of more than one token returns no features (nothing drafts)")


class Decoding:
    """One session's tokens over the steps of a decode: `token` is the next step's input while `more`."""

    def __init__(self, decode: int, stop_ids: Sequence[int], token: int = -1, answer_within_ms: int = 0):
        """`token`: the first step's input, for a decode whose first step the loop makes too (else add the
        first step's result); `answer_within_ms`: 0 for ANSWER_WITHIN_S."""
        self.left, self.stop_ids = decode, set(stop_ids)
        self.until = time.monotonic() + (answer_within_ms / 1e3 if answer_within_ms > 0 else ANSWER_WITHIN_S)
        self.token = token
        self.tokens: list[int] = []
        self.logprobs: list | None = None
        self.warming = False
        self.error: BaseException | None = None

    @property
    def more(self) -> bool:
        """Whether the decode takes another step. It changes only where a step's result is added (`add`, `answer`):
        a waiting caller that read the clock itself answered while the loop's next step, which its decode had
        joined, still ran, and that step moved the session on by a token the caller never saw (concurrent
        target-only generations diverged under load in CI)."""
        return self.error is None and self.left > 0

    def add(self, result: VerifyResult | BaseException) -> None:
        if isinstance(result, BaseException):
            self.error = result
            return
        self.token = result.bonus
        self.tokens.append(result.bonus)
        if result.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(result.logprobs)
        self.warming = self.warming or result.warming
        self.left = 0 if result.bonus in self.stop_ids else self.left - 1

    def late(self, now: float) -> bool:
        return bool(self.tokens) and now >= self.until

    def answer(self) -> None:
        """Ends the decode with the tokens it has, if any."""
        if self.tokens:
            self.left = 0

    def result(self) -> VerifyResult | BaseException:
        if self.error is not None:
            return self.error
        return VerifyResult(accepted=self.tokens[:-1], bonus=self.tokens[-1], features=None, logprobs=self.logprobs,
                            warming=self.warming)


class DecodeLoop:
    """The decodes in flight, of every caller (a cohort's, a session stream's), stepped together: one batch of
    the target's a step for all of them. Run apart, two cohorts' decodes fell out of step for good, each
    stepping while the other's batch ran: a batch of 15 sessions and one of 1, in turn, every step (demo pair,
    16 target-only clients through the services). One caller at a time runs the steps, until its own decodes
    are done; another waiting then takes over."""

    def __init__(self, steps: Callable[[list[tuple[str, int]]], list]):
        self._steps = steps  # [(session_id, token), ...] -> a result or an exception each, as one batch
        self._changed = threading.Condition()
        self._active: list[tuple[str, Decoding]] = []
        self._running = False

    def after(self, first: list, decodes: list[tuple[str, int, Sequence[int], int]]) -> list:
        """The results of calls whose first steps gave `first` (a result or an exception each), `decodes` their
        (session id, decode, stop ids, answer within ms): a decode's tokens once it is done, the others' `first`
        as it is."""
        if all(decode <= 1 for _, decode, _, _ in decodes):
            return first  # plain verifies (the drafting rounds): nothing to step
        decodings = [Decoding(decode, stop_ids, answer_within_ms=within) if decode > 1 else None
                     for _, decode, stop_ids, within in decodes]
        for decoding, result in zip(decodings, first, strict=True):
            if decoding is not None:
                decoding.add(result)
                if decoding.late(time.monotonic()):
                    decoding.answer()
        self.run([(call[0], d) for d, call in zip(decodings, decodes, strict=True) if d is not None])
        return [result if d is None else d.result() for d, result in zip(decodings, first, strict=True)]

    def cohort(self, calls: list[tuple[tuple, object]], check: Callable, plain: Callable[[list], list]) -> list:
        """A cohort relay message's verifies, `(arguments, clock)` each, a result or an exception each: the
        decodes' (arguments ending in decode > 1, stop ids, answer within ms) checked by `check(*arguments)` and
        stepped here from their first step (join), after the others, run by `plain(their calls)`."""
        results: list = [None] * len(calls)
        plain_calls, decodes = [], []
        for i, (args, clock) in enumerate(calls):
            if len(args) > 6 and args[6] > 1:
                try:
                    check(*args)
                except (InvalidRequest, SessionNotFound) as exc:
                    results[i] = exc
                    continue
                decodes.append((i, (args[0], args[1], args[6], args[7], args[8] if len(args) > 8 else 0)))
            else:
                plain_calls.append((i, (args, clock)))
        if plain_calls:
            for (i, _), result in zip(plain_calls, plain([call for _, call in plain_calls]), strict=True):
                results[i] = result
        if decodes:
            for (i, _), result in zip(decodes, self.join([d for _, d in decodes]), strict=True):
                results[i] = result
        return results

    def join(self, decodes: list[tuple[str, int, int, Sequence[int], int]]) -> list:
        """The results of decodes (session id, input token, decode, stop ids, answer within ms) whose first step
        is the loop's too: it joins the next step of the decodes running. Made as a batch of its own, a decode
        call's first step cost a forward's fixed cost for a few sessions while the others waited: with the relay's
        decode messages in flight side by side (coordinator/relay.py), 16 target-only clients ran batches of 2-9
        in turn with the loop's."""
        decodings = [(session_id, Decoding(decode, stop_ids, token, within))
                     for session_id, token, decode, stop_ids, within in decodes]
        self.run(decodings)
        return [d.result() for _, d in decodings]

    def run(self, mine: list[tuple[str, Decoding]]) -> None:
        """Returns once `mine` are done (each holds its result or its error)."""
        with self._changed:
            self._active += [item for item in mine if item[1].more]
            while any(d.more for _, d in mine):
                if not self._running:
                    self._running = True
                    break
                self._changed.wait()
            else:
                return
        going: list[tuple[str, Decoding]] = []
        try:
            while any(d.more for _, d in mine):
                with self._changed:
                    self._active = [item for item in self._active if item[1].more]
                    going = list(self._active)  # others add to _active meanwhile
                results = self._steps([(session_id, d.token) for session_id, d in going])
                with self._changed:
                    for (_, decoding), result in zip(going, results, strict=True):
                        decoding.add(result)
                    now = time.monotonic()
                    if any(d.late(now) for _, d in going):  # all answer: back as one message
                        for _, decoding in going:
                            decoding.answer()
                    self._changed.notify_all()
        except BaseException as exc:
            with self._changed:
                for _, decoding in going:
                    if decoding.more:
                        decoding.add(exc)
            raise
        finally:
            with self._changed:
                self._running = False
                self._changed.notify_all()
