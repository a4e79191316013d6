"""Attention over the paged KV pool in place, for the native model (target_server/native.py).

A forward's batch is flattened: the new tokens of every sequence one after another, padded to a bucket
of T tokens (a static shape, so a compiled forward never recompiles). Each token comes with its
position and its slot, the pool row its KV goes to. Each layer writes the new K/V into its slots
(index_copy_: no gather, no padded copy of the past, nothing allocated per forward) and every query
attends, in the pool itself, the rows of its own sequence at positions up to its own:

  owner[row] == owner[query]  and  position[row] <= position[query]  and  tree[row] & anc[query] == tree[row]

`owner`, `position` and `tree` are kept per pool row and written with the KV. A rejected draft's row of a
chain needs no clean-up: the next forward of its sequence starts at that position and writes the row again
before anything reads it, and rows past every query's position are masked. Padding tokens write the scratch
block 0 (never handed out) as the owner PAD and attend it only.

A draft tree (EAGLE-2) is verified in the same forward: node i (0 the root t, i + 1 the draft d_{i+1}) is
written to the slot of position past + i but sits at position past + its depth (RoPE and the rule above),
its row's `tree` is the bit 1 << i, and its query's `anc` the bits of its ancestors and itself: so it sees
the committed past (tree 0) and its own path, never a sibling or a cousin. Every other token (prefills,
chains) writes tree 0 and has anc 0. After acceptance `keep_rows` moves the accepted path's KV to the slots
of its positions, marks those rows committed (tree 0) and frees the tree's other rows: their positions can
be below a later query's. (The rule alone hides them too, even after a forward that failed before its
commit: a left-over row of bit j sits at slot S + j, S its tree's start; a later tree starting at L >= S
either writes that slot again or has n <= j nodes, so none of its queries has bit j; chains see tree 0 only.)

Which pool blocks a query block may see (its sequences' blocks up to its last position, and the scratch
block) is known on the host from the block tables: it becomes a flex_attention BlockMask (kv_num_blocks,
kv_indices), so attention skips every other block of the pool; the rule above is its mask_mod inside
the blocks, but for "full" blocks (a query block's own committed past, attended whole). Grouped-query
attention is flex's enable_gqa, or (CPU) the group's heads packed as query rows: no repeated KV. Without
torch.compile flex materialises its scores (correct, slow); "dense" attention runs SDPA over the whole pool
with the rule as a boolean mask (eager's faster choice), over the rows up to the batch's highest block, but
for a batch of prefills only (`fresh`: nothing before their new tokens), where each sequence attends its own new
tokens causally, one SDPA each, without reading the pool back.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from tandem.protocol import tree_depths
from tandem.staging import Staged, upload
from target_server.kv import KVPool

BLOCK = KVPool.BLOCK
PAD = -2  # the owner of padding tokens and of the scratch block
FREE = -1  # the owner of rows never written
# Tokens per BlockMask query block: a block sees the pool blocks of every sequence it holds a token of, so
# smaller blocks mean fewer other sequences' rows masked per query, and a block of one sequence's tokens sees
# the blocks below its past whole (plan: "full" blocks, no mask_mod). Inductor's CPU flex template walks, per
# kv head, query head and query block, each pool block it may see with a few tiny products and a softmax
# update; on the CPU a query block is one token, and the g query heads of a kv head are g query rows of it
# (row t * g + i: token t, head i of its group, PACK_GROUPS), so one walk serves them all. On the demo target
# (3 heads, 1 kv head), compiled, that runs a batch of 16 decodes or verifies faster and one session's as
# fast; without the packing, or with pages of 64 rows rather than KVPool.BLOCK's, 16 decodes ran slower.
# Before full blocks, each smaller query block ran 16 verifies faster. On CUDA flex's Triton kernel tiles by
# 16 rows at least, and the block sizes must be multiples of its tiles (torch 2.11, H100: with its default
# tiles no kernel compiles for (16, 16) blocks, nor for any query block below 16 whatever the tiles), so a
# CUDA forward is padded to 16 tokens at least (MIN_TOKENS) and runs tiles of (16, 16) (KERNEL_OPTIONS).
Q_BLOCK = {"cpu": 1, "cuda": 16}
MIN_TOKENS = {"cpu": 2, "cuda": 16}  # inductor's CPU flex template fails on one query row
KERNEL_OPTIONS = {"cuda": {"BLOCK_M": 16, "BLOCK_N": 16}}
PACK_GROUPS = {"cpu"}
# A BlockMask's transpose (which query blocks see each pool block) serves only the backward pass; built per
# forward, it is a sort over [query blocks, pool blocks] on the device (built where torch has no such option)
FORWARD_ONLY = {"compute_q_blocks": False} if "compute_q_blocks" in inspect.signature(
    BlockMask.from_kv_blocks).parameters else {}


class PagedKVPool(KVPool):
    """The pool in attention's layout, per layer [1, kv_heads, rows, head_dim], and per row its owner,
    position and tree bit (0: not a tree node's). Block 0 is the scratch block. `sequence_blocks`: the most
    blocks one sequence holds (its context over BLOCK; None: unbounded), which bounds a BlockMask's tables."""

    ROW_DIM = 2

    def __init__(self, layers: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 blocks: int = 64, max_blocks: int | None = None, sequence_blocks: int | None = None):
        super().__init__(layers, heads, head_dim, dtype, device, blocks + 1,
                         None if max_blocks is None else max_blocks + 1)
        self.sequence_blocks = sequence_blocks
        rows = self.blocks * BLOCK
        self.owner = torch.full((rows,), FREE, dtype=torch.int32, device=device)
        self.owner[:BLOCK] = PAD
        self.position = torch.zeros(rows, dtype=torch.int32, device=device)
        self.tree = torch.zeros(rows, dtype=torch.int64, device=device)
        self._free.remove(0)

    @property
    def capacity(self) -> int:
        return (self.blocks - 1) * BLOCK  # the scratch block holds no session's KV

    def table_columns(self, q_block: int) -> int:
        """The columns of a BlockMask's tables: the most pool blocks one query block can see, its q_block
        tokens' sequences' blocks and the scratch block, as vLLM sizes a block table by max_model_len, not by the
        pool (filled and copied each forward, a table as wide as a GPU's pool costs milliseconds: benchmarks.md,
        "BlockMask tables"); a static shape per pool, as a compiled bucket needs."""
        if self.sequence_blocks is None:
            return self.blocks
        return min(self.blocks, q_block * self.sequence_blocks + 1)

    def free(self, blocks: list[int]) -> None:
        """Handed out lowest first, so the rows in use stay at the front (eager attention reads up to the
        highest block of its batch)."""
        with self._lock:
            self._free = sorted(self._free + blocks)

    def _zeros(self, rows: int) -> torch.Tensor:
        return torch.zeros(1, self.shape[0], rows, self.shape[1], dtype=self.dtype, device=self.device)

    def _extend(self, rows: int) -> None:
        super()._extend(rows)
        self.owner = torch.cat([self.owner, self.owner.new_full((rows,), FREE)])
        self.position = torch.cat([self.position, self.position.new_zeros(rows)])
        self.tree = torch.cat([self.tree, self.tree.new_zeros(rows)])


class PagedBatch(NamedTuple):
    """What a forward needs of the pool; tensors on the device, shapes static per bucket and pool size."""

    slots: torch.Tensor  # [T] long: the pool row each new token's KV goes to
    owner: torch.Tensor  # [T] int32: each token's sequence (PAD for padding)
    kv_num: torch.Tensor  # [1, 1, T / q_block] int32: pool blocks each query block sees through the mask
    kv_idx: torch.Tensor  # [1, 1, T / q_block, pool blocks] int32: which (the first kv_num of each row)
    full_num: torch.Tensor  # [1, 1, T / q_block] int32: pool blocks each query block sees whole (no mask)
    full_idx: torch.Tensor  # [1, 1, T / q_block, pool blocks] int32: which
    keys: list[torch.Tensor]  # per layer [1, kv_heads, R, head_dim], written in place
    values: list[torch.Tensor]
    row_owner: torch.Tensor  # [R] int32, written in place
    row_position: torch.Tensor  # [R] int32, written in place
    row_tree: torch.Tensor  # [R] int64, written in place
    tree: torch.Tensor  # [T] int64: each token's tree bit (0 but for a tree's nodes)
    anc: torch.Tensor  # [T] int64: the tree bits each token sees (its ancestors', its own; 0 outside trees)
    q_block: int
    dense: int  # 0: flex_attention; else SDPA over the pool's first `dense` rows (those the batch's blocks are in)
    trees: bool = False  # a tree among the spans (else the dense mask's tree rule is row_tree == 0)
    mask: BlockMask | torch.Tensor | None = None  # set by open_batch
    groups: int = 1  # query heads a kv head's query rows hold (set by open_batch: PACK_GROUPS)
    fresh: tuple[int, ...] = ()  # dense, and every sequence starts at position 0 (prefills): their lengths


def open_batch(batch: PagedBatch, positions: torch.Tensor, groups: int = 1) -> PagedBatch:
    """Marks the rows the new tokens write (owner, position, tree bit; positions [T] int32) and builds the
    mask every layer uses; `groups` the query heads per kv head (flex attention packs them where PACK_GROUPS
    says)."""
    batch.row_owner.index_copy_(0, batch.slots, batch.owner)
    batch.row_position.index_copy_(0, batch.slots, positions)
    batch.row_tree.index_copy_(0, batch.slots, batch.tree)
    row_owner, row_position, row_tree = batch.row_owner, batch.row_position, batch.row_tree
    owner, anc = batch.owner, batch.anc
    if batch.fresh:
        return batch  # each sequence attends its own new tokens (paged_attention): no mask
    if batch.dense:
        row_owner, row_position = row_owner[: batch.dense], row_position[: batch.dense]
        mask = (row_owner[None] == owner[:, None]) & (row_position[None] <= positions[:, None])  # [T, dense]
        row_tree = row_tree[None, : batch.dense]
        # the tree rule; without a tree in the batch (anc 0 everywhere) it is tree[row] == 0, one row's worth
        mask &= ((row_tree & anc[:, None]) == row_tree) if batch.trees else row_tree == 0
        return batch._replace(mask=mask)

    g = groups if positions.device.type in PACK_GROUPS else 1

    def visible(b, h, q, kv):
        tree, t = row_tree[kv], q // g  # query row q is token q // g
        return (row_owner[kv] == owner[t]) & (row_position[kv] <= positions[t]) & ((tree & anc[t]) == tree)

    mask = BlockMask.from_kv_blocks(batch.kv_num, batch.kv_idx, batch.full_num, batch.full_idx,
                                    BLOCK_SIZE=(batch.q_block * g, BLOCK), mask_mod=visible,
                                    seq_lengths=(owner.shape[0] * g, row_owner.shape[0]), **FORWARD_ONLY)
    return batch._replace(mask=mask, groups=g)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: PagedBatch) -> torch.Tensor:
    """q [1, Hq, T, D], the new k, v [1, Hkv, T, D] -> [1, Hq, T, D]; k and v go into the pool first."""
    keys, values = batch.keys[layer], batch.values[layer]  # [1, Hkv, R, D]
    keys.index_copy_(2, batch.slots, k)
    values.index_copy_(2, batch.slots, v)
    if batch.fresh:  # nothing before the new tokens: each sequence's causal attention over its own, from k and v
        return torch.cat([torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
                          for qs, ks, vs in zip(q.split(batch.fresh, 2), k.split(batch.fresh, 2),
                                                v.split(batch.fresh, 2), strict=True)], dim=2)
    if batch.dense:
        keys, values = keys[:, :, : batch.dense], values[:, :, : batch.dense]  # views
        return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=batch.mask, enable_gqa=True)
    g = batch.groups
    if g == 1:
        return flex_attention(q, keys, values, block_mask=batch.mask, enable_gqa=True,
                              kernel_options=KERNEL_OPTIONS.get(q.device.type))
    _, heads, t, d = q.shape
    kv_heads = heads // g
    rows = q.view(kv_heads, g, t, d).transpose(1, 2).reshape(1, kv_heads, t * g, d)  # row t * g + i
    out = flex_attention(rows, keys, values, block_mask=batch.mask, kernel_options=KERNEL_OPTIONS.get(q.device.type))
    return out.view(kv_heads, t, g, d).transpose(1, 2).reshape(1, heads, t, d)


@dataclass
class Span:
    """One sequence's new tokens in a forward: `new` tokens at positions past.., in its pool blocks; a
    tree's (`parents`: Drafts.parents of its new - 1 drafts) at past + their depths, in the slots of
    past..past+new-1."""

    owner: int
    blocks: list[int]
    past: int
    new: int
    parents: list[int] | None = None


def ancestor_bits(parents: list[int]) -> list[int]:
    """Per node of a tree (0 the root, i + 1 draft i), the bits 1 << j of its ancestors j and of itself."""
    bits = [1]
    for i, parent in enumerate(parents):
        bits.append(bits[parent + 1] | 1 << (i + 1))
    return bits


def bucket(n: int, device: str = "cpu") -> int:
    """The padded token count of a forward of n tokens on a `device` type: the next power of two up to 16 (at
    least MIN_TOKENS), then the next multiple of 16 up to 256, then of 256. Finer than powers of two above 16:
    16 verifies of K=4 are 80 tokens, and padded to 128 they cost far more; each bucket compiles once."""
    if n <= 16:
        return max(1 << max(n - 1, 0).bit_length(), MIN_TOKENS.get(device, 2))
    step = 16 if n <= 256 else 256
    return -(-n // step) * step


def plan(spans: Sequence[Span], width: int, pool: PagedKVPool, dense: bool) -> tuple[torch.Tensor, PagedBatch]:
    """The positions [width] (int32) and the PagedBatch of a forward of `spans`' tokens padded to `width`, built
    on the host from the block tables and copied to the device once (tandem/staging.py: no host sync)."""
    positions, batch, _ = plan_with(spans, width, pool, dense)
    return positions, batch


def plan_with(spans: Sequence[Span], width: int, pool: PagedKVPool, dense: bool,
              more: Sequence[tuple[object, torch.dtype]] = (), into: Staged | None = None
              ) -> tuple[torch.Tensor, PagedBatch, list[torch.Tensor]]:
    """plan's, and the tensors of `more` ((values, dtype) pairs: the forward's tokens, the rows it reads
    logits at) uploaded in the same copy; into `into`'s buffer where given (a bucket's static inputs)."""
    positions, slots, owner, tree, anc = [], [], [], [], []
    q_block = min(width, Q_BLOCK.get(pool.device.type, 16))
    for span in spans:
        depths = range(span.new) if span.parents is None else [0, *tree_depths(span.parents)]
        for i, p in enumerate(range(span.past, span.past + span.new)):
            positions.append(span.past + depths[i])
            slots.append(span.blocks[p // BLOCK] * BLOCK + p % BLOCK)
        owner += [span.owner] * span.new
        tree += [0] * span.new if span.parents is None else [1 << i for i in range(span.new)]
        anc += [0] * span.new if span.parents is None else ancestor_bits(span.parents)
    pad = width - len(positions)
    positions += [0] * pad
    slots += [i % BLOCK for i in range(pad)]
    owner += [PAD] * pad
    tree += [0] * pad
    anc += [0] * pad
    masked, whole = ([], []) if dense else _visible_blocks(spans, width, q_block)  # dense attention reads neither
    columns = pool.table_columns(q_block)
    (kv_num, kv_idx), (full_num, full_idx) = _block_table(masked, columns), _block_table(whole, columns)
    int32, int64 = torch.int32, torch.int64
    parts = [(positions, int32), (slots, int64), (owner, int32), (tree, int64), (anc, int64), (kv_num, int32),
             (kv_idx, int32), (full_num, int32), (full_idx, int32), *more]
    (positions, slots, owner, tree, anc, kv_num, kv_idx, full_num, full_idx, *extra) = (
        upload(parts, pool.device) if into is None else into.write(parts))
    batch = PagedBatch(
        slots=slots, owner=owner, kv_num=kv_num, kv_idx=kv_idx, full_num=full_num, full_idx=full_idx,
        keys=pool.keys, values=pool.values, row_owner=pool.owner, row_position=pool.position, row_tree=pool.tree,
        tree=tree, anc=anc, q_block=q_block, trees=any(span.parents is not None for span in spans),
        dense=(1 + max((b for span in spans for b in span.blocks), default=0)) * BLOCK if dense else 0,
        fresh=tuple(n for n in [*(span.new for span in spans), pad] if n) if dense and spans and all(
            span.past == 0 and span.parents is None for span in spans) else (),  # padding: a sequence of its own
    )
    return positions, batch, extra


def _visible_blocks(spans: Sequence[Span], width: int, q_block: int) -> tuple[list[list[int]], list[list[int]]]:
    """Per query block of `q_block` tokens, the pool blocks it sees through the mask (its sequences' blocks up to
    its last position; the scratch block where it holds padding) and those it sees whole: a query block of one
    span's tokens sees the blocks wholly below that span's past whole (committed rows of its own, at positions
    below every query's), attended without the mask."""
    seen: list[dict[int, None]] = [{} for _ in range(-(-width // q_block))]  # pool blocks, in order
    holders: list[set[int]] = [set() for _ in seen]  # the spans with tokens in it (-1: padding)
    start = 0
    for s, span in enumerate(spans):
        for i, p in enumerate(range(span.past, span.past + span.new)):
            j = (start + i) // q_block
            holders[j].add(s)
            if i + 1 == span.new or (start + i + 1) % q_block == 0:  # the last token of this span in its query block
                seen[j].update(dict.fromkeys(span.blocks[: p // BLOCK + 1]))
        start += span.new
    for j in range(start // q_block, len(seen) if start < width else 0):  # the padding, tokens start.. on
        holders[j].add(-1)
    masked, whole = [], []
    for blocks, held in zip(seen, holders, strict=True):
        full: list[int] = []
        if -1 in held:
            blocks[0] = None
        elif len(held) == 1:
            span = spans[held.pop()]
            full = span.blocks[: span.past // BLOCK]
            below = set(full)
            blocks = dict.fromkeys(b for b in blocks if b not in below)
        masked.append(list(blocks))
        whole.append(full)
    return masked, whole


def _block_table(rows: list[list[int]], columns: int) -> tuple[numpy.ndarray, numpy.ndarray]:
    """A BlockMask's counts [1, 1, Q] and indices [1, 1, Q, columns] (int32) of each query block's pool blocks
    (filled in numpy: a tensor a query block was slow at a forward's many query blocks)."""
    idx = numpy.zeros((1, 1, len(rows), columns), dtype=numpy.int32)
    for j, row in enumerate(rows):
        if len(row) > columns:
            raise ValueError(f"a query block sees {len(row)} pool blocks, past the table's {columns} columns "
                             "(a sequence longer than the pool's sequence_blocks)")
        idx[0, 0, j, : len(row)] = row
    return numpy.array([[[len(row) for row in rows]]], dtype=numpy.int32).reshape(1, 1, len(rows)), idx


def keep_rows(pool: PagedKVPool, src: list[int], dst: list[int], positions: list[int],
              freed: list[int]) -> None:
    """After a tree verify (all its steps at once, on the device, no host sync): the KV of the kept nodes'
    rows `src` moves to the rows `dst` of their committed `positions` in every layer; those rows become
    committed (position, tree bit 0), and the rows `freed` (the trees' other nodes) are freed."""
    moved = [(s, d) for s, d in zip(src, dst, strict=True) if s != d]
    long = torch.long
    to, rows_from, rows_to, committed, gone = upload(
        [(dst, long), ([s for s, _ in moved], long), ([d for _, d in moved], long), (positions, torch.int32),
         (freed, long)], pool.device)
    if moved:
        for table in (pool.keys, pool.values):
            for t in table:  # index_select copies first: a row may be read and written by two moves
                t.index_copy_(pool.ROW_DIM, rows_to, t.index_select(pool.ROW_DIM, rows_from))
    pool.position.index_copy_(0, to, committed)
    pool.tree.index_fill_(0, to, 0)
    if freed:
        pool.owner.index_fill_(0, gone, FREE)
        pool.tree.index_fill_(0, gone, 0)
