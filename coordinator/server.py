"""The coordinator's gRPC service: what clients call. A thin shell over coordinator/generation.py
(unpack the request, stream the deltas, pack them); the connection to the target and draft services
is coordinator/monitor.py.

No torch and no weights here: the tokenizer comes from the target service (ModelInfo + GetTokenizer),
and features are relayed, not decoded.
"""

from __future__ import annotations

import logging
import math
import sys

import grpc

from coordinator.chat import render_chat
from coordinator.generation import Call, ClientRequest, Generations
from coordinator.model_defaults import GREEDY, model_sampling
from coordinator.monitor import Monitor, Pair
from coordinator.probe import RequestProbe
from tandem.config import CoordinatorSettings
from tandem.convert import generation_request_from_pb, stats_to_pb
from tandem.pairing import PairMismatch
from tandem.service import Service, StartupError, run_service
from tandem.text import TextDelta, encode_within
from tandem.traffic import MeteredChannel
from tandem.v1 import coordinator_pb2, coordinator_pb2_grpc, draft_pb2, target_pb2

log = logging.getLogger("tandem.coordinator")


def client_request_from_pb(msg: coordinator_pb2.GenerateRequest, pair: Pair,
                           chat_template: str | None = None) -> ClientRequest:
    """`chat_template`: the coordinator's --chat-template, in place of the target checkpoint's."""
    context = pair.target_info.max_context  # no more of a text is tokenized than can fit (tandem/text.py)
    tokenize = (lambda text: encode_within(pair.tokenizer, text, context)) if pair.tokenizer is not None else None

    def chat(messages: list[dict]) -> list[int]:  # the template writes the special tokens (BOS) itself
        text = render_chat(chat_template or pair.target_info.chat_template, messages,
                           dict(pair.target_info.special_tokens))
        return encode_within(pair.tokenizer, text, context, add_special_tokens=False)

    generation = generation_request_from_pb(msg, tokenize, chat)
    if not msg.HasField("sampling"):  # none given: the model's generation_config.json, as the HTTP front's
        generation.sampling = model_sampling(pair.target_info.generation_config, GREEDY)
    return ClientRequest(generation, list(msg.stop), msg.HasField("max_new_tokens"))


def delta_to_pb(delta: TextDelta) -> coordinator_pb2.GenerateResponse:
    msg = coordinator_pb2.GenerateResponse(token_ids=delta.token_ids, text=delta.text)
    if delta.finish_reason is not None:
        msg.finish_reason = delta.finish_reason
        msg.stats.CopyFrom(stats_to_pb(delta.stats))
    return msg


def call_of(context: grpc.ServicerContext, streamed: bool = True) -> Call:
    """The client's deadline (passed on to the internal streams), liveness and cancel."""
    remaining = context.time_remaining()
    timeout = remaining if remaining is not None and math.isfinite(remaining) and remaining < 1e7 else None
    return Call(timeout, context.is_active, context.add_callback, streamed)


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name

    def __init__(self, service: Service):
        self.generations = Generations(service)

    def add_to_server(self, server: grpc.Server) -> None:
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(self, server)

    def ServerInfo(self, request, context):
        pair = self.generations.pair()
        return coordinator_pb2.ServerInfoResponse(
            target_model=pair.target_info.model,
            draft_model=pair.draft_info.model if pair.draft_info is not None else "",
            vocab_size=pair.target_info.vocab_size,
            max_context=pair.target_info.max_context,
            has_tokenizer=pair.tokenizer is not None,
            draft_attached=pair.draft is not None,
            target_buckets_compiling=pair.target.ModelInfo(target_pb2.TargetInfoRequest(), timeout=10).buckets_compiling,
            draft_compiling=pair.draft is not None
            and pair.draft.ModelInfo(draft_pb2.DraftInfoRequest(), timeout=10).compiling,
        )

    def Generate(self, request, context):
        response, text = coordinator_pb2.GenerateResponse(), []
        probe = self._probe(request)
        for delta in self._deltas(request, context, probe, streamed=False):
            response.MergeFrom(delta_to_pb(delta))  # ids append; the last delta brings finish_reason and stats
            text.append(delta.text)
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

    def _deltas(self, request, context, probe: RequestProbe | None, streamed: bool = True):
        template = self.generations.settings.chat_template
        return self.generations.stream(lambda pair: client_request_from_pb(request, pair, template),
                                       call_of(context, streamed), probe)

    def _probe(self, request: coordinator_pb2.GenerateRequest) -> RequestProbe | None:
        if not request.profile:
            return None
        monitor = self.generations.monitor
        pair = monitor.current if monitor is not None else None
        return RequestProbe(request, pair.target_info if pair else None, pair.draft_info if pair else None,
                            transport=monitor.transport if monitor is not None else "grpc")


def connect(settings: CoordinatorSettings, service: Service, servicer: CoordinatorServicer) -> None:
    """Wait for the target and draft services, check the pair, and start watching them."""

    def metered(channel: grpc.Channel, name: str) -> grpc.Channel:
        return MeteredChannel(channel, service.traffic, f"coordinator->{name}", f"{name}->coordinator")

    monitor = Monitor(settings, on_target=service.set_serving, wrap_channel=metered)
    try:
        monitor.connect()
    except (TimeoutError, RuntimeError, PairMismatch, grpc.RpcError) as exc:
        raise StartupError(exc) from exc
    servicer.generations.attach(monitor)
    monitor.start()
    pair = monitor.current
    log.info(
        "coordinator: target %s at %s, draft %s at %s, tokenizer %s",
        pair.target_info.model, settings.target_addr, pair.draft_info.model if pair.draft_info else None,
        settings.draft_addr, "yes" if pair.tokenizer else "none",
    )


def load(settings: CoordinatorSettings, service: Service, servicer: CoordinatorServicer):
    """The HTTP front first (its /health says 503 while connecting), then the services; the
    clean-up stops the front once the drain has let its requests finish."""
    front = None
    if settings.http_port is not None:
        from coordinator.http.server import HttpFront

        try:
            front = HttpFront(settings, servicer.generations, service.keys)
        except OSError as exc:
            raise StartupError(exc) from exc
    connect(settings, service, servicer)
    return front.stop if front is not None else None


def serve(settings: CoordinatorSettings) -> int:
    return run_service("coordinator", settings, CoordinatorServicer,
                       lambda service, servicer: load(settings, service, servicer))


if __name__ == "__main__":
    from tandem.config import load_settings

    sys.exit(serve(load_settings(CoordinatorSettings)))
