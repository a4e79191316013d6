"""Target-only decoding of several tokens a call (Verify.decode): the target's batches make a session's next
token from its last without a round trip through the coordinator.

A target-only round is one token: through the services, at 16 demo sessions, the target's batch took 4.3 ms of
an 8.5 ms round and the rest was the round trip (relay, coordinator, gRPC). Decoding n tokens a call pays that
once per n. Each token is still one step of the target's batcher, batched with every other session's steps,
with the session's own sampling: the output is what n plain target-only rounds give. The coordinator asks for
it only where nothing drafts (tandem/rounds.py) and no further than the generation's limit; it stops after a
stop id, and the coordinator's stopper cuts there as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tandem.protocol import VerifyResult
from tandem.sessions import InvalidRequest

MAX_DECODE = 64  # tokens a call: a round's answer waits for all of them


def check_decode(decode: int, drafts: Sequence[int], want_features: bool, parents: Sequence[int] | None) -> None:
    """InvalidRequest naming what is wrong with a decode of more than one token."""
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

    def __init__(self, first: VerifyResult | BaseException, decode: int, stop_ids: Sequence[int]):
        self.left, self.stop_ids = decode, set(stop_ids)
        self.token = -1
        self.tokens: list[int] = []
        self.logprobs: list | None = None
        self.warming = False
        self.error: BaseException | None = None
        self.add(first)

    @property
    def more(self) -> bool:
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

    def result(self) -> VerifyResult | BaseException:
        if self.error is not None:
            return self.error
        return VerifyResult(accepted=self.tokens[:-1], bonus=self.tokens[-1], features=None, logprobs=self.logprobs,
                            warming=self.warming)


def decode_one(step: Callable[[int], VerifyResult], first: VerifyResult, decode: int,
               stop_ids: Sequence[int]) -> VerifyResult:
    """A session's decode after its first step's `first`: `step(token)` runs a plain target-only verify."""
    decoding = Decoding(first, decode, stop_ids)
    while decoding.more:
        decoding.add(step(decoding.token))
    return decoding.result()


def decode_many(steps: Callable[[list[tuple[int, int]]], list], first: list,
                decodes: list[tuple[int, Sequence[int]]]) -> list:
    """A cohort's results: `first[i]` is call i's first step's result (or exception), `decodes[i]` its
    (decode, stop_ids); `steps([(i, token), ...])` runs the next steps of those calls as one batch."""
    decodings = [Decoding(result, decode, stop_ids) if decode > 1 else None
                 for result, (decode, stop_ids) in zip(first, decodes, strict=True)]
    while going := [i for i, d in enumerate(decodings) if d is not None and d.more]:
        for i, result in zip(going, steps([(i, decodings[i].token) for i in going]), strict=True):
            decodings[i].add(result)
    return [result if d is None else d.result() for d, result in zip(decodings, first, strict=True)]
