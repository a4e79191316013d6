"""What the coordinator does for one client request, whatever API it came through (gRPC here, the
OpenAI HTTP front too): admit it, fit it to the pair of services, run the round loop (tandem/rounds.py)
over one session stream to each service, detokenize and apply stop strings (tandem/text.py).

No protobuf of the client API and no torch here: requests arrive as a GenerationRequest.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc

from coordinator.backends import CLOSE_GRACE_S, BackendError, GrpcDraft, GrpcTarget
from coordinator.cohorts import CohortLink, Cohorts
from coordinator.monitor import LATE_PATIENCE_S, Monitor, Pair
from coordinator.probe import RequestObserver, RequestProbe
from coordinator.relay import CohortRelay, draft_relay, target_relay
from tandem.config import CoordinatorSettings
from tandem.errors import Abort, InvalidRequest, OutOfRange
from tandem.gates import AcceptanceGate, TreeGate
from tandem.metrics import CoordinatorMetrics
from tandem.params import MAX_STOP_LENGTH, MAX_STOP_STRINGS, GenerationRequest, parse_tree
from tandem.policy import Speculation, adaptive_k
from tandem.rounds import run_rounds
from tandem.service import Service
from tandem.text import TextDelta, text_deltas

log = logging.getLogger("tandem.coordinator")

# A target step that failed with one of these did not fail for this request's sake: the service is
# gone or going, and the client hears UNAVAILABLE (retry later) rather than the transport's detail.
TARGET_LOST = (
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED,
)
# A target-only decode of a client that reads the answer at the end (Generate, not GenerateStream) answers the
# coordinator after this long, not the target's 50 ms for a stream: a round trip a quarter second instead of
# one every 50 ms (Verify.answer_within_ms).
UNARY_ANSWER_WITHIN_MS = 250


@dataclass
class ClientRequest:
    """A request as a client API hands it over: the generation, its stop strings, and whether the
    client set max_new_tokens (an unset one shrinks to what fits the context instead of failing)."""

    generation: GenerationRequest
    stop: Sequence[str] = ()
    max_new_tokens_given: bool = True
    include_stop_str: bool = False  # the text ends after the stop string rather than before it
    skip_special_tokens: bool = True  # BOS, EOS and the like left out of the text


@dataclass
class Call:
    """The client's side of a running request: its deadline, whether it is still there, and how to
    learn that it went away (a cancel frees both services' sessions at once)."""

    timeout: float | None = None
    is_active: Callable[[], bool] = lambda: True
    on_cancel: Callable[[Callable[[], None]], object] = lambda cancel: None
    streamed: bool = True  # the client reads the tokens as they come (else the answer at the end)


def fit_to_pair(client: ClientRequest, pair: Pair) -> GenerationRequest:
    """InvalidRequest / OutOfRange naming what is wrong: nothing a model could choke on gets past here."""
    request, vocab_size, max_context = client.generation, pair.target_info.vocab_size, pair.target_info.max_context
    for what, ids in (("prompt_ids", request.prompt_ids), ("stop_token_ids", request.stop_token_ids)):
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise InvalidRequest(f"{what} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    n = len(request.prompt_ids)
    if n >= max_context:
        raise OutOfRange(f"the prompt has {n} tokens; the model's context is {max_context} tokens")
    if n + request.max_new_tokens > max_context:
        if client.max_new_tokens_given:
            raise OutOfRange(
                f"the prompt has {n} tokens and max_new_tokens is {request.max_new_tokens}: "
                f"{n + request.max_new_tokens} is past the model's context of {max_context} tokens"
            )
        request = request.model_copy(update={"max_new_tokens": max_context - n})  # what fits (as vLLM does)
    check_stop_strings(client.stop, pair.tokenizer is not None)
    return request


def check_stop_strings(stop: Sequence[str], has_tokenizer: bool) -> None:
    if not stop:
        return
    if not has_tokenizer:
        raise InvalidRequest("stop strings need a tokenizer and the target has none: use stop_token_ids")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for i, text in enumerate(stop):
        if not text:
            raise InvalidRequest(f"stop[{i}] is empty")
        if len(text) > MAX_STOP_LENGTH:
            raise InvalidRequest(f"stop[{i}] has {len(text)} characters; at most {MAX_STOP_LENGTH}")


class Generations:
    """The coordinator's generations: one server-wide K policy (adaptive K, the acceptance gate,
    overlap) and cohort table, and the services as the monitor last saw them."""

    def __init__(self, service: Service):
        self.service = service
        self.settings: CoordinatorSettings = service.settings
        self.monitor: Monitor | None = None
        self.metrics = CoordinatorMetrics(service.registry)
        self.cohorts = Cohorts()
        self._relays: dict[str, tuple[tuple, CohortRelay]] = {}  # service -> (what it was made for, it)
        self._relays_lock = threading.Lock()
        settings, running = self.settings, service.admission
        budget, cost = settings.spec_token_budget, settings.spec_draft_cost
        self.speculation = Speculation(
            k_for=adaptive_k(budget, lambda: running.active) if budget else None,
            gate=AcceptanceGate(cost) if cost else None,  # one for the server: it learns from every request
            overlap=settings.overlap,
            overlap_sampled=settings.overlap_sampled,
            branches=settings.overlap_branches,
            overlap_while=lambda: running.active <= settings.overlap_max_running,
            trees=TreeGate() if settings.tree_policy else None,
            fits=(lambda width: running.active * width <= budget) if budget else None,
            default_tree=parse_tree(settings.tree) if settings.tree else None,
            decode_steps=settings.decode_steps,
        )

    def attach(self, monitor: Monitor) -> None:
        self.monitor = monitor

    def relay(self, pair: Pair, service: str) -> CohortRelay | None:
        """The cohort relay to this pair's target or draft (--cohort-relay), made again when the service changed."""
        if not self.settings.cohort_relay:
            return None
        stub, info = (pair.target, pair.target_info) if service == "target" else (pair.draft, pair.draft_info)
        made_for = (stub, info.dtype, info.hidden_size if service == "target" else info.target_hidden_size)
        with self._relays_lock:
            current = self._relays.get(service)
            if current is None or current[0] != made_for:
                if current is not None:
                    current[1].close()
                mib = self.settings.max_message_mib
                relay = (target_relay(stub, info, mib) if service == "target"
                         else draft_relay(stub, info, mib, self.settings.draft_timeout))
                current = self._relays[service] = (made_for, relay)
            return current[1]

    def pair(self, patience: float = 0.0) -> Pair:
        """The services for a new generation (Monitor.pair: `patience` for a target down for late checks)."""
        if self.monitor is None:
            raise Abort(grpc.StatusCode.UNAVAILABLE, "the coordinator is still connecting to its services")
        return self.monitor.pair(patience)

    def stream(
        self, build: Callable[[Pair], ClientRequest], call: Call, probe: RequestProbe | None = None
    ) -> Iterator[TextDelta]:
        """Admit the request, build it against the services (tokenizer, context), and stream its deltas."""
        with self.service.admission.admit():
            pair = self.pair(LATE_PATIENCE_S)
            client = build(pair)
            request = fit_to_pair(client, pair)
            link = CohortLink(self.cohorts)  # the batch of each step goes along to the next service
            target = GrpcTarget(pair.target, list(pair.target_info.eos_token_ids), call.timeout, probe=probe,
                                cohorts=link, relay=self.relay(pair, "target"),
                                answer_within_ms=0 if call.streamed else UNARY_ANSWER_WITHIN_MS)
            draft = None
            if pair.draft is not None and request.speculate:  # no draft (or it is down): target-only
                draft = GrpcDraft(pair.draft, call.timeout, step_timeout=self.settings.draft_timeout,
                                  on_fault=lambda error: self.monitor.fault("draft", error), probe=probe, cohorts=link,
                                  relay=self.relay(pair, "draft"))

            def cancel() -> None:  # the client went away or its deadline passed: free both sessions now
                target.cancel()
                if draft is not None:
                    draft.cancel()

            call.on_cancel(cancel)
            observer = RequestObserver(self.metrics, probe, len(request.prompt_ids), call.is_active)
            events = observer.rounds(run_rounds(target, draft, request, pair.target_info.max_context, self.speculation))
            deltas = observer.deltas(text_deltas(events, pair.tokenizer, list(client.stop), client.include_stop_str,
                                                 client.skip_special_tokens))
            ahead = ReadAhead(deltas) if self.service.admission.active <= ReadAhead.MAX_RUNNING else None
            produced = 0
            try:
                for delta in ahead or deltas:
                    if not call.is_active():
                        break
                    produced += len(delta.token_ids)
                    yield delta
            except BackendError as exc:
                raise self._failed(exc, produced, call) from None
            finally:
                if ahead is not None and not ahead.stop(CLOSE_GRACE_S):  # a round still waits: end its streams
                    cancel()
                    ahead.stop(CLOSE_GRACE_S)
                if ahead is None or not ahead.running:
                    events.close()
                target.release("")
                if draft is not None:
                    draft.release("")

    def _failed(self, exc: BackendError, produced: int, call: Call) -> Abort:
        if exc.service == "target" and exc.code in TARGET_LOST and call.is_active():
            self.monitor.fault("target", exc)
            return Abort(
                grpc.StatusCode.UNAVAILABLE,
                f"the target service at {self.settings.target_addr} failed after {produced} generated tokens "
                f"({exc.code.name}: {exc.details}); retry once the coordinator reports SERVING again",
            )
        return Abort(exc.code, str(exc))


class ReadAhead:
    """A request's deltas made in a thread of their own, at most `depth` ahead of the client: the next round
    goes to the services while the last one's tokens go out. Handing a delta to a gRPC client waits for the
    send to complete (0.28 ms a round at one request, demo pair, target-only: 5% of a round), and that wait sat
    between every verify and the next. What the rounds raise is raised where the client reads, after the deltas
    made before it.

    Only while few requests run (MAX_RUNNING): a thread more per request costs more than it saves once the
    coordinator's core is busy. Demo pair through the services, three runs each way, stacks interleaved: one
    request target-only 188 -> 208 tokens/s (medians), EAGLE-3 K=5 284 -> 302; 16 requests target-only
    881 -> 761."""

    MAX_RUNNING = 2  # this request included
    _END = object()

    def __init__(self, source: Iterator, depth: int = 4):
        self._source = source
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-rounds", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            for item in self._source:
                if not self._put(item):
                    return
            self._put(self._END)
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, raised there
            self._put(_Raised(exc))

    def _put(self, item) -> bool:
        while not self._stopping.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator:
        while True:
            item = self._queue.get()
            if item is self._END:
                return
            if isinstance(item, _Raised):
                raise item.exc
            yield item

    def stop(self, timeout: float) -> bool:
        """Stop making deltas (the reader is done); -> whether the thread has ended within `timeout` s."""
        self._stopping.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()


@dataclass
class _Raised:
    exc: BaseException

