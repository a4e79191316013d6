"""The target engine: a Hugging Face causal LM with per-session KV caches, feature capture and verify.

Usable in-process (the reference generator, tests) and behind the target gRPC service.
The protocol per session (ARCHITECTURE.md, 0-indexed positions):
  prefill(x_0..x_{n-1})        -> t = x_n, features F_0..F_{n-1}          [n, 3H]
  verify(t, d_1..d_K)          -> one forward at positions n..n+K, accept a drafts,
                                  bonus b, KV cropped to n+1+a, features of t, d_1..d_a [a+1, 3H]
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, GenerationConfig
from transformers.utils import logging as hf_logging

from tandem.params import SamplingParams
from tandem.protocol import PrefillResult, VerifyResult
from tandem.sessions import InvalidRequest, SessionOwner, SessionTable
from tandem.timing import engine_lock
from target_server.acceptance import accept, pick
from target_server.capture import FeatureCapture, default_layer_ids

hf_logging.disable_progress_bar()  # a service logs; it does not draw progress bars

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Session:
    cache: DynamicCache
    params: SamplingParams
    generator: torch.Generator | None
    length: int = 0  # tokens whose KV is committed
    last_used: float = field(default_factory=time.monotonic)


def aux_layer_ids_from_draft(draft_dir: str | Path) -> list[int] | None:
    """The capture layers a draft asks for (vLLM's `eagle_aux_hidden_state_layer_ids`), if any."""
    config = json.loads((Path(draft_dir) / "config.json").read_text())
    for scope in (config, config.get("eagle_config") or {}):
        ids = scope.get("eagle_aux_hidden_state_layer_ids")
        if ids:
            return [int(i) for i in ids]
    return None


def crop_cache(cache: DynamicCache, keep: int) -> None:
    """Drop KV entries past `keep`. A negative count means 'remove that many' in both transformers 4.x
    and 5.x (5.x refuses a positive absolute length), so we always pass one."""
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


class TargetEngine(SessionOwner):
    """Loads a local HF checkpoint (config.json + safetensors, single or sharded) and serves sessions."""

    def __init__(
        self,
        model_dir: str | Path,
        device: str = "cpu",
        dtype: str = "float32",
        layer_ids: list[int] | None = None,
    ):
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(f"target checkpoint {self.model_dir} has no config.json")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.config = AutoConfig.from_pretrained(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype)
        self.model.to(self.device).eval()
        layers = self.model.get_decoder().layers
        self.num_layers = len(layers)
        self.layer_ids = tuple(layer_ids) if layer_ids else default_layer_ids(self.num_layers)
        self.capture = FeatureCapture(layers, self.layer_ids)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.max_context = int(getattr(self.config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_token_ids = _eos_ids(self.model_dir, self.config)
        self.sessions: SessionTable[_Session] = SessionTable("target")
        # One forward at a time: the model and the capture hooks are shared by all sessions.
        self._lock = threading.Lock()

    def _check_ids(self, ids: list[int], what: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InvalidRequest(f"{what} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")

    # -- the protocol -----------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(
        self, session_id: str, prompt_ids: list[int], params: SamplingParams, want_features: bool = True
    ) -> PrefillResult:
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        self._check_ids(prompt_ids, "the prompt")
        if len(prompt_ids) >= self.max_context:
            raise InvalidRequest(f"the prompt has {len(prompt_ids)} tokens; the context is {self.max_context}")
        if session_id in self.sessions:
            raise InvalidRequest(f"target session {session_id!r} already exists")
        generator = None
        if not params.greedy:
            generator = torch.Generator(device=self.device)
            # a fresh seed from the OS when none is given: torch.seed() would reseed the global RNG
            seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(7), "little")
            generator.manual_seed(seed)
        # A plain DynamicCache keeps every layer's full KV, so verify can always roll back; the
        # config-built one trims sliding-window layers (Mistral) and then refuses to crop.
        session = _Session(cache=DynamicCache(), params=params, generator=generator)
        ids = torch.tensor([prompt_ids], device=self.device)
        logits, features = self._forward(ids, session, logits_to_keep=1)
        session.length = len(prompt_ids)
        token = pick(logits[-1], params, generator)
        self.sessions.add(session_id, session)
        return PrefillResult(token=token, features=features if want_features else None)

    @torch.inference_mode()
    def verify(
        self, session_id: str, token: int, drafts: list[int], want_features: bool = True
    ) -> VerifyResult:
        session = self.sessions.get(session_id)
        self._check_ids([token, *drafts], "the verify input")
        if session.length + 1 + len(drafts) > self.max_context:
            raise InvalidRequest(f"verify would pass the context of {self.max_context} tokens")
        ids = torch.tensor([[token, *drafts]], device=self.device)  # [1, K+1]
        logits, features = self._forward(ids, session, logits_to_keep=0)  # [K+1, V], [K+1, 3H]
        accepted, bonus = accept(logits, ids[0, 1:], session.params, session.generator)
        session.length += 1 + accepted
        crop_cache(session.cache, session.length)
        session.last_used = time.monotonic()
        return VerifyResult(
            accepted=list(drafts[:accepted]),
            bonus=bonus,
            features=features[: accepted + 1] if want_features else None,
        )

    def _forward(self, ids: torch.Tensor, session: _Session, logits_to_keep: int):
        with engine_lock(self._lock):  # the wait counts as queueing in the step timing
            out = self.model(
                input_ids=ids, past_key_values=session.cache, use_cache=True, logits_to_keep=logits_to_keep
            )
            features = self.capture.take()[0]  # [S, 3H]
        return out.logits[0], features


def _eos_ids(model_dir: Path, config) -> list[int]:
    eos = None
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        pass
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
