"""The target gRPC service: a thin shell over TargetEngine (unpack, call the engine, pack).

One stream from the coordinator's scheduler (proto/tandem/v1/target.proto, TargetService.Step): a batch
of steps each way per step; the sessions it opened end with it, so a coordinator that goes away frees
their KV cache too.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from functools import lru_cache

import grpc
import torch

from tandem.config import TargetSettings, parse_cpus
from tandem.convert import draft_probs_from_pb, logprobs_to_pb, parents_from_pb, sampling_from_pb
from tandem.dtypes import name_of
from tandem.errors import Abort
from tandem.memory import GIB, GPU_MARGIN, asked_tokens, gpu_headroom, gpu_part, half_the_host, room
from tandem.protocol import Prefill, PrefillResult, Verify
from tandem.service import Service, StartupError, run_service
from tandem.servicer import EngineServicer
from tandem.sessions import InvalidRequest
from tandem.staging import to_host
from tandem.transports.endpoints import RING_BYTES, TargetTransport
from tandem.v1 import common_pb2, target_pb2, target_pb2_grpc
from tandem.wire import encode_features
from target_server.engine import KVPool, TargetEngine, kv_budget_tokens
from target_server.loading import aux_layer_ids_from_draft
from target_server.threads import ThreadBurst, thread_invariant

log = logging.getLogger("tandem.target")

TOKENIZER_CHUNK_BYTES = 2 << 20


def load_tokenizer_json(model_dir) -> tuple[bytes, str, dict[str, str]]:
    """The target's tokenizer as tokenizer.json, as transformers loads it (so that the coordinator
    tokenizes exactly as `generate --in-process` does), its chat template and the special tokens a
    template may name; empty when the checkpoint has none."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            template = tokenizer.chat_template or ""
            if isinstance(template, dict):  # named templates: the default one
                template = template.get("default", "")
            special = {name: str(value) for name, value in tokenizer.special_tokens_map.items()
                       if isinstance(value, str)}
            return backend.to_str().encode(), template, special
    except (OSError, ValueError) as exc:
        log.warning("no tokenizer for %s (%s): clients must send token ids", model_dir, exc)
    return b"", "", {}


@lru_cache(maxsize=4)
def load_generation_config(model_dir) -> str:
    """generation_config.json's values that differ from transformers' defaults, as JSON (what vLLM takes
    its default sampling from); empty when the checkpoint has none."""
    try:
        from transformers import GenerationConfig

        return json.dumps(GenerationConfig.from_pretrained(model_dir).to_diff_dict())
    except (OSError, ValueError, TypeError):
        return ""


class TargetServicer(EngineServicer[TargetEngine], target_pb2_grpc.TargetServiceServicer):
    WHAT = "target"
    BATCH = target_pb2.TargetBatch
    SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name

    def __init__(self, service: Service):
        super().__init__(service)
        self.tokenizer_json = b""
        self.chat_template, self.special_tokens = "", {}
        self.transport: TargetTransport | None = None
        self.timed: set[str] = set()  # sessions whose answers carry their StepTiming (a profiled request)

    def add_to_server(self, server: grpc.Server) -> None:
        target_pb2_grpc.add_TargetServiceServicer_to_server(self, server)

    def ModelInfo(self, request, context):
        engine = self.loaded()
        return target_pb2.TargetInfo(
            model=str(engine.model_dir),
            vocab_size=engine.vocab_size,
            hidden_size=engine.hidden_size,
            num_layers=engine.num_layers,
            layer_ids=list(engine.aux_layer_ids),
            eos_token_ids=engine.eos_token_ids,
            max_context=engine.max_context,
            kv_cache_tokens=engine.kv_budget.tokens or 0,
            dtype=name_of(engine.dtype),
            device=str(engine.device),
            tokenizer_size=len(self.tokenizer_json),
            num_sessions=engine.num_sessions,
            buckets_compiling=engine.buckets_compiling,
            transport=self.transport.caps if self.transport is not None else None,
            chat_template=self.chat_template,
            special_tokens=self.special_tokens,
            generation_config=load_generation_config(str(engine.model_dir)),
            local_steps=self.local_steps.info() if self.local_steps is not None else None,
        )

    def _transport(self) -> TargetTransport:
        self.loaded()
        if self.transport is None:
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION, "this target sends features inline only")
        return self.transport

    def OpenTransport(self, request, context):
        return self._transport().open(request)

    def StartTransport(self, request, context):
        self._transport().start(request)
        return request

    def GetTokenizer(self, request, context):
        self.loaded()
        data = self.tokenizer_json
        for start in range(0, len(data), TOKENIZER_CHUNK_BYTES):
            yield target_pb2.FileChunk(data=data[start : start + TOKENIZER_CHUNK_BYTES])

    def Step(self, request_iterator, context) -> Iterator[target_pb2.TargetBatchResult]:
        """The scheduler's stream: each TargetBatch (prefills, verifies, decodes, releases) as one batch."""
        return self.steps(request_iterator, context, self._parse, self._answer)

    def _parse(self, step: target_pb2.SessionStep) -> tuple[Prefill | Verify, bool]:
        kind = step.request.WhichOneof("step")
        if kind == "prefill":
            p = step.request.prefill
            if p.want_timing:
                self.timed.add(step.session_id)
            return Prefill(step.session_id, list(p.prompt_ids), sampling_from_pb(p.sampling), p.want_features,
                           p.max_new_tokens if p.HasField("max_new_tokens") else None,
                           p.verify_tokens if p.HasField("verify_tokens") else None,
                           allowed=p.allowed or None,
                           output_start=p.output_start if p.HasField("output_start") else None), True
        if kind == "verify":
            v = step.request.verify
            return Verify(step.session_id, v.token, list(v.drafts), v.want_features, draft_probs_from_pb(v.q),
                          parents_from_pb(v.parents), v.decode, list(v.stop_ids), v.allowed or None), False
        raise InvalidRequest("a target step needs a prefill or a verify")

    def _answer(self, done: list) -> target_pb2.TargetBatchResult:
        answer = target_pb2.TargetBatchResult()
        for (step, clock, result), features in zip(done, self._features(done), strict=True):
            item = answer.results.add()
            if isinstance(result, BaseException):
                self.step_error(item.error, result)
                continue
            response = item.response
            if isinstance(result, PrefillResult):
                response.prefilled.token = result.token
                if result.logprobs is not None:
                    response.prefilled.logprobs.extend(logprobs_to_pb(result.logprobs))
                kind = "prefill"
            else:
                verified = response.verified
                verified.accepted.extend(result.accepted)
                verified.bonus, verified.warming = result.bonus, result.warming
                if result.logprobs is not None:
                    verified.logprobs.extend(logprobs_to_pb(result.logprobs))
                kind = "verify"
            if isinstance(features, torch.Tensor):  # inline: the rows in the answer
                with clock.codec():
                    (features,) = encode_features(features, max(1, features.numel() * features.element_size()))
            if features is not None:
                response.features.CopyFrom(features)
            self.metrics.observe(kind, clock)
            if step.session_id in self.timed:
                response.timing.CopyFrom(clock.to_pb())
        return answer

    def _features(self, done: list) -> list[common_pb2.Features | torch.Tensor | None]:
        """Each step's features: a fast path's descriptor, else its rows on the host to go inline (all of the
        batch's copied at once, after the batch: one wait), else None."""
        engine, out, inline = self.loaded(), [None] * len(done), []
        for i, (step, _, result) in enumerate(done):
            features = None if isinstance(result, BaseException) else result.features
            if features is None:
                continue
            ready = engine.features_ready(step.session_id)
            ref = self.transport.send(step.session_id, features, ready) if self.transport is not None else None
            n = features.shape[0]
            if ref is not None:
                out[i] = common_pb2.Features(ref=ref, row_offset=0, num_rows=n, total_rows=n)
            else:
                inline.append((i, features, ready))
        for (i, _, _), rows in zip(inline, to_host([f for _, f, _ in inline], [r for _, _, r in inline]), strict=True):
            out[i] = rows
        return out

    def _end(self, session_id: str) -> None:
        super()._end(session_id)
        self.timed.discard(session_id)


def kv_tokens(settings: TargetSettings, engine: TargetEngine) -> int | None:
    """The KV budget in tokens. On a GPU everything else that takes memory is counted first (kv_budget_tokens:
    the feature ring or queue, a measured forward of the largest batch, the gather, a margin), within the
    target's part of a GPU it shares with the draft (tandem/memory.py), and a --kv-cache-gib that does not fit
    is refused at start-up rather than run out of memory later. On a CPU: --kv-cache-gib, or half the memory
    available."""
    per_token = engine.kv_bytes_per_token
    asked = asked_tokens(settings.kv_cache_gib, per_token)
    if engine.device.type != "cuda":
        return asked if asked is not None else half_the_host(per_token)
    # the cuda-ipc ring or the nccl send queue lives on our GPU, and is allocated later, at the handshake
    ring = RING_BYTES if settings.transport in ("auto", "cuda-ipc", "nccl") else 0
    forward = engine.measure_forward_bytes()
    free, total = torch.cuda.mem_get_info(engine.device)
    own = torch.cuda.memory_allocated(engine.device)
    headroom = gpu_headroom(free, total, own, gpu_part("target", settings.shared_gpu))
    fits = kv_budget_tokens(headroom, total, per_token, engine.num_layers, ring_bytes=ring, forward_bytes=forward)
    if (asked is not None and asked > fits) or fits < KVPool.BLOCK:
        raise StartupError(
            f"the KV cache does not fit: {room('target', free, total, own, settings.shared_gpu)}; a forward takes "
            f"{forward / GIB:.2f}, the feature ring {ring / GIB:.2f}, {GPU_MARGIN:.0%} is kept back, and each KV token {per_token} bytes plus the "
            f"gather's {engine.gather_bytes_per_token}: room for {fits} tokens"
            + (f", --kv-cache-gib asks for {asked}" if asked is not None else "")
        )
    return asked if asked is not None else fits


def load(settings: TargetSettings, service: Service, servicer: TargetServicer):
    """The engine, its KV budget and its feature transport, attached to the servicer; the clean-up."""
    layer_ids = None
    if settings.draft is not None:
        layer_ids = aux_layer_ids_from_draft(settings.draft, settings.model, settings.aux_layer_convention)
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    engine = TargetEngine(
        settings.model, device=settings.device, dtype=settings.dtype, aux_layer_ids=layer_ids,
        max_batch_size=settings.max_batch_size, max_batch_tokens=settings.max_batch_tokens,
    )
    if settings.burst_cpus and engine.device.type == "cpu":
        if (varies := thread_invariant(engine.model)) is None:
            engine.burst = ThreadBurst(parse_cpus(settings.burst_cpus, available=False))
        else:
            log.info("the target's forwards keep to their own CPUs: %s (its output would depend on the threads)",
                     varies)
    try:
        engine.set_kv_budget(kv_tokens(settings, engine))  # a GPU's pool is allocated here, before the ring
    except torch.OutOfMemoryError as exc:
        raise StartupError(f"the KV pool does not fit on {engine.device}: {exc}") from None
    transport = TargetTransport(
        settings.transport, settings.device, settings.dtype, 3 * engine.hidden_size, host=settings.host,
        traffic=service.traffic,
    )
    servicer.tokenizer_json, servicer.chat_template, servicer.special_tokens = load_tokenizer_json(settings.model)
    servicer.attach(engine, transport)
    log.info(
        "target %s on %s (%s, %s engine): vocab %d, hidden %d, capture layers %s; batches of <= %d steps, KV budget "
        "%s tokens", settings.model, settings.device, settings.dtype, engine.engine, engine.vocab_size,
        engine.hidden_size, engine.aux_layer_ids,
        settings.max_batch_size, engine.kv_budget.tokens or "unbounded",
    )
    return transport.close  # unlinks a shared memory ring


def serve(settings: TargetSettings) -> int:
    return run_service("target", settings, TargetServicer, lambda service, servicer: load(settings, service, servicer))


if __name__ == "__main__":
    from tandem.config import load_settings

    sys.exit(serve(load_settings(TargetSettings)))
