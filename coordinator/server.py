"""The coordinator service: what clients call. It runs the round loop (coordinator/rounds.py) against
the target and draft services, detokenizes, applies stop strings, and streams deltas.

No torch and no weights here: the tokenizer comes from the target service (ModelInfo + GetTokenizer),
and features are relayed, not decoded.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Iterator, Sequence

import grpc
from tokenizers import Tokenizer

from coordinator.backends import BackendError, GrpcDraft, GrpcTarget
from coordinator.cohorts import CohortLink, Cohorts
from coordinator.links import Backends, Monitor
from coordinator.probe import RequestObserver, RequestProbe
from coordinator.rounds import AcceptanceGate, GenerationStats, adaptive_k, run_rounds
from coordinator.text import TextDelta, text_deltas
from tandem.config import CoordinatorSettings
from tandem.metrics import CoordinatorMetrics
from tandem.pairing import PairMismatch
from tandem.params import MAX_STOP_LENGTH, MAX_STOP_STRINGS, GenerationRequest, SamplingParams
from tandem.service import Abort, Service, errors_to_status, setup_logging
from tandem.traffic import MeteredChannel
from tandem.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger("tandem.coordinator")


class BadRequest(ValueError):
    """A client request the coordinator refuses before any service sees it."""


class OutOfRange(ValueError):
    """A request that does not fit the model's context."""


ERRORS = ((OutOfRange, grpc.StatusCode.OUT_OF_RANGE), (BadRequest, grpc.StatusCode.INVALID_ARGUMENT))

# A target step that failed with one of these did not fail for this request's sake: the service is
# gone or going, and the client hears UNAVAILABLE (retry later) rather than the transport's detail.
TARGET_LOST = (
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED,
)


# -- protobuf <-> the round loop's types (the edge) ---------------------------------------------


def generation_request_from_pb(
    msg: coordinator_pb2.GenerateRequest,
    tokenizer: Tokenizer | None,
    vocab_size: int | None = None,
    max_context: int | None = None,
) -> GenerationRequest:
    """The request as the round loop takes it, or BadRequest / OutOfRange / ValidationError naming what is
    wrong: nothing a model could choke on gets past here."""
    if msg.prompt and msg.prompt_ids:
        raise BadRequest("give either prompt (text) or prompt_ids, not both")
    if not msg.prompt and not msg.prompt_ids:
        raise BadRequest("the prompt is empty: give prompt (text) or prompt_ids")
    if msg.prompt:
        if tokenizer is None:
            raise BadRequest("the target has no tokenizer: send prompt_ids instead of prompt")
        prompt_ids = tokenizer.encode(msg.prompt).ids
    else:
        prompt_ids = list(msg.prompt_ids)
    s = msg.sampling
    optional = {
        name: getattr(msg, name)
        for name in ("max_new_tokens", "num_draft_tokens", "speculate")
        if msg.HasField(name)
    }
    request = GenerationRequest(
        prompt_ids=prompt_ids,
        sampling=SamplingParams(
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p if s.HasField("top_p") else 1.0,
            seed=s.seed if s.HasField("seed") else None,
        ),
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        **optional,
    )
    if vocab_size is not None:
        for what, ids in (("prompt_ids", request.prompt_ids), ("stop_token_ids", request.stop_token_ids)):
            bad = [i for i in ids if not 0 <= i < vocab_size]
            if bad:
                raise BadRequest(f"{what} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if max_context is not None:
        n = len(request.prompt_ids)
        if n >= max_context:
            raise OutOfRange(f"the prompt has {n} tokens; the model's context is {max_context} tokens")
        if n + request.max_new_tokens > max_context:
            if msg.HasField("max_new_tokens"):
                raise OutOfRange(
                    f"the prompt has {n} tokens and max_new_tokens is {request.max_new_tokens}: "
                    f"{n + request.max_new_tokens} is past the model's context of {max_context} tokens"
                )
            request.max_new_tokens = max_context - n  # the default, not asked for: what fits (as vLLM does)
    return request


def check_stop_strings(stop: Sequence[str], tokenizer: Tokenizer | None) -> list[str]:
    if not stop:
        return []
    if tokenizer is None:
        raise BadRequest("stop strings need a tokenizer and the target has none: use stop_token_ids")
    if len(stop) > MAX_STOP_STRINGS:
        raise BadRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for i, text in enumerate(stop):
        if not text:
            raise BadRequest(f"stop[{i}] is empty")
        if len(text) > MAX_STOP_LENGTH:
            raise BadRequest(f"stop[{i}] has {len(text)} characters; at most {MAX_STOP_LENGTH}")
    return list(stop)


def stats_to_pb(stats: GenerationStats) -> coordinator_pb2.GenerationStats:
    return coordinator_pb2.GenerationStats(
        num_rounds=stats.num_rounds,
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens,
        mean_acceptance_length=stats.mean_acceptance_length,
        accepted_per_position=stats.accepted_per_position,
        num_rounds_without_draft=stats.num_rounds_without_draft,
        num_rounds_load_shed=stats.num_rounds_load_shed,
        num_overlap_rounds=stats.num_overlap_rounds,
        num_overlap_hits=stats.num_overlap_hits,
        overlap_hit_rate=stats.overlap_hit_rate,
    )


def delta_to_pb(delta: TextDelta) -> coordinator_pb2.GenerateResponse:
    msg = coordinator_pb2.GenerateResponse(token_ids=delta.token_ids, text=delta.text)
    if delta.finish_reason is not None:
        msg.finish_reason = delta.finish_reason
        msg.stats.CopyFrom(stats_to_pb(delta.stats))
    return msg


# -- the servicer -------------------------------------------------------------------------------


def _timeout(context: grpc.ServicerContext) -> float | None:
    """The client's deadline, passed on to the internal streams."""
    remaining = context.time_remaining()
    return remaining if remaining is not None and math.isfinite(remaining) and remaining < 1e7 else None


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, service: Service):
        self.service = service
        self.monitor: Monitor | None = None
        self.metrics = CoordinatorMetrics(service.registry)
        cost = service.settings.spec_draft_cost
        self.gate = AcceptanceGate(cost) if cost else None  # one for the server: it learns from every request
        self.cohorts = Cohorts()

    def attach(self, monitor: Monitor) -> None:
        self.monitor = monitor

    def _backends(self) -> Backends:
        if self.monitor is None:
            raise Abort(grpc.StatusCode.UNAVAILABLE, "the coordinator is still connecting to its services")
        return self.monitor.backends()

    def ServerInfo(self, request, context):
        with errors_to_status(context):
            b = self._backends()
            return coordinator_pb2.ServerInfoResponse(
                target_model=b.target_info.model,
                draft_model=b.draft_info.model if b.draft_info is not None else "",
                vocab_size=b.target_info.vocab_size,
                max_context=b.target_info.max_context,
                has_tokenizer=b.tokenizer is not None,
                draft_attached=b.draft is not None,
            )

    def _probe(self, request: coordinator_pb2.GenerateRequest) -> RequestProbe | None:
        if not request.profile:
            return None
        b = self.monitor.current if self.monitor is not None else None
        return RequestProbe(request, b.target_info if b else None, b.draft_info if b else None)

    def Generate(self, request, context):
        response = coordinator_pb2.GenerateResponse()
        text = []
        probe = self._probe(request)
        for delta in self._deltas(request, context, probe):
            response.token_ids.extend(delta.token_ids)
            text.append(delta.text)
            if delta.finish_reason is not None:
                response.finish_reason = delta.finish_reason
                response.stats.CopyFrom(stats_to_pb(delta.stats))
        response.text = "".join(text)
        if probe is not None:
            probe.to_client(response, last=True)
        return response

    def GenerateStream(self, request, context):
        probe = self._probe(request)
        for delta in self._deltas(request, context, probe):
            msg = delta_to_pb(delta)
            if probe is not None:
                probe.to_client(msg, last=delta.finish_reason is not None)
            yield msg

    def _deltas(self, request, context, probe: RequestProbe | None = None) -> Iterator[TextDelta]:
        with errors_to_status(context, ERRORS), self.service.admission.admit():
            b = self._backends()
            gen = generation_request_from_pb(request, b.tokenizer, b.target_info.vocab_size, b.target_info.max_context)
            stop = check_stop_strings(list(request.stop), b.tokenizer)
            timeout = _timeout(context)
            link = CohortLink(self.cohorts)  # the batch of each step goes along to the next service
            target = GrpcTarget(b.target, list(b.target_info.eos_token_ids), timeout, probe=probe, cohorts=link)
            draft = None
            if b.draft is not None and gen.speculate:  # no draft (or it is down): run_rounds goes target-only
                draft = GrpcDraft(b.draft, timeout, step_timeout=self.service.settings.draft_timeout,
                                  on_fault=lambda error: self.monitor.fault("draft", error), probe=probe,
                                  cohorts=link)

            def cancel() -> None:  # the client went away or its deadline passed: free both sessions now
                target.cancel()
                if draft is not None:
                    draft.cancel()

            context.add_callback(cancel)
            observer = RequestObserver(self.metrics, probe, len(gen.prompt_ids), context.is_active)
            budget = self.service.settings.spec_token_budget
            k_for = adaptive_k(budget, lambda: self.service.admission.active) if budget else None
            settings = self.service.settings
            running = self.service.admission
            events = observer.rounds(run_rounds(
                target, draft, gen, max_context=b.target_info.max_context, k_for=k_for, overlap=settings.overlap,
                branches=settings.overlap_branches,
                overlap_while=lambda: running.active <= settings.overlap_max_running, gate=self.gate,
            ))
            try:
                produced = 0
                for delta in observer.deltas(text_deltas(events, b.tokenizer, stop)):
                    if not context.is_active():
                        break
                    produced += len(delta.token_ids)
                    yield delta
            except BackendError as exc:
                if exc.service == "target" and exc.code in TARGET_LOST and context.is_active():
                    self.monitor.fault("target", exc)
                    raise Abort(
                        grpc.StatusCode.UNAVAILABLE,
                        f"the target service at {self.service.settings.target_addr} failed after {produced} "
                        f"generated tokens ({exc.code.name}: {exc.details}); retry once the coordinator "
                        f"reports SERVING again",
                    ) from None
                raise Abort(exc.code, str(exc)) from None
            finally:
                events.close()
                target.release("")
                if draft is not None:
                    draft.release("")


def serve(settings: CoordinatorSettings) -> int:
    setup_logging(settings.log_level)
    service = Service("coordinator", settings, [coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name])
    servicer = CoordinatorServicer(service)
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, service.server)
    service.start()
    service.handle_signals()

    def metered(channel: grpc.Channel, name: str) -> grpc.Channel:
        return MeteredChannel(channel, service.traffic, f"coordinator->{name}", f"{name}->coordinator")

    monitor = Monitor(settings, on_target=service.set_serving, wrap_channel=metered)
    try:
        monitor.connect()
    except (TimeoutError, RuntimeError, PairMismatch, grpc.RpcError) as exc:
        log.error("coordinator cannot start: %s", exc)
        service.server.stop(grace=None)
        return 1
    servicer.attach(monitor)
    monitor.start()
    backends = monitor.current
    info = backends.target_info
    log.info(
        "coordinator: target %s at %s, draft %s at %s, tokenizer %s",
        info.model, settings.target_addr, backends.draft_info.model if backends.draft_info else None,
        settings.draft_addr, "yes" if backends.tokenizer else "none",
    )
    if not service.stopping:
        service.ready()
    return service.run()


if __name__ == "__main__":
    from tandem.config import load_settings

    sys.exit(serve(load_settings(CoordinatorSettings)))
