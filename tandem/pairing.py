"""Does a draft fit a target? Checked on plain numbers so that every process can ask (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.aux_layers import default_aux_layer_ids


class PairMismatch(ValueError):
    """The draft head was not made for this target; the message lists every mismatch."""


@dataclass
class TargetShape:
    vocab_size: int
    hidden_size: int
    num_layers: int
    # what a running target service reports; None where only the checkpoint is known
    aux_layer_ids: list[int] | None = None  # the layers it captures
    dtype: str | None = None
    max_context: int | None = None


@dataclass
class DraftShape:
    vocab_size: int  # rows of embed_tokens: the target vocabulary the head reads
    target_hidden_size: int  # fc reads 3 * this
    max_target_id: int  # the largest target id d2t maps to
    aux_layer_ids: list[int] | None  # None: the default for the target's depth
    dtype: str | None = None
    target_max_context: int | None = None  # the context of the target checkpoint the draft was set up with


def check_pair(target: TargetShape, draft: DraftShape) -> None:
    problems = []
    if draft.target_hidden_size != target.hidden_size:
        problems.append(
            f"hidden size: the draft's fc reads 3x{draft.target_hidden_size} features, "
            f"the target's hidden size is {target.hidden_size}"
        )
    if draft.vocab_size != target.vocab_size:
        problems.append(f"vocabulary: the draft has {draft.vocab_size} tokens, the target {target.vocab_size}")
    elif draft.max_target_id >= target.vocab_size:
        problems.append(f"vocabulary: d2t maps to token {draft.max_target_id}, past the target's {target.vocab_size}")
    if draft.aux_layer_ids is not None:  # hidden_states ids: 0 the embeddings .. L the last layer's output
        bad = [i for i in draft.aux_layer_ids if not 0 <= i <= target.num_layers]
        if len(draft.aux_layer_ids) != 3 or bad:
            problems.append(
                f"layer ids: the draft asks for target hidden states {draft.aux_layer_ids}, "
                f"the target has {target.num_layers} decoder layers (3 ids in [0, {target.num_layers}] needed)"
            )
    if target.aux_layer_ids is not None:
        wanted = list(draft.aux_layer_ids or default_aux_layer_ids(target.num_layers))
        if list(target.aux_layer_ids) != wanted:
            problems.append(
                f"layer ids: the draft reads target layers {wanted}, the target captures {list(target.aux_layer_ids)} "
                f"(start the target with --draft pointing at the draft checkpoint, and the same --aux-layer-convention)"
            )
    if target.dtype and draft.dtype and target.dtype != draft.dtype:
        problems.append(
            f"dtype: the target runs in {target.dtype}, the draft in {draft.dtype} (start both with the same --dtype)"
        )
    if target.max_context and draft.target_max_context and target.max_context != draft.target_max_context:
        problems.append(
            f"context length: the target serves {target.max_context} tokens, the draft was set up with a "
            f"target of {draft.target_max_context} (point the draft's --target at the target's checkpoint)"
        )
    if problems:
        raise PairMismatch("draft does not fit the target: " + "; ".join(problems))
