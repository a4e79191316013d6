"""The coordinator service: what clients call. It runs the round loop (coordinator/rounds.py) against
the target and draft services, detokenizes, applies stop strings, and streams deltas.

No torch and no weights here: the tokenizer comes from the target service (ModelInfo + GetTokenizer),
and features are relayed, not decoded.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
from tokenizers import Tokenizer

from coordinator.backends import BackendError, GrpcDraft, GrpcTarget
from coordinator.probe import RequestObserver, RequestProbe
from coordinator.rounds import GenerationStats, run_rounds
from coordinator.text import TextDelta, text_deltas
from tandem.config import CoordinatorSettings
from tandem.metrics import CoordinatorMetrics
from tandem.pairing import DraftShape, PairMismatch, TargetShape, check_pair
from tandem.params import GenerationRequest, SamplingParams
from tandem.service import Abort, Service, channel_options, errors_to_status, setup_logging, wait_for_serving
from tandem.traffic import MeteredChannel, Traffic
from tandem.v1 import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    draft_pb2,
    draft_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)

log = logging.getLogger("tandem.coordinator")


class BadRequest(ValueError):
    """A client request the coordinator refuses before any service sees it."""


ERRORS = ((BadRequest, grpc.StatusCode.INVALID_ARGUMENT),)


# -- protobuf <-> the round loop's types (the edge) ---------------------------------------------


def generation_request_from_pb(
    msg: coordinator_pb2.GenerateRequest, tokenizer: Tokenizer | None
) -> GenerationRequest:
    if msg.prompt and msg.prompt_ids:
        raise BadRequest("give either prompt or prompt_ids, not both")
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
    return GenerationRequest(
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


def stats_to_pb(stats: GenerationStats) -> coordinator_pb2.GenerationStats:
    return coordinator_pb2.GenerationStats(
        num_rounds=stats.num_rounds,
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens,
        mean_acceptance_length=stats.mean_acceptance_length,
        accepted_per_position=stats.accepted_per_position,
    )


def delta_to_pb(delta: TextDelta) -> coordinator_pb2.GenerateResponse:
    msg = coordinator_pb2.GenerateResponse(token_ids=delta.token_ids, text=delta.text)
    if delta.finish_reason is not None:
        msg.finish_reason = delta.finish_reason
        msg.stats.CopyFrom(stats_to_pb(delta.stats))
    return msg


# -- the services behind ------------------------------------------------------------------------


@dataclass
class Backends:
    target: target_pb2_grpc.TargetServiceStub
    target_info: target_pb2.TargetInfo
    draft: draft_pb2_grpc.DraftServiceStub | None
    draft_info: draft_pb2.DraftInfo | None
    tokenizer: Tokenizer | None


def connect(settings: CoordinatorSettings, traffic: Traffic | None = None) -> Backends:
    """Wait for the target (and draft) to be SERVING, read what they are, check they fit together.
    With `traffic`, the channels count what they send and receive."""
    options = channel_options(settings.max_message_mib)

    def channel(address: str, service: str) -> grpc.Channel:
        plain = grpc.insecure_channel(address, options=options)
        return plain if traffic is None else MeteredChannel(plain, traffic, f"coordinator->{service}",
                                                            f"{service}->coordinator")

    wait_for_serving(settings.target_addr, settings.connect_timeout, what="target service")
    target = target_pb2_grpc.TargetServiceStub(channel(settings.target_addr, "target"))
    target_info = target.ModelInfo(target_pb2.TargetInfoRequest(), timeout=30)
    tokenizer = None
    if target_info.tokenizer_size:
        data = b"".join(chunk.data for chunk in target.GetTokenizer(target_pb2.GetTokenizerRequest(), timeout=60))
        tokenizer = Tokenizer.from_str(data.decode())
    draft = draft_info = None
    if settings.draft_addr is not None:
        wait_for_serving(settings.draft_addr, settings.connect_timeout, what="draft service")
        draft = draft_pb2_grpc.DraftServiceStub(channel(settings.draft_addr, "draft"))
        draft_info = draft.ModelInfo(draft_pb2.DraftInfoRequest(), timeout=30)
        check_services_pair(target_info, draft_info)
    return Backends(target, target_info, draft, draft_info, tokenizer)


def check_services_pair(target: target_pb2.TargetInfo, draft: draft_pb2.DraftInfo) -> None:
    aux = list(draft.aux_layer_ids) or None
    check_pair(
        TargetShape(vocab_size=target.vocab_size, hidden_size=target.hidden_size, num_layers=target.num_layers),
        DraftShape(
            vocab_size=draft.vocab_size,
            target_hidden_size=draft.target_hidden_size,
            max_target_id=draft.max_target_id,
            aux_layer_ids=aux,
        ),
    )
    if aux is not None and aux != list(target.layer_ids):
        raise PairMismatch(
            f"the draft was trained on target layers {aux}, the target captures {list(target.layer_ids)}: "
            f"start the target with --draft pointing at the draft checkpoint"
        )


# -- the servicer -------------------------------------------------------------------------------


def _timeout(context: grpc.ServicerContext) -> float | None:
    """The client's deadline, passed on to the internal streams."""
    remaining = context.time_remaining()
    return remaining if remaining is not None and math.isfinite(remaining) and remaining < 1e7 else None


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, service: Service):
        self.service = service
        self.backends: Backends | None = None
        self.metrics = CoordinatorMetrics(service.registry)

    def attach(self, backends: Backends) -> None:
        self.backends = backends

    def _backends(self) -> Backends:
        if self.backends is None:
            raise Abort(grpc.StatusCode.UNAVAILABLE, "the coordinator is still connecting to its services")
        return self.backends

    def ServerInfo(self, request, context):
        with errors_to_status(context):
            b = self._backends()
            return coordinator_pb2.ServerInfoResponse(
                target_model=b.target_info.model,
                draft_model=b.draft_info.model if b.draft_info is not None else "",
                vocab_size=b.target_info.vocab_size,
                max_context=b.target_info.max_context,
                has_tokenizer=b.tokenizer is not None,
            )

    def _probe(self, request: coordinator_pb2.GenerateRequest) -> RequestProbe | None:
        if not request.profile:
            return None
        b = self.backends
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
            gen = generation_request_from_pb(request, b.tokenizer)
            timeout = _timeout(context)
            target = GrpcTarget(b.target, list(b.target_info.eos_token_ids), timeout, probe=probe)
            draft = GrpcDraft(b.draft, timeout, probe=probe) if b.draft is not None and gen.speculate else None

            def cancel() -> None:  # the client went away or its deadline passed: free both sessions now
                target.cancel()
                if draft is not None:
                    draft.cancel()

            context.add_callback(cancel)
            observer = RequestObserver(self.metrics, probe, len(gen.prompt_ids), context.is_active)
            events = observer.rounds(run_rounds(target, draft, gen, max_context=b.target_info.max_context))
            try:
                for delta in observer.deltas(text_deltas(events, b.tokenizer, list(request.stop))):
                    if not context.is_active():
                        break
                    yield delta
            except BackendError as exc:
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
    try:
        backends = connect(settings, service.traffic)
    except (TimeoutError, RuntimeError, PairMismatch, grpc.RpcError) as exc:
        log.error("cannot start: %s", exc)
        service.server.stop(grace=None)
        return 1
    servicer.attach(backends)
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
