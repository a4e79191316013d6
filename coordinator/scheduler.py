"""The scheduler: one per target/draft pair, it owns the table of requests and the step loop (vLLM's
EngineCore.step: schedule, execute, update; SGLang's draft(batch), verify(batch)).

Every request is a coroutine of the round loop (tandem/rounds.py:rounds) that yields the steps it needs.
One step of the scheduler:

    schedule   admit waiting requests (FCFS); put each running request's steps into the target's batch
               or the draft's, holding a few back a step to keep two waves (below)
    execute    send both batches (coordinator/links.py: one message each way per service), then read both
    update     hand each request its results; its coroutine yields its committed tokens (to its output
               queue, read by its client's handler) and its next steps

Two waves: a drafting request alternates between the draft (propose) and the target (verify). Split into
two groups that are a phase apart, the target verifies one while the draft proposes for the other, so both
devices work every step and drafting costs max(verify, propose) a step, not their sum. When one side has
more alternating requests than the other by two or more, half the difference waits one step. One request
is one wave; the ahead step (overlap) goes beside its verify.

Nothing on the step path waits for a request that is not there: a step runs what is ready, at once. The
loop sleeps only while there is no request at all. A target-only request asks for several tokens a step
(Verify.decode); the scheduler lets it only while no other request drafts and nobody waits, else one.

Admission: requests beyond `max_running` wait in the queue (at most `max_waiting`, then
RESOURCE_EXHAUSTED); a prefill the target's KV budget refuses goes back to the front of the queue while
other requests run, and no request is admitted until one has finished.

Preemption (vLLM's, by recompute): a session's KV grows as it generates. When the budget cannot grow it
for a verify, the newest running request is preempted: its sessions are released and it goes back to the
front of the queue with the tokens it has produced, which its next prefill recomputes (its client sees one
stream of tokens). The refused verify runs again the next step. A request that would outgrow the whole
budget alone ends with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

import grpc

from coordinator.links import BackendError, ServiceLink
from tandem import convert
from tandem.constraint import Grammars
from tandem.draft_session import Sessions
from tandem.errors import Abort
from tandem.params import GenerationRequest
from tandem.policy import Speculation
from tandem.protocol import Drafts, DraftUnavailable, Prefill, Propose, Verify
from tandem.rounds import Resume, RoundEvent, is_draft_step, rounds
from tandem.v1 import draft_pb2, target_pb2

log = logging.getLogger("tandem.scheduler")

RETRY_AFTER_S = 1  # what a refused client is told to wait (HTTP Retry-After)
_END = object()


class Handle:
    """A submitted request's side for its client: `events()` yields its RoundEvents and raises the error
    that ended it, if one did; `cancel()` ends it (the scheduler frees its sessions at the next step)."""

    def __init__(self, timeout: float | None):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.deadline = time.monotonic() + timeout if timeout is not None else None
        self.cancelled = False

    def put(self, item) -> None:
        self._queue.put(item)

    def events(self) -> Iterator[RoundEvent]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class _Request:
    generation: GenerationRequest
    handle: Handle
    has_draft: bool
    probe: object | None = None  # coordinator.probe.RequestProbe of a profiled request
    sessions: Sessions = field(default_factory=Sessions)
    loop: Generator | None = None
    steps: list = field(default_factory=list)  # what its coroutine asked for, not yet answered
    target_stream: int = 0  # the link generation its sessions were opened on
    draft_stream: int = 0
    resume: Resume | None = None  # what it has produced, once it has committed tokens (preemption resumes there)
    speculation: Speculation | None = None  # its own K policy (the in-process generator's overlap); None: the server's


class Scheduler:
    def __init__(self, target: ServiceLink, draft: ServiceLink | None, eos_token_ids: list[int], max_context: int,
                 speculation: Speculation, max_running: int, max_waiting: int,
                 on_draft_fault: Callable[[BackendError], None] | None = None, grammars: Grammars | None = None,
                 vocab_size: int | None = None):
        self.target, self.draft = target, draft
        self.grammars, self.vocab_size = grammars, vocab_size  # structured outputs (tandem/constraint.py)
        self.eos_token_ids, self.max_context = eos_token_ids, max_context
        self.speculation = speculation
        self.max_running, self.max_waiting = max_running, max_waiting
        self._on_draft_fault = on_draft_fault
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._release_target: list[str] = []
        self._release_draft: list[str] = []
        self._kv_full = False  # the target refused a prefill for KV: admit again once a request ends
        self._changed = threading.Condition()
        self._closed = False
        self.steps = 0  # steps run, and each service's share of them with work: the waves' measure
        self.preempted = 0  # requests preempted for KV (and recomputed)
        self.on_preempt: Callable[[], None] | None = None  # told of each preemption (the metrics)
        self._thread = threading.Thread(target=self._run, name="tandem-scheduler", daemon=True)
        self._thread.start()

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def submit(self, request: GenerationRequest, timeout: float | None = None, has_draft: bool = True,
               probe=None, speculation: Speculation | None = None) -> Handle:
        handle = Handle(timeout)
        with self._changed:
            if self._closed:
                raise Abort(grpc.StatusCode.UNAVAILABLE, "the coordinator's scheduler has stopped")
            if len(self._running) + len(self._waiting) >= self.max_running + self.max_waiting:
                raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"{len(self._running)} requests run and {len(self._waiting)} wait (--max-waiting); "
                            f"retry in {RETRY_AFTER_S}s")
            self._waiting.append(_Request(request, handle, has_draft and self.draft is not None, probe,
                                          speculation=speculation))
            self._changed.notify()
        return handle

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()
        if threading.current_thread() is not self._thread:  # a collector may run a finalizer on any thread
            self._thread.join(5.0)
        self.target.close()
        if self.draft is not None:
            self.draft.close()

    # -- the loop -------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._changed:
                while not (self._running or self._waiting or self._release_target or self._release_draft
                       or self._closed):
                    self._changed.wait()
                if self._closed:
                    break
                self._admit()
            try:
                self._step()
            except Exception:
                log.exception("a scheduler step failed")
                for r in list(self._running):
                    self._end(r, BackendError("target", grpc.StatusCode.INTERNAL, "the coordinator failed a step"))
        for r in [*self._running, *self._waiting]:
            r.handle.put(Abort(grpc.StatusCode.UNAVAILABLE, "the coordinator is shutting down"))
        for r in list(self._running):
            self._end(r)  # an engine in this process keeps its sessions until told (a service's stream ends)

    def _admit(self) -> None:
        """Waiting requests into the running table, oldest first (the lock held)."""
        while self._waiting and len(self._running) < self.max_running and not self._kv_full:
            r = self._waiting.popleft()
            if r.handle.cancelled:
                r.handle.put(_END)
                continue
            r.sessions = Sessions(want_timing=r.probe is not None)
            r.loop = rounds(r.generation, self.eos_token_ids, r.has_draft, r.sessions, self.max_context,
                            r.speculation or self.speculation, r.resume, self.grammars, self.vocab_size)
            self._running.append(r)
            self._advance(r, None)

    def _step(self) -> None:
        now = time.monotonic()
        for r in list(self._running):
            if r.handle.cancelled:
                self._end(r)
            elif r.handle.deadline is not None and now >= r.handle.deadline:
                self._end(r, Abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed"))
            elif r.target_stream and r.target_stream != self.target.generation:
                self._end(r, BackendError("target", grpc.StatusCode.UNAVAILABLE, "the target's stream broke"))
            elif r.draft_stream and r.sessions.draft and r.draft_stream != self.draft.generation:
                r.sessions.draft = r.sessions.draft_alive = False  # its draft session went with the stream
        batch = self._schedule()
        target_steps = [s for r in batch for s in r.steps if not is_draft_step(s)]
        draft_steps = [s for r in batch for s in r.steps if is_draft_step(s)]
        if not target_steps and not draft_steps and not self._release_target and not self._release_draft:
            return
        self.steps += 1
        drafting = {id(r) for r in batch if any(is_draft_step(s) for s in r.steps)}
        for r in batch:  # a multi-token decode would hold the others back (its own draft step, beside it, not)
            if self._waiting or drafting - {id(r)}:
                for s in r.steps:
                    if isinstance(s, Verify) and s.decode > 1:
                        s.decode, s.stop_ids = 1, ()
        sent_target = bool(target_steps or self._release_target)
        if sent_target:
            self.target.send(target_steps, self._release_target)
            self._release_target = []
        sent_draft = self.draft is not None and bool(draft_steps or self._release_draft)
        if sent_draft:
            self.draft.send(draft_steps, self._release_draft)
            self._release_draft = []
        for r in batch:
            for s in r.steps:
                if isinstance(s, Prefill):
                    r.target_stream = self.target.generation
                elif isinstance(s, Propose) and s.open:
                    r.draft_stream = self.draft.generation if self.draft is not None else 0
            if r.probe is not None:
                r.probe.steps_sent(r.steps, (self.target, self.draft))
        answers: dict[int, object] = {}
        self._wire: dict[int, object] = {}  # the step's answer as it came, for a profiled request
        if sent_target:
            answers.update(zip(map(id, target_steps), self._target_results(target_steps), strict=True))
        if draft_steps or sent_draft:
            answers.update(zip(map(id, draft_steps), self._draft_results(draft_steps, sent_draft), strict=True))
        refused: list[_Request] = []
        for r in batch:
            results = [answers[id(s)] for s in r.steps]
            if r.probe is not None:
                r.probe.steps_received(r.steps, self._wire, (self.target, self.draft))
            if _kv_taken(results) and len(self._running) > 1:
                if isinstance(r.steps[0], Prefill):  # back to the front of the queue
                    self._preempt(r)
                else:
                    refused.append(r)  # its steps go again once there is room
                continue
            r.steps = []
            self._advance(r, results)
        for r in refused:
            self._make_room(r)

    def _schedule(self) -> list[_Request]:
        """The requests whose steps go this step, two waves kept (the module's docstring)."""
        ready = [r for r in self._running if r.steps]
        drafting = [r for r in ready if all(is_draft_step(s) for s in r.steps)]
        verifying = [r for r in ready if r not in drafting and r.sessions.draft_alive]
        held: list[_Request] = []
        if len(drafting) > len(verifying) + 1:
            held = drafting[len(drafting) - (len(drafting) - len(verifying)) // 2:]
        elif len(verifying) > len(drafting) + 1:
            held = verifying[len(verifying) - (len(verifying) - len(drafting)) // 2:]
        return [r for r in ready if r not in held]

    def _target_results(self, steps: list) -> list:
        out = []
        for step, answer in zip(steps, self.target.receive(), strict=True):
            if isinstance(answer, BaseException) or self.target.typed:  # an engine's results need no unpacking
                out.append(answer)
            elif isinstance(step, Prefill):
                out.append(convert.prefilled_from_pb(answer))
            else:
                out.append(convert.verified_from_pb(answer))
            self._wire[id(step)] = answer
        return out

    def _draft_results(self, steps: list, sent: bool) -> list:
        if not sent:  # no draft service (it is down)
            return [DraftUnavailable("the draft service is down")] * len(steps)
        answers = self.draft.receive()
        if steps and all(isinstance(a, BackendError) for a in answers) and self._on_draft_fault is not None \
                and len({a.code for a in answers}) == 1 and answers[0].code != grpc.StatusCode.INVALID_ARGUMENT:
            self._on_draft_fault(answers[0])  # the whole batch failed: the draft may be gone
        out = []
        for step, answer in zip(steps, answers, strict=True):
            if isinstance(answer, BaseException):
                out.append(DraftUnavailable(str(answer)))
            self._wire[id(step)] = answer
            if isinstance(answer, BaseException):
                pass
            elif self.draft.typed:
                out.append(answer)
            elif isinstance(step, Propose):
                # q and a tree's parents (wire values: tandem/convert.py) go to the target as they came
                out.append(Drafts(answer.drafts, list(answer.q) or None, list(answer.parents) or None))
            else:
                out.append(convert.branches_from_pb(answer.branches))
        return out

    def _make_room(self, r: _Request) -> None:
        """A verify of `r` the KV budget refused: preempt the newest running request (`r` itself if it is
        the newest, or if an ahead went beside its verify); else `r`'s steps go again at the next step."""
        if r not in self._running:  # preempted already, for another's room
            return
        # an ahead beside the verify has fed the draft already: that request cannot send its steps again
        victim = self._running[-1] if len(r.steps) == 1 else r
        self.preempted += 1
        if self.on_preempt is not None:
            self.on_preempt()
        self._preempt(victim)

    def _preempt(self, r: _Request) -> None:
        """Back to the front of the queue, its sessions released (a prefill the KV budget refused, or a
        preempted request): admitted again once a request has finished, it prefills its prompt and what it
        has produced (Resume)."""
        r.loop.close()
        self._running.remove(r)
        if r.sessions.target:
            self._release_target.append(r.sessions.session_id)
        if r.sessions.draft:
            self._release_draft.append(r.sessions.session_id)
        r.sessions.target = r.sessions.draft = False
        r.steps = []
        with self._changed:
            self._kv_full = True
            self._waiting.appendleft(r)

    def _advance(self, r: _Request, results: list | None) -> None:
        """Hand a request its results; run its coroutine to its next steps, putting out its tokens."""
        try:
            item = r.loop.send(results)
            while isinstance(item, RoundEvent):  # its stats as of now: the loop goes on counting in them
                r.handle.put(dataclasses.replace(item, stats=copy.deepcopy(item.stats)))
                if r.resume is None:
                    r.resume = Resume([], item.stats)
                r.resume.tokens += item.new_tokens
                r.resume.stats = item.stats
                if r.probe is not None:  # a profiled request's round ends as it commits (the next one may go out now)
                    r.probe.round_done(len(item.new_tokens))
                item = r.loop.send(None)
            r.steps = item
        except StopIteration:
            self._end(r)
            return
        except Exception as exc:  # noqa: BLE001 - a target step failed: the request ends with it
            self._end(r, exc)
            return
        if r.sessions.draft and not r.sessions.draft_alive:  # lost or shed: its draft KV is freed now
            self._release_draft.append(r.sessions.session_id)
            r.sessions.draft = False

    def _end(self, r: _Request, error: BaseException | None = None) -> None:
        if r.loop is not None:
            r.loop.close()
        if r in self._running:
            self._running.remove(r)
        if r.sessions.target:
            self._release_target.append(r.sessions.session_id)
        if r.sessions.draft:
            self._release_draft.append(r.sessions.session_id)
        r.sessions.target = r.sessions.draft = False
        if self.target.typed:  # engines in this process (no batch in flight now): freed before the end is told
            self._flush_releases()
        r.handle.put(error if error is not None else _END)
        with self._changed:
            self._kv_full = False

    def _flush_releases(self) -> None:
        """Send the releases gathered so far on their own, now (a service's go with the next step's batch)."""
        for link, releases in ((self.target, self._release_target), (self.draft, self._release_draft)):
            if link is not None and releases:
                link.send([], list(releases))
                link.receive()
                releases.clear()


def _kv_taken(results: list) -> bool:
    """Whether a step's answer is the target's KV budget refusing it for now (not for good)."""
    return bool(results) and isinstance(results[0], BackendError) and \
        results[0].code == grpc.StatusCode.RESOURCE_EXHAUSTED and "is taken" in results[0].details


def pack_target(steps, releases) -> target_pb2.TargetBatch:
    return target_pb2.TargetBatch(steps=[convert.target_step_to_pb(s) for s in steps], release=releases)


def pack_draft(steps, releases) -> draft_pb2.DraftBatch:
    return draft_pb2.DraftBatch(steps=[convert.draft_step_to_pb(s) for s in steps], release=releases)
