"""The target's KV memory: the paged pool every session's KV lives in, the layer view a forward
writes through, and the budget sessions reserve their share of as they grow."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from transformers.cache_utils import DynamicLayer

from tandem.memory import GPU_MARGIN
from tandem.params import MAX_DRAFT_TOKENS, MAX_TREE_NODES
from tandem.sessions import ResourceExhausted

# The most new tokens one verify writes for a moment: t and a chain's drafts or a tree's nodes. A prefill
# reserves them on top of its generation; a full batch of verifies has that many rows of logits each.
VERIFY_TOKENS = max(MAX_DRAFT_TOKENS, MAX_TREE_NODES) + 1


class KVLayer(DynamicLayer):
    """One layer's KV for one forward: the batch's past [B, kv_heads, past, head_dim], gathered from the
    pool only when the layer asks for it, with the new tokens after it. So one layer's padded copy exists
    at a time (the allocator reuses it for the next layer), not every layer's at once: a second copy of
    the batch's KV per forward was more memory than the budget counted. The new tokens' KV is kept for
    the scatter. transformers' DynamicLayer concatenates, which copies the whole cache at every step."""

    def __init__(self, gather: Callable[[torch.Tensor, torch.Tensor], None] | None, shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self._gather = gather  # fills keys, values [B, kv_heads, past, head_dim] from the pool
        self.dtype, self.device = dtype, device
        self.is_initialized = True
        self.past = shape[2]
        self._sized(shape)
        self.new_keys = self.new_values = None  # [B, kv_heads, width, head_dim] after the forward

    def _sized(self, shape: tuple[int, ...]) -> None:
        """What transformers reads of keys and values between updates is their shape (the mask's size):
        a zero-stride view, no memory."""
        self.keys = self.values = torch.zeros((), dtype=self.dtype, device=self.device).expand(shape)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.new_keys, self.new_values = key_states, value_states
        b, heads, width, dim = key_states.shape
        if not self.past:
            keys, values = key_states, value_states
        else:
            keys = key_states.new_empty(b, heads, self.past + width, dim)
            values = value_states.new_empty(b, heads, self.past + width, dim)
            self._gather(keys[:, :, : self.past], values[:, :, : self.past])
            keys[:, :, self.past :], values[:, :, self.past :] = key_states, value_states
        self._sized(keys.shape)
        return keys, values


class KVPool:
    """Every session's KV in blocks of BLOCK positions (vLLM's paged KV cache, gathered for each forward):
    per layer one keys and one values tensor [blocks * BLOCK, kv_heads, head_dim]. A session holds a list
    of blocks and `rows`, the pool row of each of its positions. A batch's past is one gather per layer,
    and the tokens it commits one scatter per layer, whatever the number of sessions (per-session
    buffers cost two copies per session and layer each way: much of the target's time at 16 sessions).
    The KV budget sizes it (`max_blocks`): a GPU target's pool is preallocated there, so the memory is
    claimed at start-up; a CPU's grows by doubling up to it. Without a budget it grows without bound."""

    BLOCK = 16

    def __init__(self, layers: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 blocks: int = 64, max_blocks: int | None = None):
        self.shape = (heads, head_dim)
        self.max_blocks = max_blocks
        if max_blocks is not None:
            blocks = min(blocks, max_blocks)
        self.dtype, self.device = dtype, device
        self.keys = [self._zeros(blocks * self.BLOCK) for _ in range(layers)]
        self.values = [self._zeros(blocks * self.BLOCK) for _ in range(layers)]
        self._free = list(range(blocks))
        self._lock = threading.Lock()  # releases come from the service threads

    ROW_DIM = 0  # the dimension of a layer's tensor that counts pool rows

    def _zeros(self, rows: int) -> torch.Tensor:
        """One layer's keys or values for `rows` rows: [rows, kv_heads, head_dim]."""
        return torch.zeros(rows, *self.shape, dtype=self.dtype, device=self.device)

    def _extend(self, rows: int) -> None:
        """`rows` more rows at the end of every layer's tensors."""
        for table in (self.keys, self.values):
            for i, t in enumerate(table):
                table[i] = torch.cat([t, self._zeros(rows)], dim=self.ROW_DIM)

    @property
    def blocks(self) -> int:
        return self.keys[0].shape[self.ROW_DIM] // self.BLOCK

    @property
    def capacity(self) -> int:
        """The KV tokens the pool holds for sessions now."""
        return self.blocks * self.BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def allocate(self, n: int) -> list[int]:
        with self._lock:
            if len(self._free) < n:
                old = self.blocks
                grown = max(2 * old, old + n - len(self._free))
                if self.max_blocks is not None:
                    grown = min(grown, self.max_blocks)
                if grown - old < n - len(self._free):  # reservations count whole blocks: not under the budget
                    raise ResourceExhausted(f"the KV pool's {self.blocks} blocks are taken; {n} more asked for")
                self._extend((grown - old) * self.BLOCK)
                self._free += range(old, grown)
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def free(self, blocks: list[int]) -> None:
        with self._lock:
            self._free += blocks


class KVBudget:
    """The KV tokens all sessions together may hold. A session reserves its prompt and one verify's width,
    and grows its share as it generates (vLLM's paged KV: a request holds the KV it has used, not its
    max_tokens); when the budget is taken a reservation is refused at once: the scheduler keeps a refused
    prefill waiting and preempts the newest request for a verify (coordinator/scheduler.py)."""

    def __init__(self, tokens: int | None):
        self.tokens = tokens  # None: unbounded
        self.used = 0
        self._lock = threading.Lock()  # releases come from the service threads

    def check(self, n: int) -> int:
        """n tokens in whole pool blocks; ResourceExhausted if they could never fit the whole budget."""
        asked, n = n, -(-n // KVPool.BLOCK) * KVPool.BLOCK
        if self.tokens is not None and n > self.tokens:
            blocks = f" ({n} in whole blocks of {KVPool.BLOCK})" if n != asked else ""
            raise ResourceExhausted(f"the request needs {asked} KV tokens{blocks}; the whole KV budget is {self.tokens}")
        return n

    def reserve(self, n: int) -> int:
        """Reserve n tokens, counted in whole pool blocks (so that the pool, sized to the budget, always
        has a session's blocks); returns what was reserved, for free()."""
        n = self.check(n)
        with self._lock:
            if self.tokens is not None and self.used + n > self.tokens:
                raise ResourceExhausted(f"the KV budget is taken ({self.used} of {self.tokens} tokens reserved; "
                                        f"{n} more asked for)")
            self.used += n
        return n

    def free(self, n: int) -> None:
        with self._lock:
            self.used -= n


def kv_budget_tokens(free: int, total: int, bytes_per_token: int, layers: int, *, ring_bytes: int = 0,
                     forward_bytes: int = 0, margin: float = GPU_MARGIN) -> int:
    """The KV tokens a GPU target can hold without running out of memory, of the `free` bytes left once
    the model is loaded: less a margin (5% of the GPU's `total`: the CUDA context, NCCL's buffers,
    fragmentation), the feature ring (cuda-ipc) or send queue (nccl), one forward of the largest batch
    (measured), and per token of the pool the gather's one layer of padded past and its temporary
    (2 / layers of it; batches are split so that their padded past stays within the budget)."""
    usable = free - margin * total - ring_bytes - forward_bytes
    return max(int(usable // (bytes_per_token * (1 + 2 / layers))), 0)
