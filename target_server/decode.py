"""Target-only decoding of several tokens a step (Verify.decode): the target makes a session's next token
from its last without a round trip through the coordinator. The scheduler lets it only while no other
request drafts and nobody waits (coordinator/scheduler.py): a target-only round is one token, and the round trip
through the services was the other half of its time. Each token is one forward of all the batch's decodes,
each with its own sampling: the output is what that many plain target-only rounds give. With
want_features, the features of every token it read (t and all but the last it made) come back, as a verify's
do: a drafting generation's own target-only rounds, which the acceptance gate times (tandem/gates.py), keep
its draft fed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.protocol import Verify, VerifyResult
from tandem.sessions import InvalidRequest, SessionNotFound

MAX_DECODE = 64  # tokens one step may decode


def check_decode(decode: int, drafts: Sequence[int], parents: Sequence[int] | None) -> None:
    """InvalidRequest naming what is wrong with a decode of more than one token."""
    if decode <= 1:
        return
    if decode > MAX_DECODE:
        raise InvalidRequest(f"decode asks for {decode} tokens; at most {MAX_DECODE} a step")
    if drafts or parents:
        raise InvalidRequest("decode of more than one token is target-only: it takes no drafts")


def decode_rest(engine, decodes: list[Verify], results: list[VerifyResult]) -> None:
    """The further tokens of a batch's decodes (`results`: their first) on `engine` (the TargetEngine), one forward of all that go on per
    token; a decode ends after its count, a stop id, or a step that failed. Each result becomes accepted =
    all but the last, bonus = the last."""
    tokens = {id(v): [r.bonus] for v, r in zip(decodes, results, strict=True)}
    features = {id(v): [r.features] for v, r in zip(decodes, results, strict=True) if v.want_features}
    logprobs = {id(v): list(r.logprobs or []) for v, r in zip(decodes, results, strict=True)}
    ended: set[int] = set()
    while going := [v for v in decodes if id(v) not in ended and len(tokens[id(v)]) < v.decode
                    and tokens[id(v)][-1] not in v.stop_ids]:
        built = []
        for v in going:
            try:
                built.append((v, engine._verify_step(Verify(v.session_id, tokens[id(v)][-1], [], v.want_features))))
            except (InvalidRequest, SessionNotFound):
                ended.add(id(v))  # released meanwhile: what it has is its answer
        for (v, _), out in zip(built, engine._run_batch([step for _, step in built]), strict=True):
            if isinstance(out, BaseException):
                ended.add(id(v))
                continue
            tokens[id(v)].append(out.bonus)
            logprobs[id(v)].extend(out.logprobs or [])
            if v.want_features:
                features[id(v)].append(out.features)
    for v, r in zip(decodes, results, strict=True):
        *r.accepted, r.bonus = tokens[id(v)]
        r.logprobs = logprobs[id(v)] or None
        if v.want_features:
            r.features = torch.cat(features[id(v)])
