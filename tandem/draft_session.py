"""What a generation holds on the services (`Sessions`), and its session on the draft (`DraftSession`): the
pairs the draft has not seen yet, the drafts an ahead step prepared, and losing the draft. The round loop
(tandem/rounds.py) drives them."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Generator
from dataclasses import dataclass, field

from tandem.params import SamplingParams, TreeParams
from tandem.protocol import Ahead, Branch, DraftConstraint, Drafts, Features, Propose

log = logging.getLogger("tandem.rounds")

Steps = list  # of TargetStep / DraftStep: what the loop needs done at once, answered in the same order


@dataclass
class Sessions:
    """What a generation holds on the services, for its driver to release: the target session once its
    prefill went out, the draft session once its first propose did (until it is lost or released)."""

    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    target: bool = False
    draft: bool = False
    draft_alive: bool = True  # false once lost or shed: the driver releases a draft session still open
    want_timing: bool = False  # a profiled request: the services time its steps



class DraftSession:
    """One generation's session on the draft: opened by its first propose, lost or released once.

    It keeps the committed pairs (F_i, x_{i+1}) the draft has not seen yet and sends them with the
    next propose or ahead step. With overlap it also holds the drafts an ahead step prepared for this
    round (`ready`). A sampled request's session is opened with its sampling parameters: the draft draws
    its drafts from its own distribution and returns each one's q.
    """

    def __init__(self, sessions: Sessions, overlap: bool, sampling: SamplingParams | None = None,
                 constraint: DraftConstraint | None = None):
        self.sessions = sessions
        self.sampling = sampling if sampling is not None and not sampling.greedy else None
        self.constraint = constraint  # a constrained request's: the draft masks its q with it
        self.overlap = overlap
        self._features: Features = None  # not yet sent, with the tokens after them
        self._tokens: list[int] = []
        self._ready: Drafts | None = None  # this round's drafts, prepared during the last verify

    @property
    def alive(self) -> bool:
        return self.sessions.draft_alive

    def feed(self, features: Features, tokens: list[int]) -> None:
        """Newly committed pairs: `tokens[i]` follows the position of `features[i]`."""
        self._features, self._tokens = features, tokens

    def draft(self, k: int, ahead_branches: int = 0, tree: TreeParams | None = None
              ) -> Generator[Steps, list, tuple[Drafts, Ahead | None]]:
        """This round's k drafts: prepared during the last verify when there are some, else a propose;
        and with `ahead_branches`, the ahead step to send beside the verify (answered in `settle`).
        With `tree`, a draft tree of that shape instead (never with overlap: ahead steps draft chains)."""
        ready, self._ready = self._ready, None
        if ready and ahead_branches and tree is None:
            drafts = ready.head(k)
        else:
            first = not self.sessions.draft
            self.sessions.draft = True  # released even if this first step fails
            step = Propose(self.sessions.session_id, self._features, self._tokens, k, open=first,
                           sampling=self.sampling if first else None, tree=tree,
                           want_timing=self.sessions.want_timing, constraint=self.constraint if first else None)
            (result,) = yield [step]
            drafts = self._take(result)
            self._features, self._tokens = None, []
        ahead = None
        if self.alive and self.overlap and ahead_branches and drafts:
            ahead = Ahead(self.sessions.session_id, self._features, self._tokens, list(drafts), k, ahead_branches)
            self._features, self._tokens = None, []
        if not isinstance(drafts, Drafts):
            drafts = Drafts(drafts or [])  # a plain list: argmax drafts
        return drafts, ahead

    def extend(self) -> Propose | None:
        """A round the acceptance gate runs target-only to time it: the pairs not yet sent go to the draft
        beside its verify, in a propose of no drafts (None: none to send); drafts an ahead prepared for this
        round are dropped."""
        self._ready = None
        if not self._tokens or not self.sessions.draft:
            return None
        step = Propose(self.sessions.session_id, self._features, self._tokens, 0, want_timing=self.sessions.want_timing)
        self._features, self._tokens = None, []
        return step

    def extended(self, result) -> None:
        """The answer to `extend`'s propose: a failed one loses the draft."""
        self._take(result)

    def settle(self, accepted: int, bonus: int, branches: list[Branch] | BaseException) -> bool | None:
        """After a verify with an ahead beside it: whether the ahead had prepared its outcome."""
        branches = self._take(branches)
        if branches is None:
            return None
        self._ready = next((Drafts(b.drafts, b.q) for b in branches if (b.accepted, b.bonus) == (accepted, bonus)),
                           None)
        return self._ready is not None

    def _take(self, result):
        """A draft step's result, or None once it failed: the draft is lost, the rest runs target-only."""
        if isinstance(result, BaseException):
            self.lose(result)
            return None
        return result

    def lose(self, reason: object) -> None:
        if self.alive:
            log.warning("session %s: the draft is lost (%s); going on target-only", self.sessions.session_id, reason)
        self.release()

    def release(self) -> None:
        self.sessions.draft_alive = self.overlap = False
        self._ready = None
