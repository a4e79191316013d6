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
from tandem.convert import branches_to_pb, draft_probs_to_pb, parents_to_pb, sampling_from_pb, tree_from_pb
from tandem.dtypes import name_of
from tandem.errors import Abort
from tandem.params import MAX_DRAFT_TOKENS
from tandem.protocol import Drafts
from tandem.service import Service, run_service
from tandem.servicer import EngineServicer
from tandem.sessions import InvalidRequest
from tandem.timing import StepClock
from tandem.transports.contract import NoChannel
from tandem.transports.endpoints import DraftTransport
from tandem.v1 import draft_pb2, draft_pb2_grpc
from tandem.wire import FeatureAssembler, is_last_chunk

log = logging.getLogger("tandem.draft")

MAX_BRANCHES = 64  # outcomes an ahead step may prepare for: each is one row of its rollout batch


class DraftServicer(EngineServicer[DraftEngine], draft_pb2_grpc.DraftServiceServicer):
    WHAT = "draft"
    SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name

    def __init__(self, service: Service):
        super().__init__(service)
        self.model_dir = ""
        self.transport: DraftTransport | None = None

    def add_to_server(self, server: grpc.Server) -> None:
        draft_pb2_grpc.add_DraftServiceServicer_to_server(self, server)

    def ModelInfo(self, request, context):
        engine = self.loaded()
        shape = engine.shape()
        return draft_pb2.DraftInfo(
            model=self.model_dir,
            vocab_size=shape.vocab_size,
            draft_vocab_size=engine.config.draft_vocab_size,
            target_hidden_size=shape.target_hidden_size,
            max_target_id=shape.max_target_id,
            aux_layer_ids=shape.aux_layer_ids or [],
            dtype=name_of(engine.dtype),
            device=str(engine.device),
            num_sessions=engine.num_sessions,
            max_context=engine.max_context,
            target_max_context=engine.target_max_context or 0,
            transport=self.transport.caps if self.transport is not None else None,
            compiling=not engine.compiled.is_set(),
        )

    def OpenTransport(self, request, context):
        self.loaded()
        if self.transport is None:
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION, "this draft takes features inline only")
        self.transport.open(request)
        return request

    def Session(self, request_iterator, context) -> Iterator[draft_pb2.DraftResponse]:
        """One generation: proposes (and, with overlap, ahead steps), each once its features are in."""
        session_id = None
        created = False
        with self.service.admission.admit():
            engine = self.loaded()
            try:
                assembler = FeatureAssembler()
                for request in request_iterator:
                    if session_id is None:
                        if not request.session_id:
                            raise InvalidRequest("the first message of a draft stream names the session")
                        session_id, timed = request.session_id, request.want_timing  # answers carry StepTiming
                    if not assembler.started:  # the first message of a step
                        clock = StepClock(getattr(engine, "device", None), request)
                        step = _check_step(request)
                    with clock.codec():
                        features = self._features(engine, request, step, assembler)
                    if features is None:
                        continue  # more chunks of this step to come
                    if step.HasField("ahead") and not created:
                        raise InvalidRequest("a draft stream starts with a propose, not an ahead")
                    create = not created
                    if create:
                        if session_id in engine.session_ids():
                            raise InvalidRequest(f"draft session {session_id!r} already exists")
                        created = True  # from here on the session is ours to release, even if propose fails
                        self.session(session_id, context)
                    response = self._run(engine, session_id, step, features, clock, create)
                    if timed:
                        response.timing.CopyFrom(clock.to_pb())
                    yield response
            finally:
                if created:
                    self.session_ended(session_id)

    def _features(self, engine: DraftEngine, request: draft_pb2.DraftRequest, step: draft_pb2.DraftRequest,
                  assembler: FeatureAssembler) -> torch.Tensor | None:
        """The step's new features [m, 3Ht], or None while chunks are still to come."""
        m = len(step.next_tokens)
        if step.HasField("ahead") and not m:  # no new pairs: no features follow
            return torch.empty(0, engine.feature_size)
        if request.features.WhichOneof("payload") == "ref":  # a fast path: the whole step
            if self.transport is None:
                raise NoChannel("a feature descriptor, but this draft has no fast path")
            return self.transport.recv(request.features.ref, m, engine.feature_size)
        return assembler.add(request.features, m, engine.feature_size)  # inline, once the last chunk is in

    def _run(self, engine: DraftEngine, session_id: str, step: draft_pb2.DraftRequest, features: torch.Tensor,
             clock: StepClock, create: bool) -> draft_pb2.DraftResponse:
        k, tokens = step.num_draft_tokens, list(step.next_tokens)
        if step.HasField("ahead"):
            with clock.compute():
                branches = engine.prepare(session_id, features, tokens, list(step.ahead.assumed), k, step.ahead.branches)
            self.metrics.observe("ahead", clock)
            return draft_pb2.DraftResponse(branches=branches_to_pb(branches))
        # a sampled request's settings come with the stream's first message: its drafts are drawn from q
        sampling = sampling_from_pb(step.sampling) if create and step.HasField("sampling") else None
        tree = tree_from_pb(step.tree) if step.HasField("tree") else None
        with clock.compute():
            drafts = engine.propose(session_id, features, tokens, k, create=create, sampling=sampling, tree=tree)
        return self._proposed(drafts, clock)

    def _proposed(self, drafts: Drafts, clock: StepClock) -> draft_pb2.DraftResponse:
        self.metrics.observe("propose", clock)
        response = draft_pb2.DraftResponse(drafts=drafts, q=draft_probs_to_pb(drafts.q), parents=parents_to_pb(drafts.parents))
        if clock.batch is not None:
            response.batch.id, response.batch.size = clock.batch
        return response

    def Cohort(self, request_iterator, context) -> Iterator[draft_pb2.DraftCohortResults]:
        """The cohort relay: each message's chain proposes, of sessions open on their Session streams, in
        one engine call (tandem.batching.Batcher.submit_many), answered in one message."""
        engine = self.loaded()  # open while draining too: its steps are of sessions in flight

        def parse(step: draft_pb2.DraftSessionStep) -> tuple:
            request = _check_step(step.request)
            if request.HasField("ahead") or request.HasField("tree") or request.session_id:
                raise InvalidRequest("the cohort relay takes chain proposes of open sessions only")
            chunk = request.features
            if chunk.WhichOneof("payload") != "ref" and (chunk.row_offset or not is_last_chunk(chunk)):
                raise InvalidRequest("a propose on the cohort relay carries its features in one chunk")
            features = self._features(engine, request, request, FeatureAssembler())
            return step.session_id, features, list(request.next_tokens), request.num_draft_tokens

        for message in request_iterator:
            answer = draft_pb2.DraftCohortResults()
            for result, clock in self.cohort(message.steps, parse, engine.propose_many):
                item = answer.results.add()
                if isinstance(result, BaseException):
                    self.step_error(item.error, result)
                else:
                    item.response.CopyFrom(self._proposed(result, clock))
            yield answer


def _check_step(request: draft_pb2.DraftRequest) -> draft_pb2.DraftRequest:
    """The first message of a step, which carries its settings: InvalidRequest when they are out of range."""
    k = request.num_draft_tokens
    if not 0 <= k <= MAX_DRAFT_TOKENS:
        raise InvalidRequest(f"num_draft_tokens must be in [0, {MAX_DRAFT_TOKENS}], got {k}")
    if request.HasField("tree") and request.HasField("ahead"):
        raise InvalidRequest("an ahead step drafts chains: it takes no tree")
    if request.HasField("ahead") and not 1 <= request.ahead.branches <= MAX_BRANCHES:
        raise InvalidRequest(f"ahead.branches must be in [1, {MAX_BRANCHES}], got {request.ahead.branches}")
    return request


def load(settings: DraftSettings, service: Service, servicer: DraftServicer):
    """The engine and its feature transport, attached to the servicer; the clean-up."""
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    engine = DraftEngine(settings.model, settings.target, device=settings.device, dtype=settings.dtype,
                         max_batch_size=settings.max_batch_size, max_batch_tokens=settings.max_batch_tokens,
                         q_top_n=settings.q_top_n,
                         aux_layer_convention=settings.aux_layer_convention)
    transport = DraftTransport(settings.transport, settings.device, settings.dtype, engine.feature_size,
                               traffic=service.traffic)
    servicer.model_dir = str(settings.model)
    servicer.attach(engine, settings.session_ttl, transport)
    log.info("draft %s (%s layout) on %s (%s)", settings.model, engine.layout, settings.device, settings.dtype)
    return transport.close


def serve(settings: DraftSettings) -> int:
    return run_service("draft", settings, DraftServicer, lambda service, servicer: load(settings, service, servicer))


if __name__ == "__main__":
    from tandem.config import load_settings

    sys.exit(serve(load_settings(DraftSettings)))
