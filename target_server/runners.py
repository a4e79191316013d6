"""How the target engine turns a batch of steps into forwards: two runners with one contract.

  supports_trees              whether a verify's drafts may be a tree (Step.parents)
  forward(steps) -> logits [N, V] (a prefill's last row, every row of a verify, in step order) and
                    each step's features [n, 3H]; a tree's nodes each attend to the past and their own path
  commit(steps, past, kept)   after acceptance: each step keeps the KV of the new tokens kept[i] (indices
                    into its new tokens, ascending: range(n) for a prefill, range(1 + a) for a chain, the
                    accepted path's nodes [0, i_1 + 1, ...] for a tree), at positions past[i] + 0, 1, ...

NativeRunner (target_server/native.py, the Llama family): the flattened batch padded to a bucket, one
forward that writes the new KV into the paged pool in place and attends there (target_server/paged.py),
compiled once per bucket; a chain's commit has nothing to do (rejected rows are written over by the next
forward), a tree's moves its path's rows to their positions' slots and frees the rest (paged.keep_rows).

HFRunner (any other architecture): transformers' forward over the batch right-padded, each sequence's past
gathered out of the pool left-padded layer by layer (KVLayer), and the committed rows scattered back. A
batch with a tree passes a 4D additive mask (transformers uses it as given) for full-attention models.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers.cache_utils import Cache

from tandem.compiling import compile_graphs
from tandem.packed import PACK_MIN_WEIGHTS, PackedLinear, can_pack, pack_linears
from tandem.protocol import tree_depths
from tandem.staging import upload
from target_server.graphs import CudaGraphs, StaticInputs, graphs_enabled
from target_server.kv import VERIFY_TOKENS, KVLayer, KVPool
from target_server.loading import LoadedTarget
from target_server.native import NativeCausalLM, fuse_projections
from target_server.paged import BLOCK, PAD, PagedKVPool, Span, ancestor_bits, bucket, keep_rows, plan_with
from target_server.warmup import WarmUp

if TYPE_CHECKING:
    from target_server.steps import Step

log = logging.getLogger("tandem.target")


def compile_default(device: torch.device) -> bool | str:
    """TANDEM_COMPILE=1 compiles the native forward (each bucket on its first use), "background" compiles each
    bucket on a thread of its own while that bucket runs eagerly (WarmUp), 0 runs it eagerly. Unset: compiled
    on a GPU, eager on a CPU. On a CPU a bucket takes seconds to compile the first time (inductor's disk cache
    helps later), and then (one thread, frozen weights) the demo target's decodes and verifies run faster than
    eager, SmolLM2-135M's by less. Compiled on first use, a service stalled every request for each new bucket.
    In the background the buckets cost nothing on the path, but the speed changes under the acceptance gate as
    each one lands (before the gate timed drafting again after REOPEN_ROUNDS, and before WarmUp.FIRST held the
    verifies' buckets, it could shed nearly every drafting round). The gate copes now (see AcceptanceGate),
    but a first start compiles FIRST in minutes of the target's core on the demo target (less from inductor's
    FX graph cache later), longer for bigger targets, and the eager copy doubles the weights in memory
    meanwhile: still not the CPU default."""
    value = os.environ.get("TANDEM_COMPILE")
    if value is None:
        return device.type == "cuda"
    return "background" if value == "background" else value != "0"


def _compile(model: torch.nn.Module, options: dict | None) -> Callable:
    """One graph a bucket (34 up to 4096 tokens), again for each size the pool grows to."""
    return compile_graphs(model, 256, fullgraph=True, dynamic=False, options=options)


def _prefix(keep: Sequence[int]) -> bool:
    """Whether kept indices are the first len(keep) new tokens."""
    if isinstance(keep, range):
        return keep.start == 0 and keep.step == 1
    return list(keep) == list(range(len(keep)))


class NativeRunner:
    CPU_BLOCKS = 256  # a CPU pool's first size (4096 tokens), grown up to the budget: each growth recompiles
    supports_trees = True

    def __init__(self, model: NativeCausalLM, device: torch.device, compile: bool | str):
        """`compile`: False (eager), True (each bucket compiled on its first use) or "background" (WarmUp)."""
        self.model, self.device, self.compiled = model, device, bool(compile)
        self.buckets: set[tuple[int, int]] = set()  # (tokens, pool rows) compiled (or compiling) so far
        self.failed: set[tuple[int, int]] = set()  # buckets whose compile failed: eager (TANDEM_COMPILE=1)
        self.static = StaticInputs(device)  # per compiled bucket its inputs' device buffer
        self._forward = self._eager = model
        packs = can_pack(device, model.model.embed_tokens.weight.dtype)
        if compile == "background" and packs:  # the forward until a bucket is compiled: packed, as eager's
            self._eager = copy.copy(model)
            self._eager._modules = dict(model._modules)  # a table of its own: its own decoder, the same lm_head
            self._eager.model = copy.deepcopy(model.model)
            fuse_projections(self._eager.model)
            pack_linears(self._eager.model)
        if compile:
            options = None
            if device.type == "cpu":
                # Not what it reads as: given as a compile option (torch 2.13), freezing leaves the weights the
                # graph's inputs, and every projection runs as an extern aten::mm (TORCH_LOGS=output_code). Only
                # the global torch._inductor.config.freezing makes them constants, packed for mkl._mkl_linear;
                # on the demo target and on SmolLM2-135M that was no faster than mm, so it stays as it is. The
                # eager PackedLinear (oneDNN) ran a lone 576x1536 projection faster than mm: not tried inside
                # the graph.
                options = {"freezing": True}
                if packs and model.lm_head.weight.numel() >= PACK_MIN_WEIGHTS:  # outside the graph
                    model.lm_head = PackedLinear(model.lm_head)
            self._forward = _compile(model, options)
        else:
            fuse_projections(model.model)
            if packs:
                pack_linears(model)
        self.warm_up = WarmUp(self) if compile == "background" else None
        self.graphs = CudaGraphs(self._forward, device) if graphs_enabled(device, bool(compile)) else None

    def make_pool(self, layers: int, heads: int, head_dim: int, dtype: torch.dtype, tokens: int | None) -> PagedKVPool:
        cap = None if tokens is None else max(tokens // KVPool.BLOCK, 1)
        blocks = cap if cap is not None and (self.device.type == "cuda" or cap <= self.CPU_BLOCKS) else self.CPU_BLOCKS
        context = getattr(self.model.config, "max_position_embeddings", None)
        pool = PagedKVPool(layers, heads, head_dim, dtype, self.device, blocks, cap,
                           None if not context else -(-context // KVPool.BLOCK))
        if self.warm_up is not None:  # the buckets of a lone request's verifies and of 16 decodes, before traffic
            for width in dict.fromkeys(bucket(n, self.device.type) for n in WarmUp.FIRST):
                self.warm_up.queue(width, pool)
        return pool

    def parts(self, steps: list[Step], budget: int | None, pool: PagedKVPool) -> list[list[Step]]:
        """One forward whatever the sessions' pasts (nothing is gathered or padded), compiled prefills and
        verifies together: a forward's fixed cost once. Unless the compiled forward has no graph for their
        width together (a new width would run eagerly, or compile on the requests' path), or the forward is
        eager (its attention is dense over the pool's rows where a batch of prompts alone attends each
        prompt's own, slower together than apart): then the verifies run first and the prefills after, as they
        come."""
        prefills = [step for step in steps if step.kind == "prefill"]
        if not prefills or len(prefills) == len(steps):
            return [steps]
        key = (bucket(sum(len(step.ids) for step in steps), self.device.type), pool.owner.shape[0])
        ready = self.warm_up.compiled if self.warm_up is not None else self.buckets
        if self.compiled and key in ready and key not in self.failed:
            return [steps]
        return [[step for step in steps if step.kind != "prefill"], prefills]

    def forward(self, steps: list[Step], pool: PagedKVPool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        sizes = [len(step.ids) for step in steps]
        n = sum(sizes)
        key = (bucket(n, self.device.type), pool.owner.shape[0])
        compiled = self.compiled and key not in self.failed and (
            self.warm_up is None or self.warm_up.ready(steps, key[0], pool))
        if compiled and self.warm_up is None and key not in self.buckets:
            self.buckets.add(key)
            log.info("compiling the target's forward for %d tokens over a pool of %d rows (once)", *key)
        spans = [Span(step.session.owner, step.session.blocks, step.session.length, size, step.parents)
                 for step, size in zip(steps, sizes, strict=True)]
        ids = [i for step in steps for i in step.ids]
        rows, end = [], 0
        for step, size in zip(steps, sizes, strict=True):
            end += size
            rows += range(end - size, end) if step.kind == "verify" else [end - 1]
        hidden, features, rows = self._run(ids, spans, key, pool, compiled, rows)  # [width, H], [width, 3H], [N]
        logits = self.model.lm_head(hidden.index_select(0, rows))  # [N, V]
        return logits, list(features[:n].split(sizes))

    def _run(self, ids: list[int], spans: list[Span], key: tuple[int, int], pool: PagedKVPool,
             compiled: bool, rows: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The forward of `spans`' tokens `ids`: compiled, padded to the bucket key[0] (static shapes are for
        the compiler), or eagerly, unpadded; with `rows` (the rows whose logits are read) on the device, copied
        with the forward's inputs. A compiled bucket that fails (the compiler's failure, not the
        batch's: flex's Triton template refused every block size below 16 rows on an H100) runs eagerly from
        then on; inline compiles only (WarmUp keeps its own)."""
        try:
            return self._forward_padded(ids, spans, key[0] if compiled else len(ids), pool, compiled, rows)
        except torch.OutOfMemoryError:
            raise
        except Exception:
            if not compiled or self.warm_up is not None:
                raise
            log.exception("the compiled forward for %d tokens over a pool of %d rows failed: that bucket runs "
                          "eagerly", *key)
            self.failed.add(key)
            return self._forward_padded(ids, spans, len(ids), pool, False, rows)

    def _forward_padded(self, ids: list[int], spans: list[Span], width: int, pool: PagedKVPool,
                        compiled: bool, rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A compiled bucket's inputs go into its static buffers (the same tensors every forward, as a CUDA
        graph captured over them needs), the logits' rows padded to the width with them; eager's are new."""
        rows = list(rows)
        if not compiled:
            positions, batch, (tokens, rows) = plan_with(spans, width, pool, True, [(ids, torch.long),
                                                                                   (rows, torch.long)])
            return *self._eager(tokens, positions, batch), rows
        positions, batch, tokens, padded = self.static_inputs(ids, spans, width, pool, rows)
        forward = self._forward if self.graphs is None else partial(self.graphs, (width, pool.owner.shape[0]))
        return *forward(tokens, positions, batch), padded[: len(rows)]

    def static_inputs(self, ids: list[int], spans: list[Span], width: int, pool: PagedKVPool, rows: list[int]):
        """A bucket's positions, batch, ids and logits' rows, padded to the width, in its static buffers."""
        pad = [(values + [0] * (width - len(values)), torch.long) for values in (ids, rows)]
        positions, batch, (tokens, padded) = plan_with(spans, width, pool, False, pad, self.static.of(width, pool))
        return positions, batch, tokens, padded

    @torch.inference_mode()
    def measure_forward_bytes(self, pool: KVPool, max_tokens: int, max_batch: int, max_context: int) -> int:
        """As HFRunner's: a forward of max_tokens tokens (written to the scratch block), then the logits
        of a full batch of verifies."""
        device = self.device
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        n = max(min(max_tokens, max_context - 1), 1)
        # eagerly: a compiled bucket here would be over this scratch pool, which the sized one replaces
        key = (bucket(n, device.type), pool.owner.shape[0])
        hidden, _, _ = self._run([0] * n, [Span(PAD, [0] * -(-n // KVPool.BLOCK), 0, n)], key, pool, False)
        rows = min(n, max_batch * VERIFY_TOKENS)
        logits = self.model.lm_head(hidden[:rows]).float().log_softmax(-1)
        del hidden, logits
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        torch.cuda.empty_cache()
        return peak

    def commit(self, steps: list[Step], past: list[int], kept: list[Sequence[int]],
               pool: PagedKVPool) -> None:
        """A chain's kept rows are already where their positions are; a tree's path moves there, and the
        tree's other rows are freed (paged.keep_rows: one copy per layer for the whole batch)."""
        src, dst, positions, freed = [], [], [], []
        for step, start, keep in zip(steps, past, kept, strict=True):
            if step.parents is None and _prefix(keep):
                continue
            blocks = step.session.blocks
            slot = [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + len(step.ids))]
            src += [slot[i] for i in keep]
            dst += slot[: len(keep)]
            positions += range(start, start + len(keep))
            freed += slot[len(keep) :]
        if dst:
            keep_rows(pool, src, dst, positions, freed)


class HFRunner:
    def __init__(self, loaded: LoadedTarget, device: torch.device):
        self.model, self.capture, self.device = loaded.model, loaded.capture, device
        self.decoder = self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()
        self.config = loaded.config
        self._batch: list[KVLayer] = []
        self._width = 0
        # A tree's 4D mask replaces the one transformers would build for every layer: not for sliding-window
        # or hybrid models (their windows would be lost), and only for the implementations that take an
        # additive float mask.
        config = self.config
        window = getattr(config, "sliding_window", None)
        types = set(getattr(config, "layer_types", None) or ["full_attention"])
        windowed = window and window < getattr(config, "max_position_embeddings", 0)
        full = not windowed and types == {"full_attention"}
        self.supports_trees = full and self.model.config._attn_implementation in ("sdpa", "eager")

    def make_pool(self, layers: int, heads: int, head_dim: int, dtype: torch.dtype, tokens: int | None) -> KVPool:
        cap = None if tokens is None else max(tokens // KVPool.BLOCK, 1)
        blocks = cap if cap is not None and self.device.type == "cuda" else 64  # a GPU's: all of it now
        return KVPool(layers, heads, head_dim, dtype, self.device, blocks, cap)

    def parts(self, steps: list[Step], budget: int | None, pool: KVPool) -> list[list[Step]]:
        """A forward gathers B x (longest past + widest new) tokens of KV: one long session among short
        ones multiplies it. The batch as it is when that fits in the budget, else in parts that do (the
        longest pasts first, each part as large as fits)."""

        def size(part: list[Step]) -> int:
            return len(part) * (max(s.session.length for s in part) + max(len(s.ids) for s in part))

        if budget is None or size(steps) <= budget:
            return [steps]
        parts: list[list[Step]] = []
        for step in sorted(steps, key=lambda s: -s.session.length):
            if parts and size([*parts[-1], step]) <= budget:
                parts[-1].append(step)
            else:
                parts.append([step])
        return parts

    def forward(self, steps: list[Step], pool: KVPool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        past = [step.session.length for step in steps]
        sizes = [len(step.ids) for step in steps]
        longest, width = max(past), max(sizes)
        ids = torch.zeros(len(steps), width, dtype=torch.long)
        mask = torch.zeros(len(steps), longest + width, dtype=torch.long)
        positions = torch.zeros(len(steps), width, dtype=torch.long)
        for i, step in enumerate(steps):
            ids[i, : sizes[i]] = torch.tensor(step.ids)
            mask[i, longest - past[i] : longest + sizes[i]] = 1  # padding before the past and after the new tokens
            positions[i] = torch.arange(past[i], past[i] + width)
            if step.parents is not None:  # a tree's nodes at past + their depths
                positions[i, : sizes[i]] = past[i] + torch.tensor([0, *tree_depths(step.parents)])
        trees = any(step.parents is not None for step in steps)
        long = torch.long
        ids, positions, mask, *visible = upload([(ids, long), (positions, long), (mask, long)] + (
            [(self._tree_visible(steps, mask, longest, width), torch.bool)] if trees else []), self.device)
        attention = None if len(steps) == 1 else mask
        if trees:
            dtype = self.model.dtype
            attention = torch.zeros(visible[0].shape, dtype=dtype, device=self.device).masked_fill_(
                ~visible[0], torch.finfo(dtype).min)
        self._batch, self._width = self._gather_kv(steps, longest, pool), width
        hidden = self.decoder(
            input_ids=ids,
            attention_mask=attention,
            position_ids=positions,
            past_key_values=Cache(layers=self._batch),
            use_cache=True,
        ).last_hidden_state
        features = self.capture.take()
        rows = [hidden[i, n - 1 : n] if step.kind == "prefill" else hidden[i, :n]
                for i, (step, n) in enumerate(zip(steps, sizes, strict=True))]
        return self.logits(torch.cat(rows)), [features[i, :n] for i, n in enumerate(sizes)]

    def _tree_visible(self, steps: list[Step], mask: torch.Tensor, longest: int, width: int) -> torch.Tensor:
        """[B, 1, width, longest + width] bool, the 4D mask's visible entries (made additive on the device: 0
        visible, the dtype's minimum hidden; transformers passes a 4D mask through as given): the padding of
        `mask` [B, longest + width], causal among the new tokens, and a tree's node sees only its ancestors
        and itself among them."""
        new = torch.ones(width, width, dtype=torch.bool).tril().repeat(len(steps), 1, 1)  # [B, width, width]
        for i, step in enumerate(steps):
            if step.parents is not None:
                bits = torch.tensor(ancestor_bits(step.parents))  # [n]
                n = bits.numel()
                new[i, :n, :n] = (bits[:, None] >> torch.arange(n)[None]) & 1 == 1
        visible = mask.bool()[:, None, :].repeat(1, width, 1)  # [B, width, longest + width]
        visible[:, :, longest:] &= new
        return visible[:, None]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)  # Gemma 2/3
        return torch.tanh(logits / cap) * cap if cap else logits

    def _gather_kv(self, steps: list[Step], longest: int, pool: KVPool) -> list[KVLayer]:
        """Each layer's view of the batch's past, each sequence left-padded to `longest`; gathered from the
        pool when the layer runs."""
        heads, head_dim = pool.shape
        shape = (len(steps), heads, longest, head_dim)
        if longest == 0:
            return [KVLayer(None, shape, pool.dtype, self.device) for _ in pool.keys]
        index = pad_sequence([step.session.rows[: step.session.length] for step in steps], batch_first=True,
                             padding_side="left")  # [B, longest]; padding reads row 0, masked out

        def gather(layer: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
            def fill(keys: torch.Tensor, values: torch.Tensor) -> None:  # [B, kv_heads, longest, head_dim]
                keys.copy_(pool.keys[layer][index].transpose(1, 2))
                values.copy_(pool.values[layer][index].transpose(1, 2))

            return fill

        return [KVLayer(gather(layer), shape, pool.dtype, self.device) for layer in range(len(pool.keys))]

    def commit(self, steps: list[Step], past: list[int], kept: list[Sequence[int]], pool: KVPool) -> None:
        """The KV of the tokens each session commits (its new tokens `kept`) into its pool rows."""
        rows = torch.cat([step.session.rows[p : p + len(keep)]
                          for step, p, keep in zip(steps, past, kept, strict=True)])
        # which of the batch's B x width new tokens: an index built on the host (a boolean mask syncs)
        (chosen,) = upload([([i * self._width + j for i, keep in enumerate(kept) for j in keep], torch.long)],
                           self.device)
        for layer, pool_keys, pool_values in zip(self._batch, pool.keys, pool.values, strict=True):
            pool_keys[rows] = layer.new_keys.transpose(1, 2).flatten(0, 1)[chosen]  # [B * width, heads, D] rows
            pool_values[rows] = layer.new_values.transpose(1, 2).flatten(0, 1)[chosen]
        self._batch = []

    @torch.inference_mode()
    def measure_forward_bytes(self, pool: KVPool, max_tokens: int, max_batch: int, max_context: int) -> int:
        """GPU memory one forward of the largest batch takes beyond the weights and the KV (activations,
        captured features, the verify rows' logits), measured as vLLM's profile run measures it: a
        prefill of max_tokens tokens, then the logits of a full batch of verifies."""
        device = self.device
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        n = max(min(max_tokens, max_context - 1), 1)
        ids = torch.zeros(1, n, dtype=torch.long, device=device)
        layers = [KVLayer(None, (1, pool.shape[0], 0, pool.shape[1]), pool.dtype, device) for _ in pool.keys]
        hidden = self.decoder(input_ids=ids, position_ids=torch.arange(n, device=device)[None],
                              past_key_values=Cache(layers=layers), use_cache=True).last_hidden_state
        self.capture.take()
        rows = min(n, max_batch * VERIFY_TOKENS)
        logits = self.logits(hidden[0, :rows]).float().log_softmax(-1)  # the acceptance rule's work, in float
        del hidden, logits, layers
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        torch.cuda.empty_cache()
        return peak

