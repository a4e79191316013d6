"""A constrained request's drafts (tandem/constraint.py): the draft session's own matcher, opened with the
request's DraftConstraint and advanced on the committed tokens, and the masks a rollout picks its drafts
under (draft_server/engine.py, "Constrained requests")."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from tandem.constraint import Constraint, Grammars, Walk, allowed_among
from tandem.protocol import DraftConstraint
from tandem.sessions import InvalidRequest
from tandem.staging import upload


class DraftGrammars:
    """The draft's side of structured outputs: matchers over the target's tokenizer.json (compiled at the
    first constrained request; none where the draft was given no target, or it has no tokenizer.json: the
    drafts are then unmasked, and the round loop still cuts the ones the grammar forbids)."""

    def __init__(self, target_dir: str | Path | None, vocab_size: int, draft_targets: torch.Tensor,
                 device: torch.device):
        """`draft_targets`: each draft id's target id [Vd]."""
        self.target_dir = Path(target_dir) if target_dir is not None else None
        self.vocab_size, self.device = vocab_size, device
        self.targets = draft_targets.cpu().numpy()
        self._grammars: Grammars | None = None

    def _compiled(self) -> Grammars | None:
        if self._grammars is None and self.target_dir is not None and (self.target_dir / "tokenizer.json").is_file():
            from transformers import AutoConfig

            from target_server.loading import eos_token_ids

            eos = eos_token_ids(self.target_dir, AutoConfig.from_pretrained(self.target_dir))
            self._grammars = Grammars((self.target_dir / "tokenizer.json").read_text(), self.vocab_size, eos)
        return self._grammars

    def open(self, c: DraftConstraint, next_tokens: Sequence[int]) -> Constraint | None:
        """A constrained session's Constraint, the last `c.output_tokens` of its first pairs' tokens the
        generation's so far; None where there is no tokenizer for its grammar."""
        if not 0 <= c.output_tokens <= len(next_tokens):
            raise InvalidRequest(f"constraint.output_tokens must be in [0, {len(next_tokens)}], got {c.output_tokens}")
        matcher = None
        if c.grammar is not None:
            grammars = self._compiled()
            if grammars is None:
                return None
            matcher = grammars.matcher(c.grammar)
        constraint = Constraint(matcher, self.vocab_size, c.stop_ids, c.min_tokens)
        constraint.commit(list(next_tokens[len(next_tokens) - c.output_tokens :]), list(c.stop_ids))
        return constraint

    def masks(self, steps) -> Masks | None:
        """The masks of a batch's constrained sessions (steps with a `.session`), None when it has none."""
        walks = [s.session.constraint.walk() if s.session.constraint is not None and s.session.constraint.active
                 else None for s in steps]
        if all(w is None for w in walks):
            return None
        return Masks(walks, self.targets, self.device)


class Masks:
    """A rollout's constrained rows (tandem/constraint.py): before each pick, a row's logits are masked by
    its grammar's row at that position, over the draft vocabulary (`targets`: the draft ids' target ids);
    after it, the row's walk follows the draft. Each step reads the drafts back (a host sync a step, for
    batches with a constrained row only). A row whose mask allows no draft token is left unmasked: its
    draft is forbidden, and the round loop cuts the chain there."""

    def __init__(self, walks: list[Walk | None], targets: np.ndarray, device: torch.device):
        self.walks, self.targets, self.device = walks, targets, device
        self.rows = [i for i, w in enumerate(walks) if w is not None]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, Vd] -> the constrained rows masked (-inf where their row forbids the token)."""
        allowed = np.ones(tuple(logits.shape), dtype=bool)
        masked = False
        for i in self.rows:
            row = self.walks[i].row()
            if row is not None:
                mine = allowed_among(row, self.targets)
                if mine.any():
                    allowed[i], masked = mine, True
        if not masked:
            return logits
        (allowed,) = upload([(allowed, torch.bool)], self.device)
        return logits.masked_fill(~allowed, float("-inf"))

    def took(self, drafts: torch.Tensor) -> None:
        """The drafts just picked, [B] target ids: each constrained row's walk follows its own."""
        picked = drafts.tolist()
        for i in self.rows:
            self.walks[i].take(picked[i])

    def close(self) -> None:
        for i in self.rows:
            self.walks[i].close()
