"""What the coordinator observes of one generation: its Prometheus metrics, and, when the request
asks for it (GenerateRequest.profile), its profile: per round, what crossed each link and where the
time went, joined from the coordinator's own clock and the StepTiming the services return.

    probe = RequestProbe(request, ...) if request.profile else None
    observer = RequestObserver(metrics, probe, prompt_tokens)
    scheduler.submit(request, ..., probe)   # the scheduler reports each step's messages
    for delta in observer.deltas(text_deltas(observer.rounds(handle.events()), ...)): ...
    probe.to_client(response, last)                              # counts it; the last one gets the profile

The probe counts messages at the coordinator's end of each link with ByteSize(), the serialized size
the sender counted too (tandem/traffic.py); only profiled requests pay for that extra serialization.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from tandem import convert
from tandem.dtypes import ITEMSIZE
from tandem.metrics import CoordinatorMetrics
from tandem.rounds import RoundEvent, is_draft_step
from tandem.text import TextDelta
from tandem.traffic import GRPC, LinkCount, Parts, parts_of
from tandem.v1 import coordinator_pb2, draft_pb2, profile_pb2, target_pb2

TO_CLIENT, FROM_CLIENT = "coordinator->client", "client->coordinator"
TO_TARGET, FROM_TARGET = "coordinator->target", "target->coordinator"
TO_DRAFT, FROM_DRAFT = "coordinator->draft", "draft->coordinator"
DIRECT = "target->draft"  # a fast path's features, counted from their descriptors (FeatureRef)


@dataclass
class _Round:
    index: int
    start_ns: int
    end_ns: int = 0
    draft_sent_ns: int = 0
    draft_received_ns: int = 0
    target_sent_ns: int = 0
    target_received_ns: int = 0
    draft: profile_pb2.StepTiming | None = None
    target: profile_pb2.StepTiming | None = None
    ahead_sent_ns: int = 0
    ahead_received_ns: int = 0
    ahead: profile_pb2.StepTiming | None = None
    verified_drafts: int = 0  # drafts sent with the verify
    num_drafts: int = 0
    num_accepted: int = 0
    num_tokens: int = 0
    links: dict[str, LinkCount] = field(default_factory=dict)

    def to_pb(self, transport: str, steps: dict[str, str]) -> profile_pb2.RoundProfile:
        """`transport`: the features' path target -> draft; `steps`: what each step link went by (unix, grpc)."""
        msg = profile_pb2.RoundProfile(
            index=self.index, start_ns=self.start_ns, end_ns=self.end_ns,
            draft_sent_ns=self.draft_sent_ns, draft_received_ns=self.draft_received_ns,
            target_sent_ns=self.target_sent_ns, target_received_ns=self.target_received_ns,
            num_drafts=self.num_drafts, num_accepted=self.num_accepted, num_tokens=self.num_tokens,
            ahead_sent_ns=self.ahead_sent_ns, ahead_received_ns=self.ahead_received_ns,
            overlap_hit=self.verified_drafts > 0 and not self.draft_sent_ns,
        )
        if self.ahead is not None:
            msg.ahead.CopyFrom(self.ahead)
        if self.draft is not None:
            msg.draft.CopyFrom(self.draft)
        if self.target is not None:
            msg.target.CopyFrom(self.target)
        for link, count in self.links.items():  # features go by the fast path, the steps by their links
            msg.traffic.append(profile_pb2.LinkTraffic(
                link=link, transport=transport if link == DIRECT else steps.get(link, GRPC), messages=count.messages,
                bytes=count.bytes,
                token_ids=count.token_ids, feature_rows=count.feature_rows,
            ))
        return msg


class RequestProbe:
    """One generation's profile: the scheduler reports its steps' messages and its rounds' ends, the request's
    handler its answers to the client."""

    def __init__(
        self,
        request: coordinator_pb2.GenerateRequest,
        target_info: target_pb2.TargetInfo | None = None,
        draft_info: draft_pb2.DraftInfo | None = None,
        transport: str = GRPC,
    ):
        now = time.monotonic_ns()
        self.transport = transport
        self.steps: dict[str, str] = {}  # link -> what the scheduler's steps go by (coordinator/links.py)
        self.profile = profile_pb2.RequestProfile(start_ns=now, transport=transport)
        if target_info is not None:
            self.profile.target_hidden_size = target_info.hidden_size
            self.profile.target_dtype = target_info.dtype
            self.profile.target_device = target_info.device
        if draft_info is not None:
            self.profile.draft_device = draft_info.device
        self._rounds: list[_Round] = []
        self._open: _Round | None = None
        self._finished = False
        self._in_ahead = False  # messages to the draft belong to an ahead step until its answer
        self.received(FROM_CLIENT, request)

    def _round(self) -> _Round:
        """The round in progress; a message after the last round ended opens the next one."""
        if self._open is None:
            start = self._rounds[-1].end_ns if self._rounds else self.profile.start_ns
            self._open = _Round(index=len(self._rounds), start_ns=start)
            self._rounds.append(self._open)
        return self._open

    @staticmethod
    def _count(r: _Round, link: str, msg) -> None:
        r.links.setdefault(link, LinkCount()).add(msg.ByteSize(), parts_of(msg))

    def steps_sent(self, steps, links) -> None:
        """The scheduler sent this request's steps over `links` (the target's, the draft's or None), each
        stamped when its link sent it."""
        for link in links:
            if link is not None:  # what its steps went by, both ways
                self.steps[f"coordinator->{link.service}"] = self.steps[f"{link.service}->coordinator"] = link.transport
        target, draft = links
        for s in steps:
            if is_draft_step(s):
                self.sent(TO_DRAFT, convert.draft_step_to_pb(s).request, _stamp(draft, "sent_ns"))
            else:
                self.sent(TO_TARGET, convert.target_step_to_pb(s).request, _stamp(target, "sent_ns"))

    def steps_received(self, steps, wire: dict[int, object], links=(None, None)) -> None:
        """Their answers as they came (`wire`: by id of the step; an error is not counted), each stamped when
        its link (target's, draft's) read it: a verify's answer that came while an ahead still ran is not
        counted as waited for."""
        target, draft = links
        for s in steps:
            answer = wire.get(id(s))
            if answer is not None and not isinstance(answer, BaseException):
                if is_draft_step(s):
                    self.received(FROM_DRAFT, answer, _stamp(draft, "received_ns"))
                else:
                    self.received(FROM_TARGET, answer, _stamp(target, "received_ns"))

    def sent(self, link: str, msg, at: int | None = None) -> None:
        """A message the coordinator hands to gRPC for the target or the draft (`at`: when, else now)."""
        now = at or time.monotonic_ns()
        r = self._round()
        self._count(r, link, msg)
        if link == TO_TARGET and msg.WhichOneof("step") is not None:
            r.target_sent_ns = now
            if msg.WhichOneof("step") == "verify":
                r.verified_drafts = len(msg.verify.drafts)
        elif link == TO_DRAFT and msg.HasField("ahead"):
            r.ahead_sent_ns, self._in_ahead = now, True
        elif link == TO_DRAFT and not r.draft_sent_ns and not self._in_ahead:
            r.draft_sent_ns = now  # the propose's first message; further ones are feature chunks

    def received(self, link: str, msg, at: int | None = None) -> None:
        """A message from the client, the target or the draft (`at`: when it came, else now)."""
        now = at or time.monotonic_ns()
        r = self._round()
        self._count(r, link, msg)
        if link == FROM_TARGET and msg.HasField("features") and msg.features.WhichOneof("payload") == "ref":
            ref = msg.features.ref  # the rows went target -> draft by the fast path: what crossed there
            rows = Parts(features=ref.rows * ref.width * ITEMSIZE.get(ref.dtype, 0), feature_rows=ref.rows)
            r.links.setdefault(DIRECT, LinkCount()).add(rows.features, rows)
        if link == FROM_TARGET and msg.WhichOneof("result") is not None:
            r.target_received_ns = now
            if msg.HasField("timing"):
                r.target = msg.timing
            if msg.WhichOneof("result") == "verified":
                r.num_accepted = len(msg.verified.accepted)
        elif link == FROM_DRAFT and self._in_ahead:
            r.ahead_received_ns, self._in_ahead = now, False
            if msg.HasField("timing"):
                r.ahead = msg.timing
        elif link == FROM_DRAFT:
            r.draft_received_ns = now
            r.num_drafts = len(msg.drafts)
            if msg.HasField("timing"):
                r.draft = msg.timing

    def round_done(self, num_tokens: int) -> None:
        """The round's tokens went to the client: the round ends here."""
        if self._finished or self._open is None:
            return
        self._open.end_ns = time.monotonic_ns()
        self._open.num_tokens = num_tokens
        self._open = None

    def to_client(self, msg: coordinator_pb2.GenerateResponse, last: bool) -> None:
        """Count an answer to the client; the last one ends the profile and carries it."""
        if self._finished:
            return
        if self._open is None and last and self._rounds:
            r = self._rounds[-1]  # unary Generate answers once, after its last round ended
        else:
            r = self._round()
        self._count(r, TO_CLIENT, msg)
        if not last:
            return
        now = time.monotonic_ns()
        if self._open is not None:  # streaming: the last round ends with this message
            self._open.end_ns = now
            self._open.num_tokens = len(msg.token_ids)
            self._open = None
        self._finished = True
        self.profile.end_ns = now
        self.profile.rounds.extend(r.to_pb(self.transport, self.steps) for r in self._rounds)
        msg.profile.CopyFrom(self.profile)


class RequestObserver:
    """Feeds the coordinator's metrics from one generation's round events and deltas (the scheduler ends
    a profile's rounds as they commit)."""

    def __init__(
        self,
        metrics: CoordinatorMetrics | None,
        probe: RequestProbe | None,
        prompt_tokens: int,
        client_active: Callable[[], bool] = lambda: True,
    ):
        self.metrics = metrics
        self.probe = probe
        self.client_active = client_active  # a failure after the client left is an abort, not an error
        self.start = time.monotonic()
        self._seen = (0, 0, 0, [])  # rounds, draft tokens, accepted, accepted per position
        self._without = 0  # rounds without a draft (it was lost)
        if metrics is not None:
            metrics.prompt_tokens.inc(prompt_tokens)

    def rounds(self, events: Iterator[RoundEvent]) -> Iterator[RoundEvent]:
        """The speculative-decoding counters, as each round commits (stats are cumulative)."""
        m = self.metrics
        try:
            for event in events:
                if m is not None:
                    s = event.stats
                    rounds, drafted, accepted, per_pos = self._seen
                    if s.accepted_per_position:  # a speculative request: each verify round with drafts
                        without = getattr(s, "num_rounds_without_draft", 0)  # the draft was lost
                        m.num_drafts.inc(s.num_rounds - rounds - (without - self._without))
                        self._without = without
                        m.draft_positions(len(s.accepted_per_position))
                    m.num_draft_tokens.inc(s.num_draft_tokens - drafted)
                    m.num_accepted_tokens.inc(s.num_accepted_tokens - accepted)
                    for position, n in enumerate(s.accepted_per_position):
                        before = per_pos[position] if position < len(per_pos) else 0
                        if n > before:
                            m.accepted_per_pos.labels(str(position)).inc(n - before)
                    self._seen = (s.num_rounds, s.num_draft_tokens, s.num_accepted_tokens,
                                  list(s.accepted_per_position))
                yield event
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()

    def deltas(self, deltas: Iterator[TextDelta]) -> Iterator[TextDelta]:
        """Latencies and finish reasons."""
        m = self.metrics
        reason = "abort"  # the client went away (or its deadline passed) before the end
        last = self.start
        first = True
        if m is not None:
            m.running.inc()
        try:
            for delta in deltas:
                now = time.monotonic()
                if m is not None:
                    n = len(delta.token_ids)
                    m.generation_tokens.inc(n)
                    m.round.observe(now - last)
                    if first:
                        m.ttft.observe(now - self.start)
                    elif n:
                        m.itl.observe((now - last) / n)
                first, last = False, now
                if delta.finish_reason is not None:
                    reason = delta.finish_reason
                yield delta
        except GeneratorExit:
            raise
        except BaseException:
            if reason == "abort" and self.client_active():
                reason = "error"
            raise
        finally:
            if m is not None:
                m.running.dec()
                m.success.labels(reason).inc()
                m.e2e.observe(time.monotonic() - self.start)
            close = getattr(deltas, "close", None)
            if close is not None:
                close()


def _stamp(link, name: str) -> int | None:
    """The link's time of its last send or answer (ServiceLink), or None (now) for one that keeps none."""
    return getattr(link, name, None) or None
