"""The numbers every report of a generation uses, each defined once: the stats of one generation,
the mean acceptance length, percentiles.

Glossary in docs/architecture.md: a *round* is one verify forward; *drafts* are the tokens the draft
proposed for it; *accepted* ones matched the target; the *bonus* token is the target's own after them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from pydantic import BaseModel


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]) of `values`, in any order; 0 for no values.

    Linear interpolation between the two nearest ranks: numpy's default (`method="linear"`),
    `statistics.quantiles(method="inclusive")`, Hyndman & Fan's type 7. Rank (n - 1) q / 100 of the
    sorted values, so p0 is the minimum, p100 the maximum and p50 the median."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    if not 0 <= q <= 100:
        raise ValueError(f"a percentile is between 0 and 100, got {q}")
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean_acceptance_length(num_accepted: int, num_rounds: int) -> float:
    """Tokens committed per verify round, bonus included: 1 + accepted / rounds (the number vLLM and
    SGLang report); 0 when no round ran."""
    return 1.0 + num_accepted / num_rounds if num_rounds else 0.0


class GenerationStats(BaseModel):
    num_rounds: int = 0  # verify forwards after the prefill, but the acceptance gate's target-only ones
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = []  # [K]: rounds in which draft k was accepted
    # rounds that asked for drafts and ran without (no draft, or it was lost mid-request)
    num_rounds_without_draft: int = 0
    # rounds run target-only because speculation would not pay: the server was too busy (adaptive K)
    # or the drafts were rarely accepted (the acceptance gate)
    num_rounds_load_shed: int = 0
    # overlap: verify rounds during which the draft prepared the next round, and of those the ones
    # whose outcome it had prepared for (the next drafts were ready when the verify answered)
    num_overlap_rounds: int = 0
    num_overlap_hits: int = 0
    num_tree_rounds: int = 0  # verify rounds that checked a draft tree (EAGLE-2) rather than a chain
    # a constrained generation (tandem/constraint.py): drafts cut before their verify because the grammar
    # (or min_tokens) forbade them, drafts it forced, and the seconds spent computing masks
    num_constrained_cuts: int = 0
    num_forced_drafts: int = 0  # drafts the grammar forced (one token allowed) in place of the draft's
    constraint_seconds: float = 0.0

    def count_round(self, drafted: int, accepted: int, tree: bool = False) -> None:
        """One verify round that checked `drafted` drafts (a chain's, or a tree's nodes) and accepted
        `accepted` of them (the first ones of a chain, a path of a tree)."""
        self.num_rounds += 1
        self.num_tree_rounds += tree
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < accepted:  # a tree deeper than the request's K
            self.accepted_per_position += [0] * (accepted - len(self.accepted_per_position))
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return mean_acceptance_length(self.num_accepted_tokens, self.num_rounds)

    @property
    def overlap_hit_rate(self) -> float:
        return self.num_overlap_hits / self.num_overlap_rounds if self.num_overlap_rounds else 0.0

    def as_dict(self) -> dict:
        return {**self.model_dump(), "mean_acceptance_length": self.mean_acceptance_length,
                "overlap_hit_rate": self.overlap_hit_rate}
