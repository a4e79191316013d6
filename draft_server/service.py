"""The draft gRPC service: a thin shell over DraftEngine.

One stream from the coordinator's scheduler (proto/tandem/v1/draft.proto, DraftService.Step): a batch of
steps each way per step, each step's features inline or as a fast path's descriptor.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator

import grpc
import torch

from draft_server.budget import kv_tokens
from draft_server.engine import DraftEngine
from tandem.config import DraftSettings
from tandem.convert import (
    branches_to_pb,
    draft_constraint_from_pb,
    draft_probs_to_pb,
    parents_to_pb,
    sampling_from_pb,
    tree_from_pb,
)
from tandem.dtypes import name_of
from tandem.errors import Abort
from tandem.params import MAX_DRAFT_TOKENS
from tandem.protocol import Ahead, Drafts, Propose
from tandem.service import Service, StartupError, run_service
from tandem.servicer import EngineServicer
from tandem.sessions import InvalidRequest
from tandem.transports.contract import NoChannel
from tandem.transports.endpoints import DraftTransport
from tandem.v1 import draft_pb2, draft_pb2_grpc
from tandem.wire import FeatureAssembler, is_last_chunk

log = logging.getLogger("tandem.draft")

MAX_BRANCHES = 64  # outcomes an ahead step may prepare for: each is one row of its rollout batch


class DraftServicer(EngineServicer[DraftEngine], draft_pb2_grpc.DraftServiceServicer):
    WHAT = "draft"
    BATCH = draft_pb2.DraftBatch
    SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name

    def __init__(self, service: Service):
        super().__init__(service)
        self.model_dir = ""
        self.transport: DraftTransport | None = None
        self.timed: set[str] = set()  # sessions whose answers carry their StepTiming (a profiled request)

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
            local_steps=self.local_steps.info() if self.local_steps is not None else None,
        )

    def OpenTransport(self, request, context):
        self.loaded()
        if self.transport is None:
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION, "this draft takes features inline only")
        self.transport.open(request)
        return request

    def Step(self, request_iterator, context) -> Iterator[draft_pb2.DraftBatchResult]:
        """The scheduler's stream: each DraftBatch (proposes, trees, aheads, releases) as one batch."""
        return self.steps(request_iterator, context, self._parse, self._answer)

    def _parse(self, step: draft_pb2.DraftSessionStep) -> tuple[Propose | Ahead, bool]:
        engine, request = self.loaded(), _check_step(step.request)
        if step.open and request.HasField("ahead"):
            raise InvalidRequest("a draft session opens with a propose, not an ahead")
        if step.open and step.session_id in engine.session_ids():
            raise InvalidRequest(f"draft session {step.session_id!r} already exists")
        features = self._features(engine, request)
        tokens, k = list(request.next_tokens), request.num_draft_tokens
        if request.HasField("ahead"):
            return Ahead(step.session_id, features, tokens, list(request.ahead.assumed), k, request.ahead.branches), False
        if step.open and request.want_timing:
            self.timed.add(step.session_id)
        # a sampled request's settings come with its first step: its drafts are drawn from q
        sampling = sampling_from_pb(request.sampling) if step.open and request.HasField("sampling") else None
        tree = tree_from_pb(request.tree) if request.HasField("tree") else None
        constraint = draft_constraint_from_pb(request.constraint) if step.open and request.HasField("constraint") \
            else None
        return Propose(step.session_id, features, tokens, k, step.open, sampling, tree,
                       constraint=constraint), step.open

    def _features(self, engine: DraftEngine, request: draft_pb2.DraftRequest) -> torch.Tensor:
        """The step's new features [m, 3Ht]: a fast path's, or inline in the message."""
        m = len(request.next_tokens)
        if not m:  # an ahead with no new pairs
            return torch.empty(0, engine.feature_size)
        chunk = request.features
        if chunk.WhichOneof("payload") == "ref":
            if self.transport is None:
                raise NoChannel("a feature descriptor, but this draft has no fast path")
            return self.transport.recv(chunk.ref, m, engine.feature_size, consumer=engine.stream)
        if chunk.row_offset or not is_last_chunk(chunk):
            raise InvalidRequest("a draft step carries its features in one piece")
        return FeatureAssembler().add(chunk, m, engine.feature_size)

    def _answer(self, done: list) -> draft_pb2.DraftBatchResult:
        answer = draft_pb2.DraftBatchResult()
        for step, clock, result in done:
            item = answer.results.add()
            if isinstance(result, BaseException):
                self.step_error(item.error, result)
                continue
            if isinstance(result, Drafts):
                self.metrics.observe("propose", clock)
                item.response.CopyFrom(draft_pb2.DraftResponse(drafts=result, q=draft_probs_to_pb(result.q),
                                                               parents=parents_to_pb(result.parents)))
            else:
                self.metrics.observe("ahead", clock)
                item.response.branches.extend(branches_to_pb(result))
            if step.session_id in self.timed:
                item.response.timing.CopyFrom(clock.to_pb())
        return answer

    def _end(self, session_id: str) -> None:
        super()._end(session_id)
        self.timed.discard(session_id)


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
                         aux_layer_convention=settings.aux_layer_convention)
    try:
        engine.kv_budget.tokens = kv_tokens(engine, settings.kv_cache_gib, settings.shared_gpu)
    except torch.OutOfMemoryError as exc:  # the probe propose that measures a step's working memory
        raise StartupError(f"the draft cannot run a propose on {engine.device}: {exc}") from None
    transport = DraftTransport(settings.transport, settings.device, settings.dtype, engine.feature_size,
                               traffic=service.traffic)
    servicer.model_dir = str(settings.model)
    servicer.attach(engine, transport)
    log.info("draft %s (%s layout) on %s (%s): KV budget %s tokens", settings.model, engine.layout, settings.device,
             settings.dtype, engine.kv_budget.tokens or "unbounded")
    return transport.close


def serve(settings: DraftSettings) -> int:
    return run_service("draft", settings, DraftServicer, lambda service, servicer: load(settings, service, servicer))


if __name__ == "__main__":
    from tandem.config import load_settings

    sys.exit(serve(load_settings(DraftSettings)))
