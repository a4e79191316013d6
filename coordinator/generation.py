"""What the coordinator does for one client request, whatever API it came through (gRPC here, the
OpenAI HTTP front too): admit it, fit it to the pair of services, submit it to the pair's scheduler
(coordinator/scheduler.py) and read its output queue, detokenize and apply stop strings (tandem/text.py):
vLLM's split of AsyncLLM (the handler) and the engine core's loop.

No protobuf of the client API and no torch here: requests arrive as a GenerationRequest.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc

from coordinator.links import BackendError, ServiceLink
from coordinator.monitor import LATE_PATIENCE_S, Monitor, Pair
from coordinator.probe import RequestObserver, RequestProbe
from coordinator.scheduler import Scheduler, pack_draft, pack_target
from tandem.config import CoordinatorSettings
from tandem.constraint import Grammars
from tandem.defaults import DECODE_STEPS, OVERLAP_SAMPLED, SPEC_DRAFT_COST
from tandem.errors import Abort, InvalidRequest, OutOfRange
from tandem.gates import AcceptanceGate, TreeGate
from tandem.metrics import CoordinatorMetrics
from tandem.params import MAX_STOP_LENGTH, MAX_STOP_STRINGS, GenerationRequest, parse_tree
from tandem.policy import OVERLAP_BRANCHES, OVERLAP_MAX_RUNNING, Speculation, adaptive_k
from tandem.service import Service
from tandem.text import TextDelta, text_deltas
from tandem.v1 import draft_pb2, target_pb2

log = logging.getLogger("tandem.coordinator")

# A target step that failed with one of these did not fail for this request's sake: the service is
# gone or going, and the client hears UNAVAILABLE (retry later) rather than the transport's detail.
TARGET_LOST = (
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED,
)


# What a session's KV holds beyond its tokens for a moment: t and a chain's drafts or a tree's nodes, in whole
# blocks (target_server/kv.py: VERIFY_TOKENS 63, and a block of 16 for the rounding), so that a fitted request fits.
KV_VERIFY_ROOM = 80


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


def fit_to_pair(client: ClientRequest, pair: Pair, grammars: Grammars | None = None) -> GenerationRequest:
    """InvalidRequest / OutOfRange naming what is wrong: nothing a model could choke on gets past here (a
    grammar is compiled here, into `grammars`' cache, so that a bad one is the client's error)."""
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
    kv_tokens = pair.target_info.kv_cache_tokens - KV_VERIFY_ROOM  # what one session may grow to
    if not client.max_new_tokens_given and pair.target_info.kv_cache_tokens and n + request.max_new_tokens > kv_tokens:
        # a context longer than the KV budget (vLLM refuses to start so; here a request may not grow past it)
        request = request.model_copy(update={"max_new_tokens": max(1, kv_tokens - n)})
    check_stop_strings(client.stop, pair.tokenizer is not None)
    if request.grammar is not None:
        if grammars is None:
            raise InvalidRequest("structured outputs need the target's tokenizer, and the target has none")
        grammars.matcher(request.grammar)
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
    """The coordinator's generations: one server-wide K policy (adaptive K, the acceptance gate, overlap),
    the scheduler of the pair, and the services as the monitor last saw them."""

    def __init__(self, service: Service):
        self.service = service
        self.settings: CoordinatorSettings = service.settings
        self.monitor: Monitor | None = None
        self.metrics = CoordinatorMetrics(service.registry)
        settings = self.settings
        # the handlers in flight: those running and those waiting in the scheduler's queue
        service.admission.limit = settings.max_sessions + settings.max_waiting
        service.admission.named = "max_sessions + max_waiting"
        self._scheduler: tuple[tuple, Scheduler] | None = None  # (the stubs it steps, it)
        self._grammars: tuple[object, Grammars | None] | None = None  # (the tokenizer, its grammars)
        self._grammars_lock = threading.Lock()
        self.owner = uuid.uuid4().hex  # this coordinator, to the services it steps
        self._lock = threading.Lock()
        budget = settings.spec_token_budget  # 0: no load policy, neither adaptive K nor the gate
        running = lambda: self._scheduler[1].running if self._scheduler is not None else 0
        self.metrics.waiting.set_function(lambda: self._scheduler[1].waiting if self._scheduler is not None else 0)
        self.speculation = Speculation(
            k_for=adaptive_k(budget, running) if budget else None,
            gate=AcceptanceGate(SPEC_DRAFT_COST) if budget else None,  # one for the server: learns from every request
            overlap=settings.overlap,
            overlap_sampled=OVERLAP_SAMPLED,
            branches=OVERLAP_BRANCHES,
            overlap_while=lambda: running() <= OVERLAP_MAX_RUNNING,
            trees=TreeGate(),
            fits=(lambda width: running() * width <= budget) if budget else None,
            default_tree=parse_tree(settings.tree) if settings.tree else None,
            decode_steps=DECODE_STEPS,
        )

    def attach(self, monitor: Monitor) -> None:
        self.monitor = monitor

    def scheduler(self, pair: Pair) -> Scheduler:
        """The pair's scheduler, made again when the monitor's services changed (a draft that came or went)."""
        made_for = (pair.target, pair.draft)
        with self._lock:
            if self._scheduler is None or self._scheduler[0] != made_for:
                if self._scheduler is not None:
                    self._scheduler[1].close()
                traffic = self.service.traffic
                target = ServiceLink("target", pair.target.Step, pack_target, owner=self.owner,
                                     local=_local_steps(pair.target_info), answer_type=target_pb2.TargetBatchResult,
                                     traffic=traffic)
                draft = (ServiceLink("draft", pair.draft.Step, pack_draft, self.settings.draft_timeout, self.owner,
                                     local=_local_steps(pair.draft_info), answer_type=draft_pb2.DraftBatchResult,
                                     traffic=traffic)
                         if pair.draft is not None else None)
                scheduler = Scheduler(target, draft, list(pair.target_info.eos_token_ids),
                                      pair.target_info.max_context, self.speculation, self.settings.max_sessions,
                                      self.settings.max_waiting, lambda error: self.monitor.fault("draft", error),
                                      self.grammars(pair), pair.target_info.vocab_size)
                scheduler.on_preempt = self.metrics.preemptions.inc
                self._scheduler = (made_for, scheduler)
            return self._scheduler[1]

    def grammars(self, pair: Pair) -> Grammars | None:
        """The grammars of the pair's tokenizer (None: the target has none), made again for a new tokenizer."""
        with self._grammars_lock:  # not self._lock: scheduler() asks for them holding it
            if self._grammars is None or self._grammars[0] is not pair.tokenizer:
                made = None
                if pair.tokenizer is not None:
                    info = pair.target_info
                    made = Grammars(pair.tokenizer.to_str(), info.vocab_size, list(info.eos_token_ids))
                self._grammars = (pair.tokenizer, made)
            return self._grammars[1]

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
            request = fit_to_pair(client, pair, self.grammars(pair) if client.generation.grammar else None)
            handle = self.scheduler(pair).submit(request, call.timeout, pair.draft is not None and request.speculate,
                                                 probe)
            call.on_cancel(handle.cancel)  # the client went away or its deadline passed: both sessions freed
            observer = RequestObserver(self.metrics, probe, len(request.prompt_ids), call.is_active)
            deltas = observer.deltas(text_deltas(observer.rounds(handle.events()), pair.tokenizer, list(client.stop),
                                                 client.include_stop_str, client.skip_special_tokens))
            produced = 0
            try:
                for delta in deltas:
                    if not call.is_active():
                        break
                    produced += len(delta.token_ids)
                    yield delta
            except BackendError as exc:
                raise self._failed(exc, produced, call) from None
            finally:
                handle.cancel()

    def _failed(self, exc: BackendError, produced: int, call: Call) -> Abort:
        if exc.service == "target" and exc.code in TARGET_LOST and call.is_active():
            self.monitor.fault("target", exc)
            return Abort(
                grpc.StatusCode.UNAVAILABLE,
                f"the target service at {self.settings.target_addr} failed after {produced} generated tokens "
                f"({exc.code.name}: {exc.details}); retry once the coordinator reports SERVING again",
            )
        return Abort(exc.code, str(exc))


def _local_steps(info):
    """The service's step socket (common.LocalSteps) from its ModelInfo, or None where it offers none."""
    return info.local_steps if info is not None and info.HasField("local_steps") else None
