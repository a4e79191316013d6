"""The target engine: a Hugging Face causal LM with per-session KV caches, feature capture and verify.

Usable in-process (the reference generator, tests) and behind the target gRPC service.
The protocol per session (docs/architecture.md, 0-indexed positions):
  prefill(x_0..x_{n-1})        -> t = x_n, features F_0..F_{n-1}          [n, 3H]
  verify(t, d_1..d_K)          -> one forward at positions n..n+K, accept a drafts,
                                  bonus b, KV cropped to n+1+a, features of t, d_1..d_a [a+1, 3H]
  verify(t, tree d_1..d_N)     -> one forward, each node at n + its depth seeing its own path only; accept
                                  a path of a nodes, bonus b, KV of t and the path at n..n+a, their features

The coordinator's scheduler sends one batch a step (`run`), run at once. Every session's KV lives in one
paged pool. A Llama-family target runs our own model (target_server/native.py): one forward over the
batch's new tokens flattened, reading and writing the pool in place, compiled once per token bucket. Any
other runs transformers' model over a padded batch, the pasts gathered out of the pool and the committed
rows scattered back (target_server/runners.py). On a CPU a forward may borrow the draft's CPUs where that
measures faster (target_server/threads.py). The acceptance rule reads the batch's argmax in one host sync
(greedy). KV memory is bounded and taken as a session grows (vLLM's paged KV): a prefill reserves its
prompt and one verify's width, a verify grows the reservation, and either is refused with ResourceExhausted
while the budget is taken (the scheduler keeps a refused prefill waiting and preempts for a verify).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoConfig

from tandem.dtypes import TORCH_DTYPES
from tandem.params import MAX_DRAFT_TOKENS, MAX_TREE_NODES, SamplingParams
from tandem.protocol import Prefill, PrefillResult, TargetStep, Verify, VerifyResult
from tandem.sessions import (
    InvalidRequest,
    ResourceExhausted,
    SessionNotFound,
    SessionOwner,
    SessionTable,
    build_batch,
)
from target_server import logits as processing
from target_server.acceptance import dense_q, tree_problem, tree_q
from target_server.decode import check_decode, decode_rest
from target_server.kv import VERIFY_TOKENS, KVBudget, KVLayer, KVPool, kv_budget_tokens  # noqa: F401
from target_server.loading import eos_token_ids, load_target
from target_server.native import load_native, unsupported
from target_server.results import step_result
from target_server.runners import HFRunner, NativeRunner, compile_default
from target_server.steps import Session, Step
from target_server.threads import ThreadBurst

log = logging.getLogger("tandem.target")


class TargetEngine(SessionOwner):
    """Loads a local HF checkpoint (config.json + safetensors, single or sharded) and serves sessions.

    `engine`: "native" (our model: the Llama family), "hf" (transformers'), "auto" (native where it can).
    `compile` (None: runners.compile_default): torch.compile the native forward, once per bucket; "background":
    on a thread of its own, each bucket eager until its graph is ready (warmup.WarmUp)."""

    def __init__(
        self,
        model_dir: str | Path,
        device: str = "cpu",
        dtype: str = "float32",
        aux_layer_ids: list[int] | None = None,
        max_batch_size: int = 32,
        max_batch_tokens: int = 4096,
        kv_cache_tokens: int | None = None,
        engine: Literal["auto", "native", "hf"] = "auto",
        compile: bool | str | None = None,
    ):
        self.model_dir = Path(model_dir)
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)}, got {dtype!r}")
        self.device, self.dtype = torch.device(device), TORCH_DTYPES[dtype]
        native = None
        if engine not in ("auto", "native", "hf"):
            raise ValueError(f"engine must be auto, native or hf, got {engine!r}")
        if engine != "hf":
            native = load_native(self.model_dir, self.device, self.dtype, aux_layer_ids or ())
        if native is not None:
            self.model, self.config = native, native.config
            self.num_layers, self.vocab_size = native.num_layers, int(native.lm_head.weight.shape[0])
            self.aux_layer_ids = native.aux_layer_ids
            self.eos_token_ids = eos_token_ids(self.model_dir, self.config)
            self.runner = NativeRunner(native, self.device, compile_default(self.device) if compile is None else compile)
        else:
            if engine == "native":
                config = AutoConfig.from_pretrained(self.model_dir)
                raise ValueError(f"the native engine does not run {self.model_dir}: {unsupported(config)}")
            loaded = load_target(self.model_dir, self.device, self.dtype, aux_layer_ids)
            self.model, self.eos_token_ids, self.config = loaded.model, loaded.eos_token_ids, loaded.config
            self.aux_layer_ids, self.num_layers = loaded.aux_layer_ids, loaded.num_layers
            self.vocab_size = loaded.vocab_size
            self.runner = HFRunner(loaded, self.device)
        self.engine = "native" if native is not None else "hf"
        self.burst = ThreadBurst()  # a CPU target's forwards on more CPUs where faster (the service sets them)
        config = self.config
        self.hidden_size = int(config.hidden_size)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.max_context = int(getattr(self.config, "max_position_embeddings", 0) or 1 << 30)
        self.sessions: SessionTable[Session] = SessionTable("target")
        self.kv_budget = KVBudget(kv_cache_tokens)  # full: refused at once, the scheduler's queue waits
        self.kv_pool = self._pool(kv_cache_tokens)
        self._forwarding = threading.RLock()  # a batch's forwards, or a session's release (_free)
        self.max_batch_size, self.max_batch_tokens = max_batch_size, max_batch_tokens

    @property
    def buckets_compiling(self) -> int:
        """Buckets of the compiled forward queued or compiling in the background (warmup.WarmUp)."""
        warm_up = getattr(self.runner, "warm_up", None)
        return warm_up.pending if warm_up is not None else 0

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
        """Sized to the budget: a GPU's preallocated there, a CPU's grown up to it (runners.py)."""
        return self.runner.make_pool(self.num_layers, self.kv_heads, self.head_dim, self.dtype, tokens)

    @property
    def gather_bytes_per_token(self) -> int:
        """The gather's memory per token of a forward's padded past: one layer's copy and its temporary
        (KVLayer gathers layer by layer); none on the native path, which reads the pool in place."""
        return 0 if self.engine == "native" else 2 * self.kv_bytes_per_token // self.num_layers

    def measure_forward_bytes(self) -> int:
        """GPU memory one forward of the largest batch takes beyond the weights and the KV (runners.py)."""
        return self.runner.measure_forward_bytes(self.kv_pool, self.max_batch_tokens, self.max_batch_size, self.max_context)

    def release(self, session_id: str) -> bool:
        session = self.sessions.pop(session_id)
        if session is None:
            return False
        self._free(session)
        return True

    def _free(self, session: Session) -> None:
        """Not mid-batch (a deadline's release emptied a block table the batch's plan read, failing every step);
        a step of it still queued fails alone (`released`)."""
        with self._forwarding:
            self.kv_pool.free(session.blocks)
            session.blocks = []
            session.released = True
        self.kv_budget.free(session.reserved)

    def features_ready(self, session_id: str) -> torch.cuda.Event | None:
        """The CUDA event at the end of the batch that computed the session's last features (None on a CPU):
        a fast path reads them after it, on its own stream, not behind the next batch's forward."""
        try:
            return self.sessions.get(session_id).ready
        except SessionNotFound:
            return None

    @property
    def supports_trees(self) -> bool:
        """Whether verify takes a draft tree (`parents`): the native engine, and transformers' model where it
        has full attention only (target_server/runners.py)."""
        return self.runner.supports_trees

    def _check_ids(self, ids: list[int], what: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InvalidRequest(f"{what} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")

    # -- the protocol -----------------------------------------------------------------------

    def run(self, steps: Sequence[TargetStep]) -> list[PrefillResult | VerifyResult | Exception]:
        """One batch, run at once: a result, or the error of a step that failed (it fails alone), per step.
        A decode of more than one token (Verify.decode) takes further forwards of this batch's decodes."""
        with self._forwarding:  # one batch at a time: in-process callers may come from several threads
            results, built = build_batch(
                steps, lambda step: self._prefill_step(step) if isinstance(step, Prefill) else self._verify_step(step),
                (ResourceExhausted,))
            for (i, step), out in zip(built, self._run_batch([step for _, step in built]), strict=True):
                if step.kind == "prefill":
                    if isinstance(out, BaseException):
                        self._free(step.session)
                    else:
                        self.sessions.add(steps[i].session_id, step.session)
                results[i] = out
            decodes = [i for i, step in enumerate(steps) if isinstance(step, Verify) and step.decode > 1
                       and isinstance(results[i], VerifyResult)]
            if decodes:
                decode_rest(self, [steps[i] for i in decodes], [results[i] for i in decodes])
        return results

    def prefill(self, session_id: str, prompt_ids: list[int], params: SamplingParams, *args, **kwargs) -> PrefillResult:
        """One prefill alone (run() with a batch of one; the rest as Prefill's fields), raising its error."""
        return _raised(self.run([Prefill(session_id, prompt_ids, params, *args, **kwargs)])[0])

    def verify(self, session_id: str, token: int, drafts: list[int], *args, **kwargs) -> VerifyResult:
        """One verify alone (run() with a batch of one; the rest as Verify's fields), raising its error."""
        return _raised(self.run([Verify(session_id, token, drafts, *args, **kwargs)])[0])

    def _prefill_step(self, p: Prefill) -> Step:
        """The session's share of the KV budget starts at its prompt and the room a verify of `verify_tokens`
        takes for a moment (t and a tree's nodes; None: t and a chain's MAX_DRAFT_TOKENS drafts); its verifies
        grow it (`_reserve_for`). One whose prompt + `max_new_tokens` could never fit the whole budget is
        refused at once."""
        prompt_ids = list(p.prompt_ids)
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        self._check_ids(prompt_ids, "the prompt")
        if len(prompt_ids) >= self.max_context:
            raise InvalidRequest(f"the prompt has {len(prompt_ids)} tokens; the context is {self.max_context}")
        if p.output_start is not None and not 0 <= p.output_start <= len(prompt_ids):
            raise InvalidRequest(f"output_start {p.output_start} is outside the prompt's {len(prompt_ids)} tokens")
        if p.session_id in self.sessions:
            raise InvalidRequest(f"target session {p.session_id!r} already exists")
        generator = None
        if not p.sampling.greedy:
            generator = torch.Generator(device=self.device)
            # a fresh seed from the OS when none is given: torch.seed() would reseed the global RNG
            seed = p.sampling.seed if p.sampling.seed is not None else int.from_bytes(os.urandom(7), "little")
            generator.manual_seed(seed)
        # a verify holds up to K+1 uncommitted tokens (a tree's nodes + 1) for a moment
        width = min(max(p.verify_tokens or 0, MAX_DRAFT_TOKENS + 1), VERIFY_TOKENS)
        if p.max_new_tokens is not None:  # one that could never fit the whole budget is refused now
            self.kv_budget.check(min(self.max_context, len(prompt_ids) + p.max_new_tokens + width))
        reserve = min(self.max_context, len(prompt_ids) + width)
        # Every layer keeps its full KV, so verify can always roll back (a config-built cache trims
        # sliding-window layers, Mistral's, and then cannot crop); blocks are taken as it grows.
        limit = self.max_context
        if p.max_new_tokens is not None:
            limit = min(limit, len(prompt_ids) + p.max_new_tokens + width)
        step = processing.checked(Step("prefill", None, prompt_ids, p.want_features, allowed=p.allowed), self.vocab_size)
        step.session = Session(params=p.sampling, generator=generator, reserved=self.kv_budget.reserve(reserve),
                               width=width, limit=limit)
        processing.open_session(step.session, prompt_ids, p.output_start, self.vocab_size, self.device)
        return step

    def _reserve_for(self, session: Session, grown: int) -> None:
        """Grow a session's share of the KV budget to hold `grown` tokens and the next verify's width; while
        the budget is taken, ResourceExhausted (the scheduler preempts a request and retries this one)."""
        if grown <= session.reserved:
            return
        for want in (min(self.max_context, grown + session.width) - session.reserved, grown - session.reserved):
            try:
                session.reserved += self.kv_budget.reserve(want)
                return
            except ResourceExhausted:
                pass
        if self.kv_budget.tokens is not None and grown > self.kv_budget.tokens:
            raise ResourceExhausted(f"the session would grow to {grown} KV tokens; the whole KV budget is "
                                    f"{self.kv_budget.tokens} (--kv-cache-gib)")
        raise ResourceExhausted(f"the KV budget is taken ({self.kv_budget.used} of {self.kv_budget.tokens} tokens "
                                f"reserved; this session needs {grown - session.reserved} more)")

    def _verify_step(self, v: Verify) -> Step:
        """A verify's step, or InvalidRequest; the session counts as used. `q`: for a sampled session, the
        distribution the draft sampled each draft from (speculative sampling, target_server/acceptance.py);
        None: the drafts are the draft's argmax. `parents`: the drafts are a tree (Drafts.parents; its q: one
        per node, empty for one not sampled)."""
        session = self.sessions.get(v.session_id)
        session.last_used = time.monotonic()
        drafts, parents, decode = list(v.drafts), v.parents, v.decode
        self._check_ids([v.token, *drafts], "the verify input")
        check_decode(decode, drafts, parents)
        if parents is not None and not self.supports_trees:
            raise InvalidRequest("draft trees need the native engine (the Llama family) or a full-attention "
                                 f"model; this target runs transformers' {type(self.model).__name__}")
        if parents is not None and (problem := tree_problem(drafts, parents, MAX_TREE_NODES)) is not None:
            raise InvalidRequest(problem)
        dense = None
        if v.q and not session.params.greedy:
            try:
                dense = (dense_q if parents is None else tree_q)(v.q, drafts, self.vocab_size)
            except ValueError as exc:
                raise InvalidRequest(str(exc)) from None
        grown = session.length + max(1 + len(drafts), decode)  # a decode's tokens, all of them
        if grown > self.max_context:
            raise InvalidRequest(f"verify would pass the context of {self.max_context} tokens")
        if grown > session.limit:
            raise InvalidRequest(f"verify would grow the session to {grown} tokens, past the {session.limit} its "
                                 "prefill asked for (prompt + max_new_tokens + one verify)")
        self._reserve_for(session, grown)
        return processing.checked(Step("verify", session, [v.token, *drafts], v.want_features, dense, parents,
                                       v.allowed), self.vocab_size)

    # -- one batched forward ------------------------------------------------------------------

    @torch.inference_mode()
    def _run_batch(self, steps: list[Step]) -> list[PrefillResult | VerifyResult | Exception]:
        """The batch in as few forwards as keep each one's padded KV within the budget; a forward that
        runs out of memory fails its steps with ResourceExhausted (the server is full), not the process."""
        with self._forwarding:
            return self._run_live(steps)

    def _run_live(self, steps: list[Step]) -> list[PrefillResult | VerifyResult | Exception]:
        results: dict[int, PrefillResult | VerifyResult | Exception] = {
            id(step): SessionNotFound(f"the target session ended before its {step.kind} ran")
            for step in steps if step.session.released}
        live = [step for step in steps if not step.session.released]
        for part in self.runner.parts(live, self.kv_budget.tokens, self.kv_pool) if live else ():
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

    def _forward(self, steps: list[Step]) -> list[PrefillResult | VerifyResult]:
        past = [step.session.length for step in steps]
        for step in steps:
            self._grow(step.session, step.session.length + len(step.ids))
        logits, features = self.burst.run(steps, self.runner.forward, self.kv_pool)  # [N, V]: prefills' last rows, verifies' all
        rows = [1 if step.kind == "prefill" else len(step.ids) for step in steps]
        scored = processing.process(steps, logits, rows)  # penalties and masks; `logits` stays raw (logprobs)
        best = None
        if any(step.session.params.greedy for step in steps):
            best = scored.argmax(-1).tolist()  # the batch's one host sync (greedy)
        kept, results, start = [], [], 0
        for step, logit, raw, feature, n in zip(steps, scored.split(rows), logits.split(rows), features, rows,
                                                strict=True):
            argmax = best[start : start + n] if best is not None else None
            results.append(step_result(step, logit, feature, argmax, kept.append, raw, self.device,
                                       self.buckets_compiling > 0))
            start += n
        self.runner.commit(steps, past, kept, self.kv_pool)
        for step, keep in zip(steps, kept, strict=True):
            step.session.length += len(keep)
            processing.commit(step, keep)
        return results

    def _grow(self, session: Session, length: int) -> None:
        """Blocks for `length` positions (and, for the hf runner, their pool rows)."""
        need = -(-length // KVPool.BLOCK) - len(session.blocks)
        if need > 0:
            blocks = self.kv_pool.allocate(need)
            session.blocks += blocks
            if self.engine == "hf":
                first = torch.tensor(blocks, device=self.device)[:, None] * KVPool.BLOCK
                rows = (first + torch.arange(KVPool.BLOCK, device=self.device)).flatten()
                session.rows = torch.cat([session.rows.to(self.device), rows])


def _raised(result):
    if isinstance(result, BaseException):
        raise result
    return result
