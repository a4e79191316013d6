"""gRPC implementations of TargetBackend and DraftBackend (tandem/protocol.py) for the round loop.

One object per generation: it opens one bidirectional stream to its service and sends one step
per round on it, so a round costs one message each way and no per-call set-up. Closing the stream
releases the session on the service; cancelling it (client cancel, deadline) does the same.

Features are relayed, never decoded: the target's feature chunks are read off its stream lazily
(RelayedFeatures) and forwarded to the draft chunk by chunk, so the coordinator holds one chunk
at a time and the draft receives the first rows while the last are still on their way.

A draft step has a deadline of its own (--draft-timeout): a draft that dies, hangs or fails raises
DraftUnavailable, and the round loop finishes the generation target-only.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import grpc

from tandem.convert import (
    branches_from_pb,
    draft_probs_to_pb,
    logprobs_from_pb,
    sampling_to_pb,
    tree_to_pb,
)
from tandem.params import SamplingParams, TreeParams
from tandem.protocol import Branch, DraftProbs, Drafts, DraftUnavailable, PrefillResult, VerifyResult
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tandem.wire import is_last_chunk

if TYPE_CHECKING:
    from coordinator.cohorts import CohortLink
    from coordinator.probe import RequestProbe
    from coordinator.relay import CohortRelay

_CLOSE = object()
# when each service last answered a step (time.monotonic(), by service name): the health monitor keeps a
# service whose checks come back late while its steps still do (a busy host) up (coordinator/monitor.py)
last_answer: dict[str, float] = {}


class BackendError(Exception):
    """A target or draft service failed a step; carries its status code to pass on to the client."""

    def __init__(self, service: str, code: grpc.StatusCode, details: str):
        super().__init__(f"{service} service: {details}")
        self.service = service
        self.code = code
        self.details = details


# How long closing a session stream may wait for the service to end it before cancelling the call.
CLOSE_GRACE_S = 5.0


class _Watchdog:
    """Cancels streams whose answer is overdue: one thread for all of them, instead of a timer per step."""

    def __init__(self):
        self._due: list[tuple[float, int, _Stream]] = []  # heap of (deadline, arm id, stream)
        self._armed: dict[_Stream, int] = {}  # the stream's current arm id; older heap entries are stale
        self._ids = itertools.count()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def arm(self, stream: _Stream, seconds: float) -> None:
        with self._changed:
            arm_id = next(self._ids)
            self._armed[stream] = arm_id
            heapq.heappush(self._due, (time.monotonic() + seconds, arm_id, stream))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tandem-watchdog", daemon=True)
                self._thread.start()
            elif self._due[0][1] == arm_id:  # the new deadline is the earliest: wake the thread for it
                self._changed.notify()

    def disarm(self, stream: _Stream) -> None:
        with self._changed:
            self._armed.pop(stream, None)

    def _run(self) -> None:
        with self._changed:
            while True:
                now = time.monotonic()
                while self._due and (self._due[0][0] <= now or self._armed.get(self._due[0][2]) != self._due[0][1]):
                    _, arm_id, stream = heapq.heappop(self._due)
                    if self._armed.get(stream) == arm_id:
                        del self._armed[stream]
                        stream.expire()
                self._changed.wait(self._due[0][0] - now if self._due else None)


_watchdog = _Watchdog()


class _Stream:
    """A bidirectional call driven step by step: send() queues a message, recv() waits for the next.

    The call starts with the first message: a generation that never drafts (shed by the acceptance
    gate or by load) opens no draft session at all, where opening and cancelling one cost the draft
    and the coordinator a handler thread's work per request (EAGLE-3 at 0.89-0.94x target-only with the
    tiny pair's random head, every request shed)."""

    def __init__(self, service: str, method: Callable, timeout: float | None, probe: RequestProbe | None = None):
        self.service = service
        self.probe = probe  # a profiled request: every message is reported to it
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._method = method
        self._deadline = time.monotonic() + timeout if timeout is not None else None  # the generation's
        self._call = None  # started by the first send()
        self._closed = False
        self.cancelled = False  # by us (cancel()), not by the service or the network
        self._expired = False  # the watchdog cancelled the call: a step's deadline passed

    def send(self, message) -> None:
        if self.probe is not None:
            self.probe.sent(f"coordinator->{self.service}", message)
        self._requests.put(message)
        if self._call is None:
            timeout = max(1e-3, self._deadline - time.monotonic()) if self._deadline is not None else None
            self._call = self._method(iter(self._requests.get, _CLOSE), timeout=timeout)
            if self.cancelled:  # cancel() came while the call started
                self._call.cancel()

    def recv(self, step_timeout: float | None = None):
        """The next message; with `step_timeout`, give up (DEADLINE_EXCEEDED) after that many seconds."""
        if step_timeout is not None:
            _watchdog.arm(self, step_timeout)
        try:
            message = next(self._call)
        except StopIteration:
            raise BackendError(self.service, grpc.StatusCode.INTERNAL, "the session stream ended early") from None
        except grpc.RpcError as exc:
            if self._expired:
                raise BackendError(
                    self.service, grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {step_timeout:g}s"
                ) from None
            raise BackendError(self.service, exc.code(), exc.details() or "") from None
        finally:
            if step_timeout is not None:
                _watchdog.disarm(self)
        last_answer[self.service] = time.monotonic()
        if self.probe is not None:
            self.probe.received(f"{self.service}->coordinator", message)
        return message

    def check_open(self) -> None:
        """For a step sent elsewhere (the cohort relay): fail as this stream's own step would, once the
        generation was cancelled or its deadline passed."""
        if self.cancelled:
            raise BackendError(self.service, grpc.StatusCode.CANCELLED, "the generation was cancelled")
        if self._deadline is not None and time.monotonic() >= self._deadline:
            # the generation's end, not the service's fault: cancelled by us (a draft's DEADLINE_EXCEEDED from
            # elsewhere marks it down: a generation that started then ran target-only, test_services saw it)
            self.cancel()
            raise BackendError(self.service, grpc.StatusCode.DEADLINE_EXCEEDED, "the generation's deadline passed")

    def expire(self) -> None:
        """Called by the watchdog when a step's deadline passed: the waiting recv() fails."""
        self._expired = True
        if self._call is not None:
            self._call.cancel()

    def close(self) -> None:
        """Half-close and wait for the service to end the stream (it has released the session then)."""
        if self._closed:
            return
        self._closed = True
        self._requests.put(_CLOSE)
        if self._call is None:  # never started: nothing to end
            return
        # bounded: a stopped or partitioned service must not hold the generation's handler forever
        _watchdog.arm(self, CLOSE_GRACE_S)
        try:
            for _ in self._call:
                pass
        except grpc.RpcError:
            pass  # cancelled or failed: the service releases the session either way (or its TTL does)
        finally:
            _watchdog.disarm(self)

    def cancel(self) -> None:
        self.cancelled = self._closed = True
        self._requests.put(_CLOSE)
        if self._call is not None:
            self._call.cancel()


class RelayedFeatures:
    """The feature chunks of one target step, as they come off the target's stream.

    The first chunk came with the step's result; iterating yields it and then reads the rest.
    Whatever nobody iterated is read (and dropped) before the next step goes out.
    """

    def __init__(self, first: common_pb2.Features, stream: _Stream):
        self._first: common_pb2.Features | None = first
        self._stream = stream
        self._done = is_last_chunk(first)

    def __iter__(self) -> Iterator[common_pb2.Features]:
        if self._first is None:
            raise RuntimeError("these features have been relayed already")
        first, self._first = self._first, None
        yield first
        while not self._done:
            chunk = self._stream.recv().features
            self._done = is_last_chunk(chunk)
            yield chunk

    def drain(self) -> None:
        self._first = None
        while not self._done:
            self._done = is_last_chunk(self._stream.recv().features)


class GrpcTarget:
    """TargetBackend over one TargetService.Session stream (one generation)."""

    def __init__(
        self,
        stub: target_pb2_grpc.TargetServiceStub,
        eos_token_ids: list[int],
        timeout: float | None,
        probe: RequestProbe | None = None,
        cohorts: CohortLink | None = None,
        relay: CohortRelay | None = None,
        answer_within_ms: int = 0,
    ):
        """`answer_within_ms`: how long a target-only decode may run before answering (0: the target's default)."""
        self.eos_token_ids = eos_token_ids
        self._answer_within_ms = answer_within_ms
        self._stream = _Stream("target", stub.Session, timeout, probe)
        self._features: RelayedFeatures | None = None
        self._cohorts = cohorts  # shared with the generation's GrpcDraft
        # the verifies go by the cohort relay, but not a profiled request's (its traffic is its own)
        self._relay = relay if probe is None else None
        self._session_id = ""

    def _answer(self, expected: str, response: target_pb2.TargetResponse | None = None
                ) -> tuple[target_pb2.TargetResponse, RelayedFeatures | None]:
        if response is None:
            response = self._stream.recv()
        if response.WhichOneof("result") != expected:
            raise BackendError("target", grpc.StatusCode.INTERNAL, f"expected {expected}, got {response}")
        if self._cohorts is not None and response.HasField("batch"):
            self._cohorts.from_target(response.batch.id, response.batch.size)
        features = RelayedFeatures(response.features, self._stream) if response.HasField("features") else None
        self._features = features
        return response, features

    def _drain(self) -> None:
        if self._features is not None:
            self._features.drain()
            self._features = None

    def prefill(
        self,
        session_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        want_features: bool = True,
        max_new_tokens: int | None = None,
        verify_tokens: int | None = None,
    ) -> PrefillResult:
        prefill = target_pb2.Prefill(
            session_id=session_id, prompt_ids=prompt_ids, sampling=sampling_to_pb(params), want_features=want_features,
            want_timing=self._stream.probe is not None, max_new_tokens=max_new_tokens, verify_tokens=verify_tokens,
        )
        self._session_id = session_id
        self._stream.send(target_pb2.TargetRequest(prefill=prefill))
        response, features = self._answer("prefilled")
        return PrefillResult(token=response.prefilled.token, features=features,
                             logprobs=logprobs_from_pb(response.prefilled.logprobs))

    def verify(self, session_id: str, token: int, drafts: list[int], want_features: bool = True,
               q: list[DraftProbs] | None = None, parents: list[int] | None = None, decode: int = 1,
               stop_ids: Sequence[int] = ()) -> VerifyResult:
        self._drain()
        request = target_pb2.TargetRequest(verify=target_pb2.Verify(token=token, drafts=drafts,
                                                                    want_features=want_features,
                                                                    q=draft_probs_to_pb(q), parents=parents,
                                                                    decode=decode if decode > 1 else 0,
                                                                    stop_ids=stop_ids if decode > 1 else (),
                                                                    answer_within_ms=self._answer_within_ms
                                                                    if decode > 1 else 0))
        cohort = None
        if self._cohorts is not None:
            self._cohorts.leave()  # a round without a propose first: this step did not go to the draft
            cohort = self._cohorts.to_target()
            if cohort is not None:
                request.cohort.id, request.cohort.size = cohort
        if self._relay is not None:
            self._stream.check_open()
            response, features = self._answer("verified", self._relay.step(session_id, request, 1 + len(drafts), cohort))
        else:
            self._stream.send(request)
            response, features = self._answer("verified")
        verified = response.verified
        return VerifyResult(accepted=list(verified.accepted), bonus=verified.bonus, features=features,
                            logprobs=logprobs_from_pb(verified.logprobs), warming=verified.warming)

    def release(self, session_id: str) -> bool:
        if self._cohorts is not None:
            self._cohorts.leave()
        if self._relay is not None:
            self._relay.forget(self._session_id)
        self._stream.close()
        return True

    def cancel(self) -> None:
        if self._cohorts is not None:
            self._cohorts.leave()
        self._stream.cancel()


class GrpcDraft:
    """DraftBackend over one DraftService.Session stream (one generation).

    A step gets `step_timeout` seconds to answer. A failed step (the service died, hung past the
    deadline, or answered with an error) cancels the stream, tells `on_fault` (the coordinator's
    health monitor) unless we cancelled it ourselves, and raises DraftUnavailable.
    """

    def __init__(
        self,
        stub: draft_pb2_grpc.DraftServiceStub,
        timeout: float | None,
        step_timeout: float | None = None,
        on_fault: Callable[[BackendError], None] | None = None,
        probe: RequestProbe | None = None,
        cohorts: CohortLink | None = None,
        relay: CohortRelay | None = None,
    ):
        self._stream = _Stream("draft", stub.Session, timeout, probe)
        self._step_timeout = step_timeout
        self._on_fault = on_fault
        self._cohorts = cohorts  # shared with the generation's GrpcTarget
        # later chain proposes go by the cohort relay, until an ahead step: the stream keeps those in order
        self._relay = relay if probe is None else None
        self._session_id = ""  # the session its stream opened

    def propose(
        self,
        session_id: str,
        features: RelayedFeatures,
        next_tokens: list[int],
        num_draft_tokens: int,
        create: bool = False,
        sampling: SamplingParams | None = None,
        tree: TreeParams | None = None,
    ) -> Drafts:
        cohort = self._cohorts.to_draft() if self._cohorts is not None else None
        if self._relay is not None and not create and tree is None:
            chunks = list(features)
            if len(chunks) == 1:
                return self._relayed(session_id, chunks[0], next_tokens, num_draft_tokens, cohort)
            features = chunks
        self._session_id = session_id
        first = True
        for chunk in features:
            request = draft_pb2.DraftRequest(features=chunk)
            if first:
                request.next_tokens.extend(next_tokens)
                request.num_draft_tokens = num_draft_tokens
                if create:
                    request.session_id = session_id
                    request.want_timing = self._stream.probe is not None
                    if sampling is not None:
                        request.sampling.CopyFrom(sampling_to_pb(sampling))
                if cohort is not None:
                    request.cohort.id, request.cohort.size = cohort
                if tree is not None:
                    request.tree.CopyFrom(tree_to_pb(tree))
                first = False
            self._stream.send(request)
        return self._drafts(self._answer())

    def _relayed(self, session_id: str, chunk: common_pb2.Features, next_tokens: list[int], k: int,
                 cohort: tuple[int, int] | None) -> Drafts:
        request = draft_pb2.DraftRequest(features=chunk, next_tokens=next_tokens, num_draft_tokens=k)
        try:
            self._stream.check_open()
            response = self._relay.step(session_id, request, len(next_tokens) + k, cohort)
        except BackendError as exc:
            return self._failed(exc)
        return self._drafts(response)

    def _drafts(self, response: draft_pb2.DraftResponse) -> Drafts:
        if self._cohorts is not None and response.HasField("batch"):
            self._cohorts.from_draft(response.batch.id, response.batch.size)
        # q and a tree's parents (wire values: tandem/convert.py) are relayed to the target as they came
        return Drafts(response.drafts, list(response.q) or None, list(response.parents) or None)

    def ahead(
        self,
        session_id: str,
        features: RelayedFeatures | None,
        next_tokens: list[int],
        drafts: list[int],
        num_draft_tokens: int,
        branches: int,
    ) -> _PendingAhead:
        """Send an ahead step and return at once: the answer is read when the verify has answered."""
        self._relay = None  # from here on every step goes on the stream, in order with the aheads
        if self._cohorts is not None:
            self._cohorts.leave()
        ahead = draft_pb2.Ahead(assumed=drafts, branches=branches)
        head = draft_pb2.DraftRequest(next_tokens=next_tokens, num_draft_tokens=num_draft_tokens, ahead=ahead)
        if not next_tokens or features is None:
            del head.next_tokens[:]
            self._stream.send(head)
        else:
            for chunk in features:
                request = head if head is not None else draft_pb2.DraftRequest()
                request.features.CopyFrom(chunk)
                self._stream.send(request)
                head = None
        return _PendingAhead(self)

    def _answer(self) -> draft_pb2.DraftResponse:
        try:
            return self._stream.recv(self._step_timeout)
        except BackendError as exc:
            return self._failed(exc)

    def _failed(self, exc: BackendError):
        ours = self._stream.cancelled
        self._stream.cancel()
        if self._on_fault is not None and not ours:
            self._on_fault(exc)
        raise DraftUnavailable(str(exc)) from exc

    def release(self, session_id: str) -> bool:
        if self._relay is not None:
            self._relay.forget(self._session_id)  # the coordinator releases with no id: the one it opened
        self._stream.close()
        return True

    def cancel(self) -> None:
        self._stream.cancel()


class _PendingAhead:
    """An ahead step on the draft stream: result() reads its answer (the stream keeps steps in order)."""

    def __init__(self, draft: GrpcDraft):
        self._draft = draft

    def result(self) -> list[Branch]:
        return branches_from_pb(self._draft._answer().branches)
