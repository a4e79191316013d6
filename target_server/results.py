"""A step's result from its rows of a batch's logits: a prefill's token, or a verify's accepted drafts and
bonus by the rules of target_server/acceptance.py, with the features and logprobs of the rows it keeps. One
sequence at a time, after the engine's batched forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.protocol import PrefillResult, VerifyResult
from target_server.acceptance import (
    accept,
    accept_argmax,
    accept_tree,
    accept_tree_argmax,
    pick,
    token_logprobs,
)
from target_server.steps import Step


def step_result(
    step: Step, logits: torch.Tensor, features: torch.Tensor, argmax: list[int] | None,
    commit: Callable[[range | list[int]], None], raw: torch.Tensor, device: torch.device, warming: bool,
) -> PrefillResult | VerifyResult:
    """Sample or accept from one sequence's logits (prefill: [1, V], verify: [K+1, V], a tree's one row
    per node), their argmax already on the host for a greedy session; `commit(kept)` is told which of
    its new tokens it keeps (a chain's first ones, a tree's root and accepted path). `logits` are processed
    (target_server/logits.py), `raw` the model's, for logprobs; `warming`: the engine still compiles."""
    session = step.session
    greedy = session.params.greedy
    if step.kind == "prefill":
        keep: range | list[int] = range(len(step.ids))
        token = argmax[-1] if greedy else pick(logits[-1], session.params, session.generator)
        out = PrefillResult(token=token, features=features if step.want_features else None)
        if session.params.logprobs is not None:
            out.logprobs = token_logprobs(raw[-1:], [out.token], session.params.logprobs)
        commit(keep)
        return out
    drafts = step.ids[1:]
    if step.parents is not None:
        tree, params = step.parents, session.params
        path, bonus = (accept_tree_argmax(argmax, step.ids, tree) if greedy
                       else accept_tree(logits, step.ids, tree, params, session.generator, step.q))
        keep = [0, *path]
    else:
        if greedy:
            accepted, bonus = accept_argmax(argmax, drafts)
        else:
            drafted = torch.tensor(drafts, dtype=torch.long, device=device)
            accepted, bonus = accept(logits, drafted, session.params, session.generator, step.q)
        keep = range(1 + accepted)
    out = VerifyResult(accepted=[step.ids[i] for i in keep[1:]], bonus=bonus,
                       features=_rows(features, keep) if step.want_features else None,
                       warming=warming)
    top = session.params.logprobs
    if top is not None:  # the rows of t and the accepted drafts: where d_1..d_a and b are
        out.logprobs = token_logprobs(_rows(raw, keep), [*out.accepted, bonus], top)
    commit(keep)
    return out


def _rows(t: torch.Tensor, keep: range | list[int]) -> torch.Tensor:
    """The rows `keep` of t: a slice for a chain's first ones, an index (no host sync) for a tree's path."""
    if isinstance(keep, range):
        return t[: len(keep)]
    return t.index_select(0, torch.tensor(keep, dtype=torch.long).to(t.device))
