"""The round loop (docs/architecture.md, "One request, round by round"), written once as a coroutine of
steps: `rounds()` yields the steps it needs of the services (tandem/protocol.py: Prefill, Verify,
Propose, Ahead) and is sent their results; it also yields the RoundEvents of committed tokens. One
driver runs it: the scheduler (coordinator/scheduler.py), which puts the steps of every running request
into one batch per service per step, over the services' streams or over engines in one process
(tandem_tools/inprocess.py). Features are opaque here (a tensor in-process, a wire message in the
coordinator).

    prefill                       the target: t and the prompt's features
    repeat until a stop:
      k       = policy.k_for_round()          how many drafts this round (tandem/policy.py)
      tree    = policy.tree_for_round(k)      or a draft tree instead of the chain (EAGLE-2), where it pays
      drafts  = draft.propose(k, tree)        the draft session: d_1..d_k (sampled: with their q), or a
                                              tree's nodes with their parents
      verdict = target.verify(t, drafts)      accepted d_1..d_a (a tree's: its accepted path), bonus b,
                                              features of t, d_1..d_a (beside it, with overlap: an ahead)
      commit                                  count, feed the draft the new pairs, t := b, emit
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator
from dataclasses import dataclass, field

from tandem.constraint import Constraint, Grammars
from tandem.draft_session import DraftSession, Sessions, Steps
from tandem.errors import InvalidRequest
from tandem.params import MAX_DRAFT_TOKENS, GenerationRequest
from tandem.policy import KPolicy, Speculation
from tandem.protocol import (
    Ahead,
    DraftConstraint,
    DraftProbs,
    Drafts,
    Prefill,
    Propose,
    TokenLogprob,
    Verify,
)
from tandem.stats import GenerationStats

log = logging.getLogger("tandem.rounds")

FIXED_K = Speculation()  # the request's own K, every round: no load, no gate, no overlap

@dataclass
class RoundEvent:
    """Tokens committed since the last event; `finish_reason` is set on the last one."""

    new_tokens: list[int]
    stats: GenerationStats
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the sampling asked for them


@dataclass
class Resume:
    """Where a preempted generation starts again (coordinator/scheduler.py): the tokens it has produced,
    which its prefill recomputes after the prompt, and its stats so far."""

    tokens: list[int]
    stats: GenerationStats


@dataclass
class Stopper:
    limit: int  # max_new_tokens, or less when the context would run out first
    stop_ids: set[int] = field(default_factory=set)
    produced: int = 0

    def take(self, tokens: list[int]) -> tuple[list[int], str | None]:
        """Cut `tokens` at the first stop id (kept, as HF generate keeps EOS) or at max_new_tokens."""
        out: list[int] = []
        for token in tokens:
            out.append(token)
            self.produced += 1
            if token in self.stop_ids:
                return out, "stop"
            if self.produced >= self.limit:
                return out, "length"
        return out, None


def rounds(
    request: GenerationRequest,
    eos_token_ids: list[int],
    has_draft: bool,
    sessions: Sessions,
    max_context: int | None = None,
    speculation: Speculation = FIXED_K,
    resume: Resume | None = None,
    grammars: Grammars | None = None,
    vocab_size: int | None = None,
) -> Generator[Steps | RoundEvent, list | None, None]:
    """One generation: yields the steps it needs (a list, answered with a list of results, an exception
    instance for a step that failed) and its RoundEvents (answered with None), until a stop condition.
    With `resume`, it goes on after the tokens a preempted run of it produced: its prefill is the prompt
    and them, and its events carry on from there.

    A target step that failed raises here. A draft that fails is lost and the rest of the request runs
    with k=0: the target alone decides every token, so only the speed-up is lost. With overlap, drafts
    only choose what the target checks, so the output is the same either way.

    A constrained request (a grammar, min_tokens) sends the target a mask for every position it scores
    (tandem/constraint.py, `grammars` compiling the grammar over the target's `vocab_size`): drafts its
    masks forbid are cut before the verify, and every round is one token target-only (the next mask
    depends on the last token).
    """
    session = sessions.session_id
    stop_ids = set(request.stop_token_ids) | (set() if request.ignore_eos else set(eos_token_ids))
    limit = request.max_new_tokens
    if max_context is not None:
        limit = min(limit, max_context - len(request.prompt_ids))
    produced = list(resume.tokens) if resume is not None else []
    prompt = [*request.prompt_ids, *produced]
    stopper = Stopper(limit, stop_ids, produced=len(produced))
    policy = KPolicy(request, speculation, limit, has_draft=has_draft)
    drafter = None
    if has_draft and policy.drafting:
        drafter = DraftSession(sessions, speculation.overlaps(request), request.sampling,
                               DraftConstraint(request.grammar, request.min_tokens, sorted(stop_ids), len(produced) + 1)
                               if request.constrained else None)
    sessions.draft_alive = drafter is not None
    stats = resume.stats if resume is not None else \
        GenerationStats(accepted_per_position=[0] * (request.num_draft_tokens if drafter else 0))
    constraint = make_constraint(request, grammars, vocab_size, stop_ids)
    masked = stats.constraint_seconds  # a resumed generation's masks before its preemption
    if constraint is not None and produced:
        constraint.commit(produced, stop_ids)  # a resumed generation's matcher is where its tokens left it

    def alive() -> bool:
        return drafter is not None and drafter.alive

    try:
        widest = 1 + policy.tree.nodes if alive() and policy.tree is not None else None  # a tree's verify
        sessions.target = True
        (prefill,) = yield [Prefill(session, prompt, request.sampling, alive(), max_new_tokens=limit - len(produced),
                                    verify_tokens=widest, want_timing=sessions.want_timing,
                                    allowed=constraint.first() if constraint else None,
                                    output_start=len(request.prompt_ids) if produced else None)]
        prefill = _raised(prefill)
        token = prefill.token
        new_tokens, finish = stopper.take([token])
        if constraint:
            constraint.commit(new_tokens, stop_ids)
        yield RoundEvent(new_tokens, stats, finish, _cut(prefill.logprobs, new_tokens))
        if alive():
            drafter.feed(prefill.features, [*prompt[1:], token])
        started = time.perf_counter()  # a round's time runs to the next round's start: the client's share too
        while finish is None:
            # draft
            k = policy.k_for_round(stopper.produced, stats.num_rounds, alive())
            if policy.shed:
                stats.num_rounds_load_shed += 1
                if drafter is not None:
                    drafter.release()
            drafts, ahead, extend = Drafts(), None, None
            if policy.timing and alive():  # target-only, timed by the gate: the draft takes in its pairs beside
                extend = drafter.extend()
            if k > 0 and alive():
                tree = policy.tree_for_round(k, stopper.produced)
                branches = _ahead_branches(speculation, drafter, k, limit - stopper.produced) if tree is None else 0
                drafts, ahead = yield from drafter.draft(k, branches, tree)
            if k > 0 and not alive():
                stats.num_rounds_without_draft += 1
            allowed = None
            if constraint and constraint.active:  # a draft the masks forbid ends the chain here
                if drafts.parents is not None:
                    allowed = constraint.tree(drafts, drafts.parents)
                else:
                    room = min(MAX_DRAFT_TOKENS, limit - stopper.produced - 1) if drafts else 0
                    kept, forced, allowed = constraint.chain(drafts, room)
                    stats.num_constrained_cuts += len(drafts) - kept
                    stats.num_forced_drafts += len(forced)
                    if kept < len(drafts) or forced:
                        drafts = _forced(drafts.head(kept), forced)
            # verify (target-only: up to decode_steps tokens in one step of the target; one while masked)
            decode = min(speculation.decode_steps, limit - stopper.produced) \
                if (not alive() or policy.timing) and allowed is None else 1
            verify = Verify(session, token, list(drafts), alive(), drafts.q, drafts.parents,
                            decode, sorted(stop_ids) if decode > 1 else (), allowed)
            answers = yield [verify, *(step for step in (ahead, extend) if step is not None)]
            verdict = _raised(answers[0])
            if extend is not None:
                drafter.extended(answers[1])
            # commit
            accepted = len(verdict.accepted)
            if not policy.timing:  # the gate's target-only rounds say nothing of the drafts
                stats.count_round(len(drafts), accepted if drafts else 0, drafts.parents is not None)
            now = time.perf_counter()
            policy.record(len(drafts), accepted, now - started, drafts.parents is not None, verdict.warming)
            started = now
            if ahead is not None:
                hit = drafter.settle(accepted, verdict.bonus, answers[1])
                if hit is not None:
                    stats.num_overlap_rounds += 1
                    stats.num_overlap_hits += hit
            committed = [*verdict.accepted, verdict.bonus]
            if alive():
                drafter.feed(verdict.features, committed)
            token = verdict.bonus
            new_tokens, finish = stopper.take(committed)
            if constraint:
                constraint.commit(new_tokens, stop_ids)
                stats.constraint_seconds = masked + constraint.seconds
            yield RoundEvent(new_tokens, stats, finish, _cut(verdict.logprobs, new_tokens))
    finally:
        policy.close()


def make_constraint(request: GenerationRequest, grammars: Grammars | None, vocab_size: int | None,
                    stop_ids: set[int]) -> Constraint | None:
    """The request's Constraint, None when unconstrained; InvalidRequest naming what is missing or wrong."""
    if not request.constrained:
        return None
    if vocab_size is None or (request.grammar is not None and grammars is None):
        raise InvalidRequest("structured outputs need the target's tokenizer, and this server has none"
                             if request.grammar is not None else "min_tokens needs the target's vocabulary size")
    matcher = grammars.matcher(request.grammar) if request.grammar is not None else None
    return Constraint(matcher, vocab_size, stop_ids, request.min_tokens)


def _forced(drafts: Drafts, forced: list[int]) -> Drafts:
    """The kept drafts and the grammar's forced ones after them; a sampled chain's q one-hot on each forced
    one (what it was drawn from: the draft's q masked to the one token the grammar allows)."""
    q = None if drafts.q is None else [*drafts.q, *(DraftProbs([token], [1.0]) for token in forced)]
    return Drafts([*drafts, *forced], q)


def _raised(result):
    if isinstance(result, BaseException):
        raise result
    return result


def _cut(logprobs: list[TokenLogprob] | None, kept: list[int]) -> list[TokenLogprob] | None:
    """The logprobs of the committed tokens the stopper kept."""
    return logprobs[: len(kept)] if logprobs is not None else None


def _ahead_branches(speculation: Speculation, drafter: DraftSession, k: int, remaining: int) -> int:
    """Branches for the draft to prepare the next round with during this verify, or 0 for none: only
    when a next round can follow (this one may commit k+1) and while the server has time to spare."""
    if not drafter.overlap or remaining <= k + 2:
        return 0
    if speculation.overlap_while is not None and not speculation.overlap_while():
        return 0
    return speculation.branches


def is_draft_step(step) -> bool:
    return isinstance(step, (Propose, Ahead))
