"""The draft gRPC service: a thin shell over DraftEngine.

One bidirectional stream per generation (proto/tandem/v1/draft.proto). A step's features arrive in
one or more messages (chunks of rows); the step runs when the last chunk is in.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator

import grpc
import torch

from draft_server.engine import DraftEngine
from tandem.config import DraftSettings
from tandem.metrics import StepMetrics
from tandem.params import MAX_DRAFT_TOKENS
from tandem.service import Abort, Service, SessionReaper, errors_to_status, setup_logging
from tandem.sessions import InvalidRequest, SessionNotFound
from tandem.timing import StepClock
from tandem.transports.base import NoChannel, TransportError
from tandem.transports.endpoints import DraftTransport
from tandem.transports.negotiate import TransportMismatch
from tandem.v1 import draft_pb2, draft_pb2_grpc
from tandem.wire import FeatureAssembler, WireError

log = logging.getLogger("tandem.draft")

MAX_BRANCHES = 64  # outcomes an ahead step may prepare for: each is one row of its rollout batch

ERRORS = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (WireError, grpc.StatusCode.INVALID_ARGUMENT),
    (SessionNotFound, grpc.StatusCode.NOT_FOUND),
    # a descriptor for a channel this draft has not opened (it restarted): the coordinator takes the
    # draft down and runs the handshake again
    (NoChannel, grpc.StatusCode.FAILED_PRECONDITION),
    # a fast path that lost a step is broken: the same, through UNAVAILABLE
    (TransportError, grpc.StatusCode.UNAVAILABLE),
)
HANDSHAKE_ERRORS = ((TransportMismatch, grpc.StatusCode.FAILED_PRECONDITION),
                    (TransportError, grpc.StatusCode.FAILED_PRECONDITION))


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, service: Service):
        self.service = service
        self.engine: DraftEngine | None = None
        self.model_dir = ""
        self.reaper: SessionReaper | None = None
        self.metrics = StepMetrics(service.registry)
        self.transport: DraftTransport | None = None  # the feature path from the target; None: inline only

    def attach(self, engine: DraftEngine, model_dir: str, session_ttl: float | None = None,
               transport: DraftTransport | None = None) -> None:
        self.engine, self.model_dir, self.transport = engine, model_dir, transport
        self.metrics.count_sessions(lambda: engine.num_sessions)
        if session_ttl is not None:
            self.reaper = SessionReaper("draft", session_ttl, engine.evict_idle)
            self.reaper.start()

    def _engine(self) -> DraftEngine:
        if self.engine is None:
            raise Abort(grpc.StatusCode.UNAVAILABLE, "the draft service is still loading")
        return self.engine

    def ModelInfo(self, request, context):
        with errors_to_status(context):
            engine = self._engine()
            shape = engine.shape()
            return draft_pb2.DraftInfo(
                model=self.model_dir,
                vocab_size=shape.vocab_size,
                draft_vocab_size=engine.config.draft_vocab_size,
                target_hidden_size=shape.target_hidden_size,
                max_target_id=shape.max_target_id,
                aux_layer_ids=shape.aux_layer_ids or [],
                dtype=str(engine.dtype).removeprefix("torch."),
                device=str(engine.device),
                num_sessions=engine.num_sessions,
                max_context=engine.max_context,
                target_max_context=engine.target_max_context or 0,
                transport=self.transport.caps if self.transport is not None else None,
            )

    def OpenTransport(self, request, context):
        with errors_to_status(context, HANDSHAKE_ERRORS):
            self._engine()
            if self.transport is None:
                raise Abort(grpc.StatusCode.FAILED_PRECONDITION, "this draft takes features inline only")
            self.transport.open(request)
            return request

    def Session(self, request_iterator, context) -> Iterator[draft_pb2.DraftResponse]:
        session_id = None
        created = False
        with errors_to_status(context, ERRORS), self.service.admission.admit():
            engine = self._engine()
            try:
                assembler = FeatureAssembler()
                next_tokens: list[int] = []
                k = 0
                ahead = None
                for request in request_iterator:
                    if session_id is None:
                        if not request.session_id:
                            raise InvalidRequest("the first message of a draft stream names the session")
                        session_id = request.session_id
                        timed = request.want_timing  # answers carry StepTiming
                    if not assembler.started:  # the first message of a step
                        clock = StepClock(getattr(engine, "device", None))
                        if request.HasField("cohort"):
                            clock.cohort = (request.cohort.id, request.cohort.size)
                        next_tokens, k = list(request.next_tokens), request.num_draft_tokens
                        if not 0 <= k <= MAX_DRAFT_TOKENS:
                            raise InvalidRequest(f"num_draft_tokens must be in [0, {MAX_DRAFT_TOKENS}], got {k}")
                        ahead = request.ahead if request.HasField("ahead") else None
                        if ahead is not None and not 1 <= ahead.branches <= MAX_BRANCHES:
                            raise InvalidRequest(f"ahead.branches must be in [1, {MAX_BRANCHES}], got {ahead.branches}")
                    with clock.codec():
                        if ahead is not None and not next_tokens:  # no new pairs: no features follow
                            features = torch.empty(0, engine.feature_size)
                        elif request.features.WhichOneof("payload") == "ref":  # a fast path: the whole step
                            if self.transport is None:
                                raise NoChannel("a feature descriptor, but this draft has no fast path")
                            features = self.transport.recv(request.features.ref, len(next_tokens), engine.feature_size)
                        else:  # inline: [m, 3Ht] once the step's last chunk is in
                            features = assembler.add(request.features, len(next_tokens), engine.feature_size)
                    if features is None:
                        continue
                    if ahead is not None and not created:
                        raise InvalidRequest("a draft stream starts with a propose, not an ahead")
                    create = not created
                    if create:
                        if session_id in engine.session_ids():
                            raise InvalidRequest(f"draft session {session_id!r} already exists")
                        created = True  # from here on the session is ours to release, even if propose fails
                        if self.reaper is not None:
                            self.reaper.register(session_id, context)
                    if ahead is not None:
                        with clock.compute():
                            branches = engine.speculate(session_id, features, next_tokens, list(ahead.assumed), k,
                                                        ahead.branches)
                        self.metrics.observe("ahead", clock)
                        response = draft_pb2.DraftResponse(branches=[
                            draft_pb2.Branch(accepted=b.accepted, bonus=b.bonus, drafts=b.drafts) for b in branches
                        ])
                    else:
                        with clock.compute():
                            drafts = engine.propose(session_id, features, next_tokens, k, create=create)
                        self.metrics.observe("propose", clock)
                        response = draft_pb2.DraftResponse(drafts=drafts)
                        if clock.batch is not None:
                            response.batch.id, response.batch.size = clock.batch
                    if timed:
                        response.timing.CopyFrom(clock.to_pb())
                    yield response
            finally:
                if created:
                    engine.release(session_id)
                    if self.reaper is not None:
                        self.reaper.unregister(session_id)


def serve(settings: DraftSettings) -> int:
    setup_logging(settings.log_level)
    service = Service("draft", settings, [draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name])
    servicer = DraftServicer(service)
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, service.server)
    service.start()
    service.handle_signals()
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    engine = DraftEngine(settings.model, settings.target, device=settings.device, dtype=settings.dtype,
                         max_batch_size=settings.max_batch_size, max_batch_tokens=settings.max_batch_tokens)
    transport = DraftTransport(settings.transport, settings.device, settings.dtype, engine.feature_size,
                               traffic=service.traffic)
    servicer.attach(engine, str(settings.model), settings.session_ttl, transport)
    log.info("draft %s (%s layout) on %s (%s)", settings.model, engine.layout, settings.device, settings.dtype)
    if not service.stopping:
        service.ready()
    try:
        return service.run()
    finally:
        transport.close()


if __name__ == "__main__":
    from tandem.config import load_settings

    sys.exit(serve(load_settings(DraftSettings)))
