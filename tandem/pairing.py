"""Does a draft fit a target? Checked on plain numbers so that every process can ask (no torch)."""

from __future__ import annotations

from dataclasses import dataclass


class PairMismatch(ValueError):
    """The draft head was not made for this target; the message lists every mismatch."""


@dataclass
class TargetShape:
    vocab_size: int
    hidden_size: int
    num_layers: int


@dataclass
class DraftShape:
    vocab_size: int  # rows of embed_tokens: the target vocabulary the head reads
    target_hidden_size: int  # fc reads 3 * this
    max_target_id: int  # the largest target id d2t maps to
    aux_layer_ids: list[int] | None


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
    if draft.aux_layer_ids is not None:
        bad = [i for i in draft.aux_layer_ids if not 0 <= i < target.num_layers]
        if len(draft.aux_layer_ids) != 3 or bad:
            problems.append(
                f"layer ids: the draft asks for target layers {draft.aux_layer_ids}, "
                f"the target has {target.num_layers} decoder layers (3 ids in [0, {target.num_layers}) needed)"
            )
    if problems:
        raise PairMismatch("draft does not fit the target: " + "; ".join(problems))
