"""The coordinator's half of cohorts (tandem.batching): the steps of one batch reach the next service
together, and that service knows how many to wait for.

A target batch's steps go on to the draft or not (a generation that finished, or runs target-only),
and each generation's thread learns its own step's result at its own moment. So the members of a
target batch meet here: each says whether it goes on, and those that go wait until all members have
said (at most `wait` seconds after the first result came), then tell the draft the cohort's id and
how many go. A draft batch's steps all go on to the target (a verify follows every propose), so the
draft's batch is forwarded as it is.

The size a service reports counts every step of its batch; members relayed by another coordinator
never report here, and their cohort is waited for until `wait` passes.
"""

from __future__ import annotations

import itertools
import random
import threading
import time

WAIT_S = 0.02  # past the batchers' max_wait: the answers of one target batch reach us over 10-15 ms at 16 requests
STALE_S = 1.0  # a cohort a member never reported on (its generation died between steps) is dropped


class _Cohort:
    __slots__ = ("batch", "closed", "deadline", "decided", "going", "id", "size")

    def __init__(self, batch: int, cohort_id: int, size: int, deadline: float):
        self.batch, self.id, self.size, self.deadline = batch, cohort_id, size, deadline
        self.decided = 0  # members that said whether they go on
        self.going = 0
        self.closed = False  # the count is final: members that decide later go on without the cohort


class Cohorts:
    """The target batches this coordinator relays steps of, and how many of each go on to the draft."""

    def __init__(self, wait: float = WAIT_S):
        self.wait = wait
        self._changed = threading.Condition()
        self._open: dict[int, _Cohort] = {}  # target batch id -> its cohort
        self._ids = itertools.count(random.getrandbits(48) << 15)

    def join(self, batch_id: int, size: int) -> _Cohort:
        with self._changed:
            cohort = self._open.get(batch_id)
            if cohort is None:
                now = time.monotonic()
                for key in [k for k, c in self._open.items() if c.deadline < now - STALE_S]:
                    del self._open[key]
                cohort = self._open[batch_id] = _Cohort(batch_id, next(self._ids), size, now + self.wait)
            return cohort

    def decide(self, cohort: _Cohort, going: bool) -> tuple[int, int] | None:
        """A member goes on to the draft or not. One that goes waits for the others and gets the cohort
        to send with its step, (id, members going), or None when the count was final before it came."""
        with self._changed:
            cohort.decided += 1
            if going and cohort.closed:
                return None
            cohort.going += going
            if cohort.decided >= cohort.size:
                self._close(cohort)
            if not going:
                return None
            while not cohort.closed:
                left = cohort.deadline - time.monotonic()
                if left <= 0:
                    self._close(cohort)
                    break
                self._changed.wait(left)
            return cohort.id, cohort.going

    def _close(self, cohort: _Cohort) -> None:
        cohort.closed = True
        if self._open.get(cohort.batch) is cohort:
            del self._open[cohort.batch]
        self._changed.notify_all()


class CohortLink:
    """One generation's place in the cohorts, shared by its target and draft backends."""

    def __init__(self, cohorts: Cohorts):
        self.cohorts = cohorts
        self._member: _Cohort | None = None  # the target batch of its last step, not yet decided on
        self._draft_batch: tuple[int, int] | None = None  # the draft batch of its last propose

    def from_target(self, batch_id: int, size: int) -> None:
        """A target step's result came, computed in batch `batch_id` of `size` steps."""
        self.leave()
        if size > 1:
            self._member = self.cohorts.join(batch_id, size)

    def to_draft(self) -> tuple[int, int] | None:
        """The generation's next step goes to the draft: the cohort to send with it."""
        member, self._member = self._member, None
        return self.cohorts.decide(member, True) if member is not None else None

    def leave(self) -> None:
        """The generation's next step does not go to the draft (or there is none)."""
        member, self._member = self._member, None
        if member is not None:
            self.cohorts.decide(member, False)

    def from_draft(self, batch_id: int, size: int) -> None:
        self._draft_batch = (batch_id, size) if size > 1 else None

    def to_target(self) -> tuple[int, int] | None:
        """The cohort to send with the generation's verify: its last propose's draft batch."""
        batch, self._draft_batch = self._draft_batch, None
        return batch
