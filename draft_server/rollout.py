"""The K-step rollout, on the device from end to end: one host sync per rollout.

    rollout       K steps from the last output a: pick a draft from a's logits, feed it at the next
                  position, pick again... Positions are a device tensor advanced on the device; the
                  argmax, the sampled draw and the d2t mapping (draft id -> target id) run there too.
    draws         a sampled draft is drawn with the uniform of its sequence position (sampling.py). The
                  host knows the positions (or, after an ahead, the few they can be): it computes the
                  uniforms before the rollout and uploads them with the rows' settings, once, rather than
                  reading positions back or uploading at each step (on a GPU an upload syncs too).
    read_rollout  the one sync: the drafts (with the sampled rows' q, and an ahead's outcomes) of every
                  row, copied to the host at the end in a single read.

Greedy drafts are the argmax as before, and sampled ones the same draws from the same q; only when the
host learns them has changed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from draft_server.constrained import Masks
from draft_server.model import DraftKV, Eagle3Draft
from draft_server.sampling import DraftSampler, QSettings, draft_q, draw
from tandem.compiling import compile_graphs
from tandem.protocol import DraftProbs
from tandem.staging import upload

log = logging.getLogger("tandem.draft")


class GreedyStep:
    """A lone greedy session's rollout step, the layer's forward through the next draft's argmax and d2t
    (Eagle3Draft.greedy_step), as one compiled graph, dynamic in the KV's length. On a CPU (one thread, the
    demo head) a step runs far faster than eagerly over the same unpacked weights, but a K=5 propose at
    one request gains far less (the eager path's packed weights, the extend and the compiled call's own
    wrappers are the rest). It runs over an unpacked copy of the head (inductor cannot lower PackedLinear),
    compiled at start-up, two graphs (seconds the first time). With
    TANDEM_COMPILE set to 1 or background; untested on a GPU, so not by default there."""

    def __init__(self, model: Eagle3Draft):
        """`model`: an unpacked copy of the head, this step's own (the engine's, draft_server/compiled.py)."""
        started = time.monotonic()
        self.model = model
        self._step = torch.compile(self.model.greedy_step, dynamic=True)
        attention = model.midlayer.self_attn
        device, dtype = model.d2t.device, model.fc.weight.dtype
        with torch.inference_mode():  # as the engine calls it: inference tensors, contiguous (_greedy_rollout)
            k, v = (torch.zeros(1, attention.num_kv_heads, 8, attention.head_dim, device=device, dtype=dtype)
                    for _ in range(2))
            torch._dynamo.mark_dynamic(k, 2)
            torch._dynamo.mark_dynamic(v, 2)
            tokens, positions = torch.zeros(1, 1, dtype=torch.long, device=device), torch.full((1, 1), 8, device=device)
            a, _, k, v = self(torch.zeros(model.config.hidden_size, device=device, dtype=dtype), tokens, positions, k, v)
            self(a, tokens, positions + 1, k, v)  # the KV it returns has strides of its own: a second graph
        log.info("compiled the draft's greedy rollout step in %.0f s", time.monotonic() - started)

    def __call__(self, a, tokens, positions, k, v):
        return self._step(a, tokens, positions, k, v)


class GreedyPropose:
    """A lone greedy session's propose after its first (its KV not empty) as one compiled graph a K
    (Eagle3Draft.greedy_propose), dynamic in its new pairs and in the KV's length: the extend, then the K
    picks and steps, with one call's wrappers and guards a propose where GreedyStep pays them a step: faster
    than GreedyStep on a CPU, through the services too (`tandem profile`). Over GreedyStep's unpacked copy of
    the head, compiled at start-up for K = 1..KS, two graphs each (one new pair is a shape of its own),
    seconds a graph the first time; other Ks run GreedyStep."""

    KS = range(1, 6)

    def __init__(self, model: Eagle3Draft):
        started = time.monotonic()
        # a graph per K and per one new pair or more
        self._propose = compile_graphs(model.greedy_propose, 4 * len(self.KS), dynamic=True)
        with torch.inference_mode():  # as the engine calls it: inference tensors, a contiguous KV
            for rounds in self.KS:
                for m in (1, 2):
                    self._propose(*warm_inputs(model, m), rounds)
        log.info("compiled the draft's greedy propose for K = %d..%d in %.0f s", self.KS[0], self.KS[-1],
                 time.monotonic() - started)

    def propose(self, kv: DraftKV, length: int, features: torch.Tensor, next_tokens: list[int], rounds: int
                ) -> tuple[list[int], torch.Tensor]:
        """`kv` (of `length` committed pairs, and maybe a rollout's after them) grown by the new pairs (features
        [m, 3Ht] on the head's device and dtype) -> `rounds` drafts (target ids, read in one sync) and the
        outputs that proposed them [rounds, H]."""
        device = features.device
        if not features.is_inference():  # a graph is guarded on it: ours were traced on inference tensors
            features = features.clone()
        kv.crop(length)
        (tokens,) = upload([(next_tokens, torch.long)], device)
        drafts, rows, kv.k, kv.v = self._propose(features, tokens,
                                                 torch.arange(length, length + len(next_tokens), device=device),
                                                 plain(kv.k), plain(kv.v), rounds)
        return read_rollout(drafts[None], None)[0], rows


class SampledPropose:
    """A lone sampled session's propose after its first as one compiled call a K (sampled_propose): the extend,
    then K drafts each drawn from q at the request's temperature and top-p, cut to the `top_n` likeliest, with
    their q: what the eager rollout draws, with the same uniforms. Over GreedyStep's unpacked copy of the head,
    compiled at start-up for K = 1..KS, one new pair or more, with and without top-p; requests with a top-k
    (each its own graphs) and other Ks run eagerly."""

    KS = range(1, 6)

    def __init__(self, model: Eagle3Draft, top_n: int):
        started = time.monotonic()
        self.model, self.top_n, self.vocab = model, top_n, model.config.draft_vocab_size
        self._propose = compile_graphs(self._sampled_propose, 4 * 2 * len(self.KS), dynamic=True)
        device = model.d2t.device
        with torch.inference_mode():  # as the engine calls it: inference tensors, a contiguous KV
            for rounds in self.KS:
                for m in (1, 2):
                    for top_p in (1.0, 0.9):
                        self._propose(*warm_inputs(model, m), rounds,
                                      torch.ones(1, 1, device=device), torch.full((1, 1), top_p, device=device),
                                      torch.zeros(1, rounds, dtype=torch.float64, device=device), top_p >= 1.0)
        log.info("compiled the draft's sampled propose for K = %d..%d in %.0f s", self.KS[0], self.KS[-1],
                 time.monotonic() - started)

    def fits(self, rounds: int, settings: QSettings) -> bool:
        """Whether a lone row's rollout of these settings has a graph: no top-k (each would compile its own)."""
        return rounds in self.KS and settings.top_k == [self.vocab]

    def _sampled_propose(self, features, tokens, positions, k, v, rounds: int, temperature, top_p, uniforms,
                         cut_only: bool):
        """The m new pairs appended to the layer's KV k, v, then `rounds` drafts drawn with `uniforms` [1, rounds]
        -> the drafts [1, rounds], their q (ids, probs, support), the outputs that proposed them [1, rounds, H],
        and the KV with the m pairs (the rollout's own is dropped: exact features replace it)."""
        kv = DraftKV()
        kv.k, kv.v = k, v
        model = self.model
        a = model(model.fuse(features)[None], tokens[None], positions[None], kv)[:, -1:]  # [1, 1, H]
        committed = kv.k, kv.v
        settings = QSettings(temperature=temperature, top_k=[self.vocab], top_p=top_p, cut_only=cut_only,
                             top_k_col=torch.full((1, 1), self.vocab, device=temperature.device))
        drafts, q, rows = rollout(model, self.top_n, a, kv, positions[-1:][None] + 1, rounds,
                                  Draws(None, settings, uniforms))
        return drafts, q, rows, *committed

    def propose(self, kv: DraftKV, length: int, features: torch.Tensor, next_tokens: list[int], rounds: int,
                draws: Draws) -> tuple[list[int], list[DraftProbs], torch.Tensor]:
        """As GreedyPropose.propose, for a sampled session: `rounds` drafts drawn as `draws` (draws_for's, its
        settings and uniforms already on the device) says, their q, and the outputs that proposed them [rounds, H]."""
        device = features.device
        if not features.is_inference():  # a graph is guarded on it: ours were traced on inference tensors
            features = features.clone()
        kv.crop(length)
        settings = draws.settings
        (tokens,) = upload([(next_tokens, torch.long)], device)
        drafts, q, rows, kv.k, kv.v = self._propose(
            features, tokens,
            torch.arange(length, length + len(next_tokens), device=device), plain(kv.k), plain(kv.v), rounds,
            settings.temperature, settings.top_p, draws.uniforms, settings.cut_only)
        drafts, qs, _ = read_rollout(drafts, q)
        return drafts, qs, rows[0]


class ParallelPropose:
    """A lone greedy session's P-EAGLE propose after its first as one compiled call a K (Eagle3Draft.greedy_parallel):
    the new pairs and K-1 masked positions through every layer, and the K argmaxes, in one graph, dynamic in the
    new pairs and in the KV's length. Over an unpacked copy of the head, compiled at start-up for K = 1..KS (up
    to the head's depths), one new pair or more; sampled and constrained proposes, and other Ks, run eagerly."""

    KS = range(1, 6)

    def __init__(self, model: Eagle3Draft):
        started = time.monotonic()
        self.model, self.layers = model, model.config.num_layers
        self.ks = [k for k in self.KS if k <= model.config.num_depths]
        self._propose = compile_graphs(model.greedy_parallel, 4 * len(self.ks), dynamic=True)
        with torch.inference_mode():  # as the engine calls it: inference tensors, a contiguous KV
            self.mask_row = model.mask_row()
            for rounds in self.ks:
                for m in (1, 2):
                    features, tokens, positions, k, v = warm_inputs(model, m, m + rounds - 1)
                    self._propose(features, tokens, positions, self.mask_row, rounds,
                                  *[t.clone() for _ in range(self.layers) for t in (k, v)])
        log.info("compiled the draft's P-EAGLE propose for K = %s in %.0f s", self.ks, time.monotonic() - started)

    def fits(self, rounds: int) -> bool:
        return rounds in self.ks

    def propose(self, kv: DraftKV, length: int, features: torch.Tensor, next_tokens: list[int], rounds: int
                ) -> tuple[list[int], torch.Tensor]:
        """`kv` (of `length` committed pairs) grown by the new pairs (features [m, 3Ht] on the head's device and
        dtype) -> `rounds` drafts (target ids, read in one sync) and the outputs that proposed them [rounds, H]."""
        device = features.device
        if not features.is_inference():  # a graph is guarded on it: ours were traced on inference tensors
            features = features.clone()
        kv.crop(length)
        tokens, positions = upload([(values, torch.long) for values in self.model.parallel_inputs(
            next_tokens, length, rounds)], device)
        drafts, rows, *grown = self._propose(features, tokens, positions, self.mask_row, rounds,
                                             *map(plain, kv.tensors(self.layers)))
        kv.put(grown)
        return read_rollout(drafts[None], None)[0], rows


def warm_inputs(model: Eagle3Draft, m: int, n: int | None = None) -> tuple[torch.Tensor, ...]:
    """What a compiled draft call is traced on at start-up, made as the engine makes them (under the caller's
    inference mode; a contiguous KV of 8 pairs): features [m, 3Ht], n tokens (default m) at positions 8..,
    and the layer's KV k, v."""
    attention = model.midlayer.self_attn
    device, dtype = model.d2t.device, model.fc.weight.dtype
    n = m if n is None else n
    k, v = (torch.zeros(1, attention.num_kv_heads, 8, attention.head_dim, device=device, dtype=dtype) for _ in range(2))
    return (torch.zeros(m, 3 * model.config.target_hidden_size, device=device, dtype=dtype),
            torch.zeros(n, dtype=torch.long, device=device), torch.arange(8, 8 + n, device=device), k, v)


def plain(t: torch.Tensor) -> torch.Tensor:
    """t contiguous, with the strides of its shape: a compiled graph is guarded on them, and a size-1 axis of
    a tensor cut from a bigger one (a KV cropped after an ahead) keeps the bigger one's stride."""
    return t.contiguous().view(-1).view(t.shape)


@dataclass(frozen=True)
class Draws:
    """What a rollout's sampled rows draw with, uploaded before it starts (draws_for): on a GPU a copy from
    the host waits for the stream, so none happens between its steps."""

    index: torch.Tensor | None  # [b]: the sampled rows of the batch; None when every row samples
    settings: QSettings  # theirs, row by row
    uniforms: torch.Tensor  # [b, rounds] float64: step n of row j draws with uniforms[j, n]


def draws_for(samplers: list[DraftSampler | None], first: list[int], rounds: int, vocab: int,
              device: torch.device) -> Draws | None:
    """The Draws of a batch whose row i drafts sequence positions first[i], first[i] + 1, ... over a draft
    vocabulary of `vocab`; None when no row samples."""
    rows = [i for i, s in enumerate(samplers) if s is not None]
    if not rows:
        return None
    sampled = [samplers[i] for i in rows]
    uniforms = [[s.uniform(first[i] + n) for n in range(rounds)] for s, i in zip(sampled, rows, strict=True)]
    top_k = [min(s.top_k, vocab) or vocab for s in sampled]  # as QSettings.of, its tensors in this one copy
    index, uniforms, temperature, top_k_col, top_p = upload(
        [(rows, torch.long), (uniforms, torch.float64), ([s.temperature for s in sampled], torch.float32),
         (top_k, torch.long), ([s.top_p for s in sampled], torch.float32)], device)  # [b], [b, rounds], [b] x 3
    settings = QSettings(temperature=temperature[:, None], top_k=top_k, top_k_col=top_k_col[:, None],
                         top_p=top_p[:, None], cut_only=all(k == vocab for k in top_k) and all(
                             s.top_p >= 1.0 for s in sampled))
    return Draws(index=None if len(rows) == len(samplers) else index, settings=settings,
                 uniforms=uniforms.view(len(rows), rounds))


def rollout(model: Eagle3Draft, top_n: int, a: torch.Tensor, kv: DraftKV, position: torch.Tensor, rounds: int,
            draws: Draws | None, valid: torch.Tensor | None = None, step: GreedyStep | None = None,
            masks: Masks | None = None
            ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, torch.Tensor]:
    """`rounds` drafts per row: each picked from the last output a [B, 1, H], then fed at `position` [B, 1]
    (the last one is not fed). draws: the sampled rows' (None: all greedy). valid [B, S + rounds - 1]: the
    keys each row of a padded batch KV (S long) attends to, then the rollout's own columns, a step's read up
    to its own (None: a lone session, causal).
    -> drafts [B, rounds] (target ids); the sampled rows' q, (ids [b, rounds, N] target ids,
    probs [b, rounds, N], support [b, rounds]), or None; the outputs whose logits proposed the drafts
    [B, rounds, H]. `step`: a lone greedy session's steps run compiled (GreedyStep). `masks`: the constrained
    rows' (each pick from the masked logits)."""
    if step is not None and draws is None and valid is None and masks is None and rounds > 0:
        return _greedy_rollout(model, step, a, kv, position, rounds)
    drafts, ids, probs, rows = [], [], [], []
    for n in range(rounds):
        logits = model.draft_logits(a[:, -1])
        draft, q = pick(model, top_n, masks.apply(logits) if masks else logits, draws, n)  # [B]
        if masks and n + 1 < rounds:
            masks.took(draft)
        drafts.append(draft)
        rows.append(a[:, -1])
        if q is not None:
            ids.append(q[0])
            probs.append(q[1])
        if n + 1 < rounds:
            mask = None if valid is None else valid[:, None, None, : kv.length + 1]  # the keys once it is fed
            a = model(a, draft[:, None], position, kv, mask)
            position = position + 1
    if not drafts:  # K = 0
        return position.new_zeros(a.shape[0], 0), None, a[:, :0]
    if not ids:
        return torch.stack(drafts, 1), None, torch.stack(rows, 1)
    probs = torch.stack(probs, 1)  # [b, rounds, N]
    return torch.stack(drafts, 1), (torch.stack(ids, 1), probs, (probs > 0).sum(-1)), torch.stack(rows, 1)


def parallel_rollout(model: Eagle3Draft, top_n: int, a: torch.Tensor, draws: Draws | None,
                     masks: Masks | None = None
                     ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, torch.Tensor]:
    """A P-EAGLE head's drafts, as rollout returns them, from the outputs of its one forward a [B, rounds, H]
    (Eagle3Draft.parallel_draft): draft n picked from a[:, n] with the uniform of step n (with `masks`, from
    its masked logits, depth after depth)."""
    logits = model.draft_logits(a)  # [B, rounds, Vd]: one lm_head for all of them
    if draws is None and masks is None:  # the argmax of every depth at once
        return model.to_target_ids(logits.argmax(-1)), None, a
    picks = []
    for n in range(a.shape[1]):
        picks.append(pick(model, top_n, masks.apply(logits[:, n]) if masks else logits[:, n], draws, n))
        if masks and n + 1 < a.shape[1]:
            masks.took(picks[-1][0])
    if not picks:
        return a.new_zeros(a.shape[0], 0, dtype=torch.long), None, a
    drafts = torch.stack([d for d, _ in picks], 1)
    if draws is None:
        return drafts, None, a
    probs = torch.stack([q[1] for _, q in picks], 1)  # [b, rounds, N]
    return drafts, (torch.stack([q[0] for _, q in picks], 1), probs, (probs > 0).sum(-1)), a


def _greedy_rollout(model: Eagle3Draft, step: GreedyStep, a: torch.Tensor, kv: DraftKV, position: torch.Tensor,
                    rounds: int) -> tuple[torch.Tensor, None, torch.Tensor]:
    """rollout's greedy lone session, each step after the first pick one compiled call."""
    draft, _ = pick(model, 0, model.draft_logits(a[:, -1]), None, 0)
    a = a[0, -1]  # [H]
    drafts, rows = [draft], [a]
    k, v = plain(kv.k), plain(kv.v)  # one graph: the strides it was compiled for
    for _ in range(rounds - 1):
        a, draft, k, v = step(a, draft[:, None], position, k, v)
        drafts.append(draft)
        rows.append(a)
        position = position + 1
    kv.k, kv.v = k, v
    return torch.stack(drafts, 1), None, torch.stack(rows)[None]


def pick(model: Eagle3Draft, top_n: int, logits: torch.Tensor, draws: Draws | None, n: int
         ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """logits [B, Vd] -> each row's draft as a target id [B]: the argmax for a greedy session, drawn from q
    with its uniform for step n for a sampled one; with the sampled rows' q (target ids [b, N],
    probs [b, N]), None when no row samples."""
    if draws is None:
        return model.to_target_ids(logits.argmax(-1)), None
    sampled = logits if draws.index is None else logits[draws.index]
    ids, probs = draft_q(sampled, draws.settings, top_n)  # [b, N]
    chosen = ids.gather(1, draw(probs, draws.uniforms[:, n])[:, None])[:, 0]  # [b]
    if draws.index is not None:
        chosen = logits.argmax(-1).index_copy_(0, draws.index, chosen)
    return model.to_target_ids(chosen), (model.to_target_ids(ids), probs)


def read_rollout(drafts: torch.Tensor, q: tuple[torch.Tensor, ...] | None, *more: torch.Tensor
                 ) -> tuple[list[int], list[DraftProbs] | None, list[list[int]]]:
    """The rollout's one host sync: its drafts [B, rounds] and q (as rollout returns them), and any `more`
    integer tensors, read in a single copy. -> the drafts [B * rounds] row-major, their q [b * rounds]
    (None when no row sampled), each of `more` flat."""
    width = q[0].shape[-1] if q else 0
    drafts, *parts = read_back(drafts, *more, *(q or ()))
    more_parts, q_parts = parts[: len(more)], parts[len(more) :]
    return drafts.tolist(), q_support(*q_parts, width) if q else None, [m.tolist() for m in more_parts]


def read_back(*tensors: torch.Tensor) -> list[np.ndarray]:
    """The rollout's one host sync: device tensors -> one flat int64 array each, read in a single copy.
    Float tensors (float32 probabilities) come back as their bits, for q_support to view as floats."""
    flat = torch.cat([t.reshape(-1).long() if not t.is_floating_point()
                      else t.reshape(-1).float().view(torch.int32).long() for t in tensors]).cpu().numpy()
    return np.split(flat, np.cumsum([t.numel() for t in tensors[:-1]]).tolist())


def q_support(ids: np.ndarray, bits: np.ndarray, support: np.ndarray, width: int) -> list[DraftProbs]:
    """The q of each draft, read back flat ([n_drafts * width] ids and probability bits, [n_drafts]
    support), each cut to its support (the non-zero prefix that draft_q leaves). numpy splits and converts:
    faster than Python lists and array."""
    probs = bits.astype(np.int32).view(np.float32)
    return [DraftProbs(ids[at : at + n].tolist(), probs[at : at + n].tolist())
            for at, n in zip(range(0, len(ids), width), support.tolist(), strict=True)]
