"""Protobuf <-> the typed objects of the core (tandem/params.py, tandem/protocol.py, tandem/stats.py).

The edge: servicers and gRPC backends convert here and nowhere else; engines and the round loop
never see a message. No torch here (the coordinator and the client use it).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from tandem.errors import InvalidRequest
from tandem.pairing import DraftShape, TargetShape
from tandem.params import GenerationRequest, GrammarSpec, SamplingParams, TreeParams
from tandem.protocol import (
    Ahead,
    Branch,
    DraftConstraint,
    DraftProbs,
    Prefill,
    PrefillResult,
    Propose,
    TokenLogprob,
    Verify,
    VerifyResult,
)
from tandem.stats import GenerationStats
from tandem.v1 import common_pb2, coordinator_pb2, draft_pb2, target_pb2


def sampling_from_pb(msg: common_pb2.SamplingParams) -> SamplingParams:
    """ValidationError (INVALID_ARGUMENT) naming the field when a value is out of range."""
    return SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        min_p=msg.min_p,
    )


def grammar_from_pb(msg: common_pb2.Grammar) -> GrammarSpec | None:
    """None for an empty Grammar; InvalidRequest for one that sets both a kind and a choice."""
    kind = msg.WhichOneof("kind")
    if kind is not None and msg.choice:
        raise InvalidRequest(f"a grammar is one of json_schema, json_object, regex, grammar and choice; got {kind} "
                             "and choice")
    if msg.choice:
        return GrammarSpec(kind="choice", value=json.dumps(list(msg.choice)))
    if kind is None:
        return None
    return GrammarSpec(kind=kind, value="" if kind == "json_object" else getattr(msg, kind))


def grammar_to_pb(spec: GrammarSpec) -> common_pb2.Grammar:
    if spec.kind == "choice":
        return common_pb2.Grammar(choice=json.loads(spec.value))
    if spec.kind == "json_object":
        return common_pb2.Grammar(json_object=True) if not spec.value else common_pb2.Grammar(
            json_schema=spec.value)
    return common_pb2.Grammar(**{spec.kind: spec.value})


def tree_from_pb(msg: common_pb2.TreeParams) -> TreeParams:
    """ValidationError (INVALID_ARGUMENT) naming the field when a value is out of range; an unset field
    takes TreeParams' default."""
    return TreeParams(**{name: value for name, value in (("nodes", msg.nodes), ("depth", msg.depth),
                                                          ("top_k", msg.top_k)) if value})


def parents_to_pb(parents: list[int] | None) -> list[int] | None:
    """Drafts.parents on the wire: 1 + each parent's index, 0 for the root (a varint byte, where -1
    would take ten); a list relayed by the coordinator (already wire values) is never decoded."""
    return None if parents is None else [p + 1 for p in parents]


def parents_from_pb(values) -> list[int] | None:
    return [int(p) - 1 for p in values] or None


def tree_to_pb(tree: TreeParams) -> common_pb2.TreeParams:
    return common_pb2.TreeParams(nodes=tree.nodes, depth=tree.depth, top_k=tree.top_k)


def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    msg.presence_penalty, msg.frequency_penalty, msg.min_p = (params.presence_penalty, params.frequency_penalty,
                                                              params.min_p)
    if params.repetition_penalty != 1.0:
        msg.repetition_penalty = params.repetition_penalty
    return msg


def logprobs_to_pb(logprobs: list[TokenLogprob]) -> list[target_pb2.TokenLogprob]:
    return [target_pb2.TokenLogprob(logprob=lp.logprob, top_ids=lp.top_ids, top_logprobs=lp.top_logprobs)
            for lp in logprobs]


def logprobs_from_pb(msgs) -> list[TokenLogprob] | None:
    """None for none sent (the session did not ask for them)."""
    return [TokenLogprob(m.logprob, list(m.top_ids), list(m.top_logprobs)) for m in msgs] or None


def generation_request_from_pb(
    msg: coordinator_pb2.GenerateRequest,
    tokenize: Callable[[str], list[int]] | None,
    chat: Callable[[list[dict]], list[int]] | None = None,
) -> GenerationRequest:
    """The client's request as the round loop takes it; `tokenize` is None when the target has no
    tokenizer; `chat` renders and tokenizes a conversation. InvalidRequest or ValidationError naming what
    is wrong."""
    given = [name for name in ("prompt", "prompt_ids", "messages") if getattr(msg, name)]
    if len(given) > 1:
        raise InvalidRequest(f"give one of prompt (text), prompt_ids and messages, not {' and '.join(given)}")
    if not given:
        raise InvalidRequest("the prompt is empty: give prompt (text), prompt_ids or messages")
    if (msg.prompt or msg.messages) and tokenize is None:
        raise InvalidRequest(f"the target has no tokenizer: send prompt_ids instead of {given[0]}")
    if msg.messages and chat is None:
        raise InvalidRequest("this server renders no chats: send prompt or prompt_ids")
    optional = {
        name: getattr(msg, name) for name in ("max_new_tokens", "num_draft_tokens", "speculate") if msg.HasField(name)
    }
    if msg.messages:
        prompt_ids = chat([{"role": m.role, "content": m.content} for m in msg.messages])
    else:
        prompt_ids = tokenize(msg.prompt) if msg.prompt else list(msg.prompt_ids)
    return GenerationRequest(
        prompt_ids=prompt_ids,
        sampling=sampling_from_pb(msg.sampling),
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        tree=tree_from_pb(msg.tree) if msg.HasField("tree") else None,
        grammar=grammar_from_pb(msg.grammar) if msg.HasField("grammar") else None,
        min_tokens=msg.min_tokens,
        **optional,
    )


# the key order of GenerationStats.as_dict(), so that --json output is the same in-process and remote
STATS_FIELDS = [*GenerationStats.model_fields, "mean_acceptance_length", "overlap_hit_rate"]


def stats_to_pb(stats: GenerationStats) -> coordinator_pb2.GenerationStats:
    return coordinator_pb2.GenerationStats(**stats.as_dict())


def stats_from_pb(msg: coordinator_pb2.GenerationStats) -> dict:
    return {name: _plain(getattr(msg, name)) for name in STATS_FIELDS}


def _plain(value):
    return value if isinstance(value, (int, float)) else list(value)


def draft_probs_to_pb(q: list[DraftProbs] | list[common_pb2.DraftProbs] | None) -> list[common_pb2.DraftProbs]:
    """q as wire messages; messages already (q relayed by the coordinator, never decoded) pass as they are."""
    return [d if isinstance(d, common_pb2.DraftProbs) else common_pb2.DraftProbs(ids=d.ids, probs=d.probs)
            for d in q or ()]


def draft_probs_from_pb(msgs) -> list[DraftProbs] | None:
    """None for none sent (greedy drafts: the draft's argmax). The ids and probabilities stay the wire's
    repeated fields, not copied into lists: the target reads them with numpy (acceptance.dense_q)."""
    return [DraftProbs(m.ids, m.probs) for m in msgs] or None


def branches_to_pb(branches: list[Branch]) -> list[draft_pb2.Branch]:
    return [draft_pb2.Branch(accepted=b.accepted, bonus=b.bonus, drafts=b.drafts, q=draft_probs_to_pb(b.q))
            for b in branches]


def branches_from_pb(msgs) -> list[Branch]:
    """q stays as its wire messages: the coordinator relays it to the target without decoding it."""
    return [Branch(accepted=b.accepted, bonus=b.bonus, drafts=list(b.drafts), q=list(b.q) or None) for b in msgs]


def target_shape_from_pb(info: target_pb2.TargetInfo) -> TargetShape:
    return TargetShape(
        vocab_size=info.vocab_size, hidden_size=info.hidden_size, num_layers=info.num_layers,
        aux_layer_ids=list(info.layer_ids), dtype=info.dtype or None, max_context=info.max_context or None,
    )


def draft_shape_from_pb(info: draft_pb2.DraftInfo) -> DraftShape:
    return DraftShape(
        vocab_size=info.vocab_size, target_hidden_size=info.target_hidden_size, max_target_id=info.max_target_id,
        aux_layer_ids=list(info.aux_layer_ids) or None, dtype=info.dtype or None,
        target_max_context=info.target_max_context or None,
    )


# -- the scheduler's batches (coordinator/scheduler.py): steps to the wire, answers back -------------
# Features and a sampled draft's q stay as the wire has them: the coordinator relays them unread.


def target_step_to_pb(step: Prefill | Verify) -> target_pb2.SessionStep:
    if isinstance(step, Prefill):
        request = target_pb2.TargetRequest(prefill=target_pb2.Prefill(
            session_id=step.session_id, prompt_ids=step.prompt_ids, sampling=sampling_to_pb(step.sampling),
            want_features=step.want_features, want_timing=step.want_timing, max_new_tokens=step.max_new_tokens,
            verify_tokens=step.verify_tokens, allowed=step.allowed or b"", output_start=step.output_start))
    else:
        request = target_pb2.TargetRequest(verify=target_pb2.Verify(
            token=step.token, drafts=step.drafts, want_features=step.want_features, q=draft_probs_to_pb(step.q),
            parents=step.parents, decode=step.decode if step.decode > 1 else 0,
            stop_ids=step.stop_ids if step.decode > 1 else (), allowed=step.allowed or b""))
    return target_pb2.SessionStep(session_id=step.session_id, request=request)


def draft_step_to_pb(step: Propose | Ahead) -> draft_pb2.DraftSessionStep:
    request = draft_pb2.DraftRequest(next_tokens=step.next_tokens, num_draft_tokens=step.k)
    if step.features is not None and step.next_tokens:
        request.features.CopyFrom(step.features)
    if isinstance(step, Ahead):
        request.ahead.CopyFrom(draft_pb2.Ahead(assumed=step.drafts, branches=step.branches))
        return draft_pb2.DraftSessionStep(session_id=step.session_id, request=request)
    request.want_timing = step.want_timing and step.open
    if step.sampling is not None:
        request.sampling.CopyFrom(sampling_to_pb(step.sampling))
    if step.tree is not None:
        request.tree.CopyFrom(tree_to_pb(step.tree))
    if step.constraint is not None and step.open:
        request.constraint.CopyFrom(draft_constraint_to_pb(step.constraint))
    return draft_pb2.DraftSessionStep(session_id=step.session_id, request=request, open=step.open)


def draft_constraint_to_pb(c: DraftConstraint) -> draft_pb2.DraftConstraint:
    msg = draft_pb2.DraftConstraint(min_tokens=c.min_tokens, stop_ids=list(c.stop_ids), output_tokens=c.output_tokens)
    if c.grammar is not None:
        msg.grammar.CopyFrom(grammar_to_pb(c.grammar))
    return msg


def draft_constraint_from_pb(msg: draft_pb2.DraftConstraint) -> DraftConstraint:
    return DraftConstraint(grammar=grammar_from_pb(msg.grammar) if msg.HasField("grammar") else None,
                           min_tokens=msg.min_tokens, stop_ids=list(msg.stop_ids), output_tokens=msg.output_tokens)


def prefilled_from_pb(msg: target_pb2.TargetResponse) -> PrefillResult:
    return PrefillResult(token=msg.prefilled.token, features=msg.features if msg.HasField("features") else None,
                         logprobs=logprobs_from_pb(msg.prefilled.logprobs))


def verified_from_pb(msg: target_pb2.TargetResponse) -> VerifyResult:
    v = msg.verified
    return VerifyResult(accepted=list(v.accepted), bonus=v.bonus,
                        features=msg.features if msg.HasField("features") else None,
                        logprobs=logprobs_from_pb(v.logprobs), warming=v.warming)
