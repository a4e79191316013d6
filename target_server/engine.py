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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers.cache_utils import Cache

from tandem.aux_layers import capture_ids
from tandem.batching import Batcher
from tandem.dtypes import TORCH_DTYPES
from tandem.params import MAX_DRAFT_TOKENS, SamplingParams
from tandem.protocol import DraftProbs, PrefillResult, VerifyResult
from tandem.sessions import InvalidRequest, ResourceExhausted, SessionNotFound, SessionOwner, SessionTable
from target_server.acceptance import accept, dense_q, pick, token_logprobs
from target_server.kv import KVBudget, KVLayer, KVPool, kv_budget_tokens  # noqa: F401 (re-exported)
from target_server.loading import load_target


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
        self.kv_pool = self._pool(kv_cache_tokens)
        # One forward at a time (the model and the capture hooks are shared), batched across sessions.
        self.batcher: Batcher[_Step] = Batcher(self._run_batch, max_batch_size, max_batch_tokens)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token takes over all layers (sizes --kv-cache-gib in tokens)."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * torch.empty(0, dtype=self.dtype).element_size()

    def set_kv_budget(self, tokens: int | None) -> None:
        """The KV tokens all sessions together may hold (None: unbounded), and the pool sized to them;
        before any session."""
        if self.kv_budget.used:
            raise RuntimeError("the KV budget is set before the first session")
        self.kv_pool = None  # a GPU's old pool goes before the new one is allocated
        self.kv_budget.tokens = tokens
        self.kv_pool = self._pool(tokens)

    def _pool(self, tokens: int | None) -> KVPool:
        cap = None if tokens is None else max(tokens // KVPool.BLOCK, 1)
        blocks = cap if cap is not None and self.device.type == "cuda" else 64  # a GPU's: all of it now
        return KVPool(self.num_layers, self.kv_heads, self.head_dim, self.dtype, self.device, blocks, cap)

    @property
    def gather_bytes_per_token(self) -> int:
        """The gather's memory per token of a forward's padded past: one layer's copy and its temporary
        (KVLayer gathers layer by layer)."""
        return 2 * self.kv_bytes_per_token // self.num_layers

    @torch.inference_mode()
    def measure_forward_bytes(self) -> int:
        """GPU memory one forward of the largest batch takes beyond the weights and the KV (activations,
        captured features, the verify rows' logits), measured as vLLM's profile run measures it: a
        prefill of max_batch_tokens tokens, then the logits of a full batch of verifies."""
        device = self.device
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        n = max(min(self.batcher.max_tokens, self.max_context - 1), 1)
        ids = torch.zeros(1, n, dtype=torch.long, device=device)
        layers = [KVLayer(None, (1, self.kv_heads, 0, self.head_dim), self.dtype, device) for _ in range(self.num_layers)]
        hidden = self.decoder(input_ids=ids, position_ids=torch.arange(n, device=device)[None],
                              past_key_values=Cache(layers=layers), use_cache=True).last_hidden_state
        self.capture.take()
        rows = min(n, self.batcher.max_batch * (MAX_DRAFT_TOKENS + 1))
        logits = self._logits(hidden[0, :rows]).float().log_softmax(-1)  # the acceptance rule's work, in float
        del hidden, logits, layers
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        torch.cuda.empty_cache()
        return peak

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
        reserve = self.kv_budget.reserve(reserve)
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
    def _run_batch(self, steps: list[_Step]) -> list[PrefillResult | VerifyResult | Exception]:
        """The batch in as few forwards as keep each one's padded KV within the budget; a forward that
        runs out of memory fails its steps with ResourceExhausted (the server is full), not the process."""
        results: dict[int, PrefillResult | VerifyResult | Exception] = {}
        for part in self._parts(steps):
            try:
                results.update(zip(map(id, part), self._forward(part), strict=True))
            except torch.OutOfMemoryError as exc:
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                refused = ResourceExhausted(f"the target ran out of memory in a forward of {len(part)} steps "
                                            f"({str(exc).splitlines()[0][:200]}); lower --kv-cache-gib or "
                                            f"--max-batch-tokens")
                results.update((id(step), refused) for step in part)
        ready = None
        if self.device.type == "cuda":  # before the next batch can queue a forward behind these features
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        for step in steps:
            step.session.ready = ready
        return [results[id(step)] for step in steps]

    def _parts(self, steps: list[_Step]) -> list[list[_Step]]:
        """A forward gathers B x (longest past + widest new) tokens of KV: one long session among short
        ones multiplies it. The batch as it is when that fits in the budget, else in parts that do (the
        longest pasts first, each part as large as fits)."""
        limit = self.kv_budget.tokens

        def size(part: list[_Step]) -> int:
            return len(part) * (max(s.session.length for s in part) + max(len(s.ids) for s in part))

        if limit is None or size(steps) <= limit:
            return [steps]
        parts: list[list[_Step]] = []
        for step in sorted(steps, key=lambda s: -s.session.length):
            if parts and size([*parts[-1], step]) <= limit:
                parts[-1].append(step)
            else:
                parts.append([step])
        return parts

    def _forward(self, steps: list[_Step]) -> list[PrefillResult | VerifyResult]:
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
        batch = self._gather_kv(steps, longest)
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
        self._scatter_kv(steps, past, kept, batch, width)
        for step, n in zip(steps, kept, strict=True):
            step.session.length += n
        return results

    def _grow(self, session: _Session, length: int) -> None:
        """Blocks for `length` positions."""
        need = -(-length // KVPool.BLOCK) - len(session.blocks)
        if need > 0:
            blocks = self.kv_pool.allocate(need)
            session.blocks += blocks
            first = torch.tensor(blocks, device=self.device)[:, None] * KVPool.BLOCK
            session.rows = torch.cat([session.rows.to(self.device), (first + torch.arange(KVPool.BLOCK, device=self.device)).flatten()])

    def _gather_kv(self, steps: list[_Step], longest: int) -> list[KVLayer]:
        """Each layer's view of the batch's past, each sequence left-padded to `longest`; gathered from the
        pool when the layer runs."""
        shape = (len(steps), self.kv_heads, longest, self.head_dim)
        if longest == 0:
            return [KVLayer(None, shape, self.dtype, self.device) for _ in range(self.num_layers)]
        index = pad_sequence([step.session.rows[: step.session.length] for step in steps], batch_first=True,
                             padding_side="left")  # [B, longest]; padding reads row 0, masked out

        def gather(layer: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
            def fill(keys: torch.Tensor, values: torch.Tensor) -> None:  # [B, kv_heads, longest, head_dim]
                keys.copy_(self.kv_pool.keys[layer][index].transpose(1, 2))
                values.copy_(self.kv_pool.values[layer][index].transpose(1, 2))

            return fill

        return [KVLayer(gather(layer), shape, self.dtype, self.device) for layer in range(self.num_layers)]

    def _scatter_kv(self, steps: list[_Step], past: list[int], kept: list[int], batch: list[KVLayer],
                    width: int) -> None:
        """The KV of the tokens each session commits (its first `kept` new ones) into its pool rows."""
        rows = torch.cat([step.session.rows[p : p + n] for step, p, n in zip(steps, past, kept, strict=True)])
        chosen = torch.arange(width)[None] < torch.tensor(kept)[:, None]  # [B, width]
        chosen = chosen.to(self.device)
        for layer, pool_keys, pool_values in zip(batch, self.kv_pool.keys, self.kv_pool.values, strict=True):
            pool_keys[rows] = layer.new_keys.transpose(1, 2)[chosen]
            pool_values[rows] = layer.new_values.transpose(1, 2)[chosen]

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
