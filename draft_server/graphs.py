"""CUDA graphs of the draft's greedy rollouts (TANDEM_CUDA_GRAPHS=1, on CUDA): a chain head's K picks and K-1
one-token forwards, ~45 kernels a step when eager, replayed as one launch per bucket of (rows, columns, K);
and a lone greedy session's draft tree, its depth - 1 expansions, per (columns, tree shape). A batch of sampled
sessions replays a graph of its own per bucket and q's width: the rows' settings and uniforms are inputs.

A bucket's graph reads and writes static memory only: the engine's batch buffers (batch.BatchBuffers: each
layer's KV and the keys each row may attend, in which the K-1 steps write their own columns) and its own
two inputs, the last extend outputs a [rows, 1, H] and the positions the first drafts are fed at [rows, 1],
copied in before each replay. So propose_batch pads a greedy batch to a bucket: its rows to the next of
ROWS (vLLM's capture sizes, then steps of 16), the columns its rollout starts at to the next step of a
quarter octave (at most a quarter more keys read). A bucket is captured the first time a batch meets it, in
milliseconds (no compile: the head's eager kernels are recorded); buffers that grow drop every graph over
the old ones. Batches of greedy and sampled sessions together, constrained proposes, sampled trees, P-EAGLE
heads and aheads stay eager.

The graphs share one memory pool, so a replay may write over another's outputs: they leave as copies."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from draft_server.model import DraftKV, Eagle3Config, Eagle3Draft
from draft_server.rollout import Draws, rollout
from draft_server.sampling import q_width
from draft_server.tree import Tree, grow_tree, tree_shape
from tandem.compiling import capture as cuda_capture
from tandem.params import TreeParams

log = logging.getLogger("tandem.draft")

ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
MIN_COLUMN_STEP = 64


def rows_bucket(n: int) -> int:
    """The rows a batch of n is padded to."""
    return next((r for r in ROWS if r >= n), -(-n // 16) * 16)


def columns_bucket(n: int) -> int:
    """The columns a rollout starting at column n is moved to: n up to a step of a quarter of its octave."""
    step = max(MIN_COLUMN_STEP, (1 << (n.bit_length() - 1)) // 4)
    return -(-n // step) * step


class RolloutGraphs:
    """One graph per bucket over the engine's batch buffers: a chain's (rows, columns before the rollout, K), a
    greedy tree's (columns, top_k, depth, nodes). `capture`: tandem.compiling.capture, or a stand-in (the
    tests' on a CPU)."""

    def __init__(self, model: Eagle3Draft, buffers, device: torch.device, top_n: int,
                 capture: Callable = cuda_capture):
        """`top_n`: a sampled draft's q is cut to this many likeliest tokens (the engine's q_top_n)."""
        self.model, self.buffers, self.device, self._capture = model, buffers, device, capture
        self.top_n = top_n
        self.graphs: dict[tuple, tuple] = {}
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.generation = buffers.generation
        self.captures = 0  # graphs captured so far (buffers' growth recaptures)

    @staticmethod
    def fits(steps, config: Eagle3Config, rounds: int) -> bool:
        """Whether a batch's rollout replays a graph: a chain head, no session constrained, and every session
        greedy or every one sampled."""
        sampled = {s.session.sampler is not None for s in steps}
        return (rounds > 0 and not config.parallel_drafting and len(sampled) == 1
                and all(s.session.constraint is None for s in steps))

    def rollout(self, a: torch.Tensor, kv: DraftKV, position: torch.Tensor, rounds: int, valid: torch.Tensor,
                draws: Draws | None = None) -> tuple[torch.Tensor, tuple | None, torch.Tensor]:
        """rollout()'s drafts [rows, rounds], their q (every row sampled: `draws`, over all rows) or None, and
        the outputs that proposed them [rows, rounds, H], from the bucket's graph: kv over the batch buffers
        (its length the bucket's columns), valid their view."""
        start = kv.length
        inputs, key = (a, position), ("chain", a.shape[0], start, rounds)
        if draws is not None:  # the settings' tensors are inputs; what the host decides from them, the key
            settings = draws.settings
            inputs += (settings.temperature, settings.top_k_col, settings.top_p, draws.uniforms)
            key += (q_width(settings, self.model.config.draft_vocab_size, self.top_n), settings.cut_only)

        def run(a, position, *sampled) -> tuple[torch.Tensor, ...]:
            kv.crop(start)  # the steps write their columns again at every run
            at = None
            if sampled:
                temperature, top_k_col, top_p, uniforms = sampled
                at = Draws(None, replace(draws.settings, temperature=temperature, top_k_col=top_k_col, top_p=top_p),
                           uniforms)
            drafts, q, outputs = rollout(self.model, self.top_n, a, kv, position, rounds, at, valid)
            return drafts, outputs, *(q or ())

        drafts, outputs, *q = self._replay(key, inputs, run)
        kv.crop(start)
        return drafts, tuple(q) or None, outputs

    def tree(self, a: torch.Tensor, kv: DraftKV, position: torch.Tensor, params: TreeParams, valid: torch.Tensor
             ) -> Tree:
        """grow_tree()'s greedy tree from its bucket's graph: kv a lone session's over the batch buffers
        (BatchBuffers.lone), valid [1, columns] the keys its row may attend."""
        start = kv.length

        def run(a: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, ...]:
            kv.crop(start)
            tree = grow_tree(self.model, a, kv, position, params, context=valid[0, :start])
            return tree.tokens, tree.parents, tree.scores

        shape = tree_shape(params, self.model.config.draft_vocab_size)
        return Tree(*self._replay(("tree", start, *shape), (a, position), run))

    def _replay(self, key: tuple, inputs: tuple[torch.Tensor, ...], run: Callable[..., tuple[torch.Tensor, ...]]
                ) -> tuple[torch.Tensor, ...]:
        """run(*inputs)'s outputs from the graph of `key`, captured the first time over static copies of
        `inputs` (the rest `run` reads is the buffers'), which each replay writes first."""
        if self.buffers.generation != self.generation:  # the graphs read buffers that are gone
            self.graphs.clear()
            self.generation = self.buffers.generation
        if key not in self.graphs:
            started = time.monotonic()
            static = tuple(t.clone() for t in inputs)
            graph, outputs = self._capture(lambda: run(*static), self.device, self.pool)
            self.graphs[key] = (graph, static, outputs)
            self.captures += 1
            log.info("captured the draft's %s as a CUDA graph in %.0f ms", key, (time.monotonic() - started) * 1e3)
        graph, static, outputs = self.graphs[key]
        for into, value in zip(static, inputs, strict=True):
            into.copy_(value)
        graph.replay()
        return tuple(out.clone() for out in outputs)
