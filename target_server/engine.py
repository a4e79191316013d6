"""The target engine: a Hugging Face causal LM with per-session KV caches, feature capture and verify.

Usable in-process (the reference generator, tests) and behind the target gRPC service.
The protocol per session (docs/architecture.md, 0-indexed positions):
  prefill(x_0..x_{n-1})        -> t = x_n, features F_0..F_{n-1}          [n, 3H]
  verify(t, d_1..d_K)          -> one forward at positions n..n+K, accept a drafts,
                                  bonus b, KV cropped to n+1+a, features of t, d_1..d_a [a+1, 3H]

Concurrent sessions are batched (tandem/batching.py): the prefill steps queued while a forward runs
share the next one, and so do the verify steps (a prefill padded among verifies is wasted work).
Every session's KV lives in one paged pool (KVPool); a batch gathers the sessions' pasts left-padded
(with an attention mask and per-sequence positions), runs one forward over the new tokens
right-padded, and scatters back only the KV of the tokens each session commits. KV memory is bounded: a prefill reserves its whole
generation's KV (prompt + max_new_tokens) and waits, then fails with ResourceExhausted, while the
budget is taken.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers.cache_utils import Cache, DynamicLayer

from tandem.aux_layers import capture_ids
from tandem.batching import Batcher
from tandem.dtypes import TORCH_DTYPES
from tandem.params import MAX_DRAFT_TOKENS, SamplingParams
from tandem.protocol import DraftProbs, PrefillResult, TokenLogprob, VerifyResult
from tandem.sessions import InvalidRequest, ResourceExhausted, SessionNotFound, SessionOwner, SessionTable
from target_server.acceptance import accept, dense_q, pick
from target_server.loading import load_target


class KVLayer(DynamicLayer):
    """One layer's KV for one forward, in a buffer [B, kv_heads, capacity, head_dim] holding the batch's
    past (the first `length` positions) with room for the new tokens, which the forward writes in place.
    transformers' DynamicLayer concatenates, which copies the whole cache at every step."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self.buffer_keys, self.buffer_values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.length = length
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        self.buffer_keys[:, :, self.length : end] = key_states
        self.buffer_values[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self.buffer_keys[:, :, :end], self.buffer_values[:, :, :end]
        return self.keys, self.values


class KVPool:
    """Every session's KV in blocks of BLOCK positions (vLLM's paged KV cache, gathered for each forward):
    per layer one keys and one values tensor [blocks * BLOCK, kv_heads, head_dim]. A session holds a list
    of blocks and `rows`, the pool row of each of its positions. A batch's past is one gather per layer,
    and the tokens it commits one scatter per layer, whatever the number of sessions (per-session
    buffers cost two copies per session and layer each way: 30% of the target's time at 16 sessions).
    The pool grows by doubling when its blocks run out; the KV budget bounds what the sessions hold."""

    BLOCK = 16

    def __init__(self, layers: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 blocks: int = 64):
        self.shape = (heads, head_dim)
        self.keys = [torch.zeros(blocks * self.BLOCK, heads, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self._free = list(range(blocks))
        self._lock = threading.Lock()  # releases come from the service threads

    @property
    def blocks(self) -> int:
        return self.keys[0].shape[0] // self.BLOCK

    def allocate(self, n: int) -> list[int]:
        with self._lock:
            if len(self._free) < n:
                old = self.blocks
                grown = max(2 * old, old + n - len(self._free))
                for table in (self.keys, self.values):
                    for i, t in enumerate(table):
                        table[i] = torch.cat([t, t.new_zeros((grown - old) * self.BLOCK, *self.shape)])
                self._free += range(old, grown)
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def free(self, blocks: list[int]) -> None:
        with self._lock:
            self._free += blocks


@dataclass
class _Session:
    params: SamplingParams
    generator: torch.Generator | None
    length: int = 0  # tokens whose KV is committed
    reserved: int = 0  # KV tokens this session may grow to (its share of the budget)
    blocks: list[int] = field(default_factory=list)  # its KVPool blocks
    rows: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))  # pool row per position
    last_used: float = field(default_factory=time.monotonic)
    ready: torch.cuda.Event | None = None  # CUDA: recorded at the end of the batch that computed its last features


@dataclass
class _Step:
    """One session's part of a batched forward."""

    kind: Literal["prefill", "verify"]
    session: _Session
    ids: list[int]  # the new tokens: the prompt, or [t, d_1..d_K]
    want_features: bool
    q: torch.Tensor | None = None  # a verify of sampled drafts: what each was sampled from, [K, V] (dense_q)


class KVBudget:
    """The KV tokens all sessions together may hold. A new session reserves its whole generation up
    front, so a running one never waits for memory mid-generation (no preemption needed); when the
    budget is taken, a new one waits up to `timeout` seconds for sessions to finish, then is refused."""

    def __init__(self, tokens: int | None, timeout: float):
        self.tokens = tokens  # None: unbounded
        self.timeout = timeout
        self.used = 0
        self._changed = threading.Condition()

    def reserve(self, n: int) -> None:
        if self.tokens is not None and n > self.tokens:
            raise ResourceExhausted(f"the request needs {n} KV tokens; the whole KV budget is {self.tokens}")
        deadline = time.monotonic() + self.timeout
        with self._changed:
            while self.tokens is not None and self.used + n > self.tokens:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ResourceExhausted(
                        f"the KV budget is taken ({self.used} of {self.tokens} tokens reserved; this request "
                        f"needs {n}) and no session finished within {self.timeout:g}s"
                    )
                self._changed.wait(left)
            self.used += n

    def free(self, n: int) -> None:
        with self._changed:
            self.used -= n
            self._changed.notify_all()


def aux_layer_ids_from_draft(
    draft_dir: str | Path, target_dir: str | Path | None = None, convention: str | None = None
) -> list[int] | None:
    """The hidden states a draft asks for (its `eagle_aux_hidden_state_layer_ids`, converted from its
    convention: tandem/aux_layers.py), if it names any."""
    ids = capture_ids(draft_dir, target_dir, convention)
    return list(ids) if ids is not None else None


class TargetEngine(SessionOwner):
    """Loads a local HF checkpoint (config.json + safetensors, single or sharded) and serves sessions."""

    def __init__(
        self,
        model_dir: str | Path,
        device: str = "cpu",
        dtype: str = "float32",
        aux_layer_ids: list[int] | None = None,
        max_batch_size: int = 32,
        max_batch_tokens: int = 4096,
        kv_cache_tokens: int | None = None,
        queue_timeout: float = 30.0,
    ):
        self.model_dir = Path(model_dir)
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)}, got {dtype!r}")
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[dtype]
        loaded = load_target(self.model_dir, self.device, self.dtype, aux_layer_ids)
        self.model, self.capture, self.eos_token_ids = loaded.model, loaded.capture, loaded.eos_token_ids
        self.config = config = loaded.config
        self.aux_layer_ids, self.num_layers = loaded.aux_layer_ids, loaded.num_layers
        self.hidden_size, self.vocab_size = loaded.hidden_size, loaded.vocab_size
        self.decoder = self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.max_context = int(getattr(self.config, "max_position_embeddings", 0) or 1 << 30)
        self.sessions: SessionTable[_Session] = SessionTable("target")
        self.kv_budget = KVBudget(kv_cache_tokens, queue_timeout)
        self.kv_pool = KVPool(self.num_layers, self.kv_heads, self.head_dim, self.dtype, self.device)
        # One forward at a time (the model and the capture hooks are shared), batched across sessions.
        self.batcher: Batcher[_Step] = Batcher(self._run_batch, max_batch_size, max_batch_tokens)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token takes over all layers (sizes --kv-cache-gib in tokens)."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * torch.empty(0, dtype=self.dtype).element_size()

    def release(self, session_id: str) -> bool:
        session = self.sessions.pop(session_id)
        self.batcher.forget(session_id)
        if session is None:
            return False
        self._free(session)
        return True

    def evict_idle(self, ttl: float) -> list[str]:
        evicted = self.sessions.evict_idle_items(ttl)
        for session in evicted.values():
            self._free(session)
        return list(evicted)

    def _free(self, session: _Session) -> None:
        self.kv_pool.free(session.blocks)
        session.blocks = []
        self.kv_budget.free(session.reserved)

    def features_ready(self, session_id: str) -> torch.cuda.Event | None:
        """The CUDA event at the end of the batch that computed the session's last features (None on a CPU):
        a fast path reads them after it, on its own stream, not behind the next batch's forward."""
        try:
            return self.sessions.get(session_id).ready
        except SessionNotFound:
            return None

    def _check_ids(self, ids: list[int], what: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InvalidRequest(f"{what} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")

    # -- the protocol -----------------------------------------------------------------------

    def prefill(
        self,
        session_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        want_features: bool = True,
        max_new_tokens: int | None = None,
    ) -> PrefillResult:
        """`max_new_tokens` (None: up to the context) sizes the session's share of the KV budget."""
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
        # the whole generation; a verify holds up to K+1 uncommitted tokens for a moment
        reserve = self.max_context
        if max_new_tokens is not None:
            reserve = min(reserve, len(prompt_ids) + max_new_tokens + MAX_DRAFT_TOKENS + 1)
        self.kv_budget.reserve(reserve)
        # Every layer keeps its full KV, so verify can always roll back (a config-built cache trims
        # sliding-window layers, Mistral's, and then cannot crop); blocks are taken as it grows.
        session = _Session(params=params, generator=generator, reserved=reserve)
        try:
            step = _Step("prefill", session, list(prompt_ids), want_features)
            result = self.batcher.submit(step, len(prompt_ids), key=session_id, group="prefill")
            self.sessions.add(session_id, session)
        except BaseException:
            self._free(session)
            raise
        return result

    def verify(self, session_id: str, token: int, drafts: list[int], want_features: bool = True,
               q: list[DraftProbs] | None = None) -> VerifyResult:
        """`q`: for a sampled session, the distribution the draft sampled each draft from (speculative
        sampling, target_server/acceptance.py); None: the drafts are the draft's argmax."""
        session = self.sessions.get(session_id)
        self._check_ids([token, *drafts], "the verify input")
        dense = None
        if q and not session.params.greedy:
            try:
                dense = dense_q(q, drafts, self.vocab_size)  # here, not in the batch: the batch is one thread
            except ValueError as exc:
                raise InvalidRequest(str(exc)) from None
        grown = session.length + 1 + len(drafts)
        if grown > self.max_context:
            raise InvalidRequest(f"verify would pass the context of {self.max_context} tokens")
        if grown > session.reserved:
            raise InvalidRequest(
                f"verify would grow the session to {grown} tokens, past the {session.reserved} its prefill "
                "reserved (prompt + max_new_tokens)"
            )
        step = _Step("verify", session, [token, *drafts], want_features, dense)
        result = self.batcher.submit(step, 1 + len(drafts), key=session_id, group="verify")
        session.last_used = time.monotonic()
        return result

    # -- one batched forward ------------------------------------------------------------------

    @torch.inference_mode()
    def _run_batch(self, steps: list[_Step]) -> list[PrefillResult | VerifyResult]:
        past = [step.session.length for step in steps]
        sizes = [len(step.ids) for step in steps]
        longest, width = max(past), max(sizes)
        for step, n in zip(steps, sizes, strict=True):
            self._grow(step.session, step.session.length + n)
        ids = torch.zeros(len(steps), width, dtype=torch.long)
        mask = torch.zeros(len(steps), longest + width, dtype=torch.long)
        positions = torch.zeros(len(steps), width, dtype=torch.long)
        for i, step in enumerate(steps):
            ids[i, : sizes[i]] = torch.tensor(step.ids)
            mask[i, longest - past[i] : longest + sizes[i]] = 1  # padding before the past and after the new tokens
            positions[i] = torch.arange(past[i], past[i] + width)
        batch = self._gather_kv(steps, longest, width)
        hidden = self.decoder(
            input_ids=ids.to(self.device),
            attention_mask=None if len(steps) == 1 else mask.to(self.device),
            position_ids=positions.to(self.device),
            past_key_values=Cache(layers=batch),
            use_cache=True,
        ).last_hidden_state
        features = self.capture.take()
        # one lm_head call for the batch: the last prompt row of a prefill, every row of a verify
        rows = [hidden[i, n - 1 : n] if step.kind == "prefill" else hidden[i, :n]
                for i, (step, n) in enumerate(zip(steps, sizes, strict=True))]
        logits = self._logits(torch.cat(rows)).split([len(r) for r in rows])
        kept = [0] * len(steps)
        results = [self._finish(step, logits[i], features[i, : sizes[i]], lambda n, i=i: kept.__setitem__(i, n))
                   for i, step in enumerate(steps)]
        self._scatter_kv(steps, past, kept, batch, longest, width)
        ready = None
        if self.device.type == "cuda":  # before the next batch can queue a forward behind these features
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        for step, n in zip(steps, kept, strict=True):
            step.session.length += n
            step.session.ready = ready
        return results

    def _grow(self, session: _Session, length: int) -> None:
        """Blocks for `length` positions."""
        need = -(-length // KVPool.BLOCK) - len(session.blocks)
        if need > 0:
            blocks = self.kv_pool.allocate(need)
            session.blocks += blocks
            first = torch.tensor(blocks, device=self.device)[:, None] * KVPool.BLOCK
            session.rows = torch.cat([session.rows.to(self.device), (first + torch.arange(KVPool.BLOCK, device=self.device)).flatten()])

    def _gather_kv(self, steps: list[_Step], longest: int, width: int) -> list[KVLayer]:
        """The batch's KV, each sequence's past left-padded to `longest`, with room for `width` new tokens."""
        shape = (len(steps), self.kv_heads, longest + width, self.head_dim)
        if longest == 0:
            return [KVLayer(torch.empty(shape, dtype=self.dtype, device=self.device),
                            torch.empty(shape, dtype=self.dtype, device=self.device), 0)
                    for _ in range(self.num_layers)]
        index = pad_sequence([step.session.rows[: step.session.length] for step in steps], batch_first=True,
                             padding_side="left")  # [B, longest]; padding reads row 0, masked out
        batch = []
        for pool_keys, pool_values in zip(self.kv_pool.keys, self.kv_pool.values, strict=True):
            keys = torch.empty(shape, dtype=self.dtype, device=self.device)
            values = torch.empty(shape, dtype=self.dtype, device=self.device)
            keys[:, :, :longest] = pool_keys[index].transpose(1, 2)
            values[:, :, :longest] = pool_values[index].transpose(1, 2)
            batch.append(KVLayer(keys, values, longest))
        return batch

    def _scatter_kv(self, steps: list[_Step], past: list[int], kept: list[int], batch: list[KVLayer],
                    longest: int, width: int) -> None:
        """The KV of the tokens each session commits (its first `kept` new ones) into its pool rows."""
        rows = torch.cat([step.session.rows[p : p + n] for step, p, n in zip(steps, past, kept, strict=True)])
        chosen = torch.arange(width)[None] < torch.tensor(kept)[:, None]  # [B, width]
        chosen = chosen.to(self.device)
        for layer, pool_keys, pool_values in zip(batch, self.kv_pool.keys, self.kv_pool.values, strict=True):
            pool_keys[rows] = layer.buffer_keys[:, :, longest:].transpose(1, 2)[chosen]
            pool_values[rows] = layer.buffer_values[:, :, longest:].transpose(1, 2)[chosen]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)  # Gemma 2/3
        return torch.tanh(logits / cap) * cap if cap else logits

    def _finish(
        self, step: _Step, logits: torch.Tensor, features: torch.Tensor, commit: Callable[[int], None]
    ) -> PrefillResult | VerifyResult:
        """Sample or accept from one sequence's logits (prefill: [1, V], verify: [K+1, V]); `commit(n)`
        is told how many of its new tokens it keeps."""
        session = step.session
        if step.kind == "prefill":
            keep = len(step.ids)
            out = PrefillResult(token=pick(logits[-1], session.params, session.generator),
                                features=features if step.want_features else None)
            if session.params.logprobs is not None:
                out.logprobs = token_logprobs(logits[-1:], [out.token], session.params.logprobs)
        else:
            drafts = step.ids[1:]
            drafted = torch.tensor(drafts, dtype=torch.long, device=self.device)
            accepted, bonus = accept(logits, drafted, session.params, session.generator, step.q)
            keep = 1 + accepted
            out = VerifyResult(
                accepted=drafts[:accepted], bonus=bonus, features=features[:keep] if step.want_features else None
            )
            if session.params.logprobs is not None:  # rows 0..a: the positions of d_1..d_a and b
                out.logprobs = token_logprobs(logits[:keep], [*out.accepted, bonus], session.params.logprobs)
        commit(keep)
        return out


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """logits [n, V] at the positions of the n committed `tokens` -> each token's logprob under the
    target's raw distribution (before temperature, top-k, top-p: vLLM's default `raw_logprobs`) and
    the `top` likeliest alternatives. Only for requests that ask: one log_softmax over rows the
    engine already has."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()  # [n]
    values, ids = logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], logprobs[:, :0].long())  # [n, top]
    return [TokenLogprob(lp, i, v) for lp, i, v in zip(chosen, ids.tolist(), values.tolist(), strict=True)]
