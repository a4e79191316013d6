"""The draft engine: per-session KV of committed positions, extend with exact target features, K-step rollout.

Per round the engine gets the new committed pairs (F_i, x_{i+1}) — a+1 of them after a verify, n after
a prefill — appends them to its KV at RoPE positions i, then rolls out K steps from the last one:
d_1 comes from the last extend output; step k>1 feeds (a_{k-1}, d_{k-1}) at the next position.
The rollout's KV is dropped at the end, so the next round's exact target features replace it.

The scheduler's batch of a step runs at once (`run`): the sessions' KV copied left-padded into buffers kept
from step to step, their new pairs right-padded, one extend forward and one forward per rollout step for
all of them (draft_server/batch.py; with CUDA graphs, draft_server/graphs.py, a greedy batch's rollout is one
replay); each session keeps the KV of its committed pairs only, out of the KV budget (draft_server/budget.py:
a step past it is refused alone).

Overlap (`ahead`, while the target verifies): the engine appends the new committed pairs as propose
does, then feeds the drafts under verification as a rollout would (the draft's own hidden states
stand in for the target features it does not have yet): right after a propose, with the hidden
states that proposed them, in one forward; after new pairs, one step each from the exact pairs, since
the drafts were proposed before those pairs were known. From every possible outcome of that verify
(j drafts accepted, then a bonus c) it picks the likeliest — P(j) from the verifies it has seen, P(c)
from its logits — and rolls out K drafts for each, all in one batch. Only the committed pairs' KV is
kept: the assumed drafts and the rollouts are dropped, so every committed position is still read with
its exact target features.

Sampled requests (speculative sampling): a session opened with sampling parameters draws each draft
from its own distribution q at those settings instead of taking the argmax, in proposes and aheads
alike, and returns the q it drew from with the drafts (draft_server/sampling.py).

P-EAGLE heads (parallel drafting, draft_server/model.py): a propose is one forward, the new pairs and K-1
masked positions after them, and gives all K drafts (K up to the head's num_depths); the KV keeps the
pairs; a batch's proposes share that forward, each session's masked positions right after its own pairs.
A greedy tree request with a P-EAGLE head takes its first level (the top_k of depth 1) and the chain below
its likeliest node from that one forward (tree.parallel_tree). Heads of several layers, and P-EAGLE heads,
answer an ahead by appending its pairs and preparing no branch (the ahead's tensors are one layer's, and a
P-EAGLE propose is about one extend's cost anyway); with TANDEM_COMPILE a P-EAGLE head's lone greedy
proposes run compiled (rollout.ParallelPropose), a chain head of several layers runs eagerly.

Constrained requests (a grammar, min_tokens; tandem/constraint.py): a session opened with the request's
constraint keeps its own matcher, advanced on the committed tokens, and walks it along each rollout: every
draft is picked (argmax or draw) from the logits masked by the row the target will score there, and a
sampled draft's q is that masked one. Such a propose runs eagerly, one host read a step; trees are not
masked (the round loop cuts their forbidden nodes), and such sessions get no aheads.

Draft trees (EAGLE-2, draft_server/tree.py): a propose with `tree` extends as any propose does, then grows
a tree of drafts instead of a chain, one session at a time; its KV is dropped as a rollout's is. Aheads
assume chains: after a tree the session's next ahead is refused.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from draft_server.ahead import GreedyAhead, branches
from draft_server.batch import BatchBuffers, propose_batch
from draft_server.budget import DraftKVBudget
from draft_server.checkpoint import load_draft, read_config
from draft_server.compiled import CompiledCalls, compile_calls, compile_mode
from draft_server.constrained import DraftGrammars
from draft_server.graphs import RolloutGraphs
from draft_server.model import Eagle3Draft
from draft_server.rollout import (
    GreedyPropose,
    GreedyStep,
    ParallelPropose,
    SampledPropose,
    draws_for,
    parallel_rollout,
    read_rollout,
    rollout,
)
from draft_server.steps import DraftSteps, Outcomes, _Ahead, _drafts, _Session, _Step, read_target_shape
from draft_server.tree import SiblingRates, grow_tree, parallel_tree, tree_shape
from tandem.compiling import cuda_graphs_on
from tandem.defaults import DRAFT_Q_TOP_N
from tandem.dtypes import TORCH_DTYPES
from tandem.packed import can_pack, pack_linears
from tandem.pairing import DraftShape, check_pair
from tandem.params import SamplingParams, TreeParams
from tandem.protocol import Ahead, Branch, Drafts, DraftStep, Propose
from tandem.sessions import ResourceExhausted, SessionTable, build_batch
from tandem.staging import to_device, upload


class DraftEngine(DraftSteps):
    def __init__(
        self,
        draft_dir: str | Path,
        target_dir: str | Path | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        q_top_n: int = DRAFT_Q_TOP_N,
        aux_layer_convention: str | None = None,
    ):
        """`aux_layer_convention`: how the head's layer ids count (tandem/aux_layers.py; None: its layout's)."""
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)}, got {dtype!r}")
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[dtype]
        self.config, self.layout = read_config(draft_dir, target_dir, aux_layer_convention)
        # the head's trained context; RoPE is computed per position, so longer sequences still run
        self.max_context = int(getattr(self.config.layer, "max_position_embeddings", 0) or 0)
        self.target_max_context: int | None = None  # the context of the target checkpoint we were given
        if target_dir is not None:  # refuse a head made for another target before reading its weights
            check_pair(read_target_shape(target_dir), self.shape(max_target_id=0))
            self.target_max_context = read_target_shape(target_dir).max_context
        self.model: Eagle3Draft = load_draft(draft_dir, target_dir, device=device, dtype=self.dtype,
                                             aux_layer_convention=aux_layer_convention)
        if target_dir is not None:
            check_pair(read_target_shape(target_dir), self.shape())
        # the chain's compiled calls and the ahead run one layer's KV; a P-EAGLE head compiles its own propose
        self.eager_only = self.config.num_layers > 1 or self.config.parallel_drafting
        mode = compile_mode() if not self.eager_only or self.config.parallel_drafting else None
        unpacked = copy.deepcopy(self.model) if mode else None  # the compiled calls' copy: before packing
        if can_pack(self.device, self.dtype):  # a CPU in float32: big projections over prepacked weights
            pack_linears(self.model)
        self.feature_size = 3 * self.config.target_hidden_size
        self._mask_row = None  # a P-EAGLE head's fuse(mask_hidden), once
        if self.config.parallel_drafting:
            with torch.inference_mode():
                self._mask_row = self.model.mask_row()
        self.sessions: SessionTable[_Session] = SessionTable("draft")
        self.batch_buffers = BatchBuffers(self.model, self.device, self.dtype)  # a batched propose's KV and mask
        # CUDA graphs of rollouts and greedy trees (TANDEM_CUDA_GRAPHS=1 on CUDA): lone sessions then run as a batch
        self.rollout_graphs = (RolloutGraphs(self.model, self.batch_buffers, self.device, q_top_n)
                               if cuda_graphs_on(self.device) else None)
        self.kv_budget = DraftKVBudget()  # unbounded until the service sizes it (draft_server/budget.py)
        self._running = threading.Lock()  # one batch at a time: in-process callers may come from several threads
        # every forward runs on this stream (None: the CPU's); a fast path's copy of a step's features is
        # waited for on it (FeatureReceiver.recv's consumer), GPU-side
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.q_top_n = q_top_n  # sampled drafts: q is cut to this many likeliest tokens (0: not cut)
        self.draft_vocab = self.config.draft_vocab_size
        self.outcomes = Outcomes()  # how many drafts verifies accepted: aheads rank their branches by it
        self.sibling_rates = SiblingRates()  # what a sampled tree's j-th draw at each depth is worth
        d2t = self.model.d2t
        # target id -> draft id, -1 outside the draft vocabulary
        self._draft_id = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=d2t.device)
        self._draft_id[self.model.to_target_ids(torch.arange(d2t.numel(), device=d2t.device))] = torch.arange(
            d2t.numel(), device=d2t.device)
        # constrained requests' matchers and masks, over the target's tokenizer
        self.grammars = DraftGrammars(target_dir, self.config.vocab_size,
                                      self.model.to_target_ids(torch.arange(d2t.numel(), device=d2t.device)),
                                      self.device)
        # the compiled calls (draft_server/compiled.py), None until compiled: the eager paths run meanwhile
        self.greedy_step: GreedyStep | None = None
        self.greedy_propose: GreedyPropose | None = None
        self.greedy_ahead: GreedyAhead | None = None
        self.sampled_propose: SampledPropose | None = None
        self.parallel_propose: ParallelPropose | None = None
        if mode:  # set once there is nothing (more) to compile
            self.compiled = compile_calls(unpacked, self._draft_id, q_top_n, self._install,
                                          background=mode == "background")
        else:
            self.compiled = threading.Event()
            self.compiled.set()

    def _install(self, calls: CompiledCalls) -> None:
        self.greedy_propose, self.greedy_ahead, self.sampled_propose = calls.propose, calls.ahead, calls.sampled
        self.greedy_step, self.parallel_propose = calls.step, calls.parallel

    def shape(self, max_target_id: int | None = None) -> DraftShape:
        if max_target_id is None:
            d2t = self.model.d2t
            max_target_id = int((d2t + torch.arange(d2t.numel(), device=d2t.device)).max())
        return DraftShape(
            vocab_size=self.config.vocab_size,
            target_hidden_size=self.config.target_hidden_size,
            max_target_id=max_target_id,
            aux_layer_ids=self.config.aux_layer_ids,
        )

    def run(self, steps: Sequence[DraftStep]) -> list[Drafts | list[Branch] | Exception]:
        """One batch, run at once: a Propose's Drafts or an Ahead's branches, or the error of a step that
        failed (it fails alone), per step. Chain proposes share forwards (a session's first apart: it carries
        the whole prompt, and padding the others' few pairs to it is waste); trees and aheads run one by one."""
        with self._running, torch.cuda.stream(self.stream):
            results, built = build_batch(
                steps, lambda step: self._propose_step(step) if isinstance(step, Propose) else self._ahead_step(step),
                refused=(ResourceExhausted,))
            groups = [_group(b) for _, b in built]  # before any runs: a first propose's KV grows
            for group in (True, False, None):
                part = [(i, b) for (i, b), g in zip(built, groups, strict=True) if g is group]
                if part:
                    for (i, _), out in zip(part, self._run_steps([b for _, b in part]), strict=True):
                        results[i] = out
        return results

    def propose(self, session_id: str, features: torch.Tensor, next_tokens: list[int], num_draft_tokens: int,
                create: bool = False, sampling: SamplingParams | None = None, tree: TreeParams | None = None) -> Drafts:
        """One propose alone (run() with a batch of one), raising its error: the m new committed pairs
        (features [m, 3Ht], next_tokens [m]), then K drafts (target ids): the argmax, or for a session opened
        with sampling drawn from q, with q; with `tree`, a tree of drafts (Drafts.parents)."""
        return _raised(self.run([Propose(session_id, features, next_tokens, num_draft_tokens, create, sampling,
                                         tree)])[0])

    def prepare(self, session_id: str, features: torch.Tensor | None, next_tokens: list[int], assumed: list[int],
                num_draft_tokens: int, branches: int = 1) -> list[Branch]:
        """One ahead alone (run() with a batch of one), raising its error."""
        return _raised(self.run([Ahead(session_id, features, next_tokens, assumed, num_draft_tokens, branches)])[0])

    # -- one batched step -----------------------------------------------------------------------

    def _run_steps(self, steps: list[_Step | _Ahead]) -> list:
        """Chain proposes batched together, trees and aheads one session at a time."""
        proposes = [step for step in steps if isinstance(step, _Step) and step.tree is None]
        results: dict[int, object] = {}
        if proposes:
            try:
                results.update(zip(map(id, proposes), self._run_batch(proposes), strict=True))
            except Exception as exc:  # noqa: BLE001 - handed to each propose of the batch
                results.update((id(step), exc) for step in proposes)
        for step in steps:
            if id(step) not in results:
                try:
                    results[id(step)] = self._run_ahead(step) if isinstance(step, _Ahead) else self._run_tree(step)
                except Exception as exc:  # noqa: BLE001 - fails this step alone
                    results[id(step)] = exc
        return [results[id(step)] for step in steps]

    @torch.inference_mode()
    def _run_batch(self, steps: list[_Step]) -> list[list[int]]:
        graphs = self.rollout_graphs
        if len(steps) == 1 and not (graphs and graphs.fits(steps, self.config, steps[0].k)):
            return [self._run_one(steps[0])]
        return propose_batch(self.model, steps, self.grammars, self.q_top_n, self.device, self.dtype,
                             self.batch_buffers, graphs)

    def _run_one(self, step: _Step) -> Drafts:
        """One session alone: its own KV, no padding."""
        session, kv = step.session, step.session.kv
        if self.config.parallel_drafting:
            return self._run_parallel(step)
        draws = draws_for([session.sampler], [session.length + len(step.next_tokens)], step.k, self.draft_vocab,
                          self.device)
        masks = self.grammars.masks([step])
        compiled = self._compiled_propose(step, draws) if kv.k is not None and masks is None else None
        if compiled is not None:
            tokens, qs, rows = compiled
            session.length += len(step.next_tokens)
            session.proposed = [(tokens, rows)]
            return _drafts(tokens, qs)
        a, position = self._extend(step)
        try:
            drafts, q, rows = rollout(self.model, self.q_top_n, a, kv, position, step.k, draws, step=self.greedy_step,
                                      masks=masks)
        finally:
            if masks is not None:
                masks.close()
        kv.crop(session.length)  # the rollout's KV is dropped: exact target features replace it
        drafts, qs, _ = read_rollout(drafts, q)  # [K], [K]
        session.proposed = [(drafts, rows[0])]
        return _drafts(drafts, qs)

    def _run_parallel(self, step: _Step) -> Drafts:
        """A P-EAGLE propose: the new pairs and K-1 masked positions in one forward, K up to num_depths."""
        model, session, m, device = self.model, step.session, len(step.next_tokens), self.device
        k = min(step.k, self.config.num_depths)
        draws = draws_for([session.sampler], [session.length + m], k, self.draft_vocab, device)
        masks = self.grammars.masks([step])
        compiled = self.parallel_propose
        if compiled is not None and draws is None and masks is None and session.kv.k is not None and compiled.fits(k):
            drafts, rows = compiled.propose(session.kv, session.length, to_device(step.features, device, self.dtype),
                                            step.next_tokens, k)
            session.length += m
            session.proposed = [(drafts, rows)]
            return _drafts(drafts, None)
        tokens, positions = upload([(list_, torch.long) for list_ in model.parallel_inputs(
            step.next_tokens, session.length, max(k, 1))], device)
        a = model.parallel_draft(to_device(step.features, device, self.dtype), tokens, positions, session.kv,
                                 self._mask_row)
        session.length += m
        try:
            drafts, q, rows = parallel_rollout(model, self.q_top_n, a[None, :k], draws, masks)
        finally:
            if masks is not None:
                masks.close()
        drafts, qs, _ = read_rollout(drafts, q)  # [K], [K]
        session.proposed = [(drafts, rows[0])]
        return _drafts(drafts, qs)

    def _compiled_propose(self, step: _Step, draws) -> tuple | None:
        """A propose after the session's first as one compiled call where one fits it (GreedyPropose,
        SampledPropose): its drafts, their q (sampled) and the outputs that proposed them [K, H]; else None."""
        session, features = step.session, to_device(step.features, self.device, self.dtype)
        if draws is None and self.greedy_propose is not None and step.k in GreedyPropose.KS:
            tokens, rows = self.greedy_propose.propose(session.kv, session.length, features, step.next_tokens, step.k)
            return tokens, None, rows
        if draws is not None and self.sampled_propose is not None and self.sampled_propose.fits(step.k, draws.settings):
            return self.sampled_propose.propose(session.kv, session.length, features, step.next_tokens, step.k, draws)
        return None

    def _extend(self, step: _Step) -> tuple[torch.Tensor, torch.Tensor]:
        """A lone session's new pairs appended to its KV -> the last output a [1, 1, H] and the position its
        first draft is fed at [1, 1]."""
        model, session, m, device = self.model, step.session, len(step.next_tokens), self.device
        (tokens,) = upload([([step.next_tokens], torch.long)], device)  # [1, m]
        hidden = model.fuse(to_device(step.features, device, self.dtype))[None]  # [1, m, H]
        positions = torch.arange(session.length, session.length + m, device=device)[None]
        a = model(hidden, tokens, positions, session.kv)[:, -1:]  # [1, 1, H]
        session.length += m
        return a, positions[:, -1:] + 1

    @torch.inference_mode()
    def _run_tree(self, step: _Step) -> Drafts:
        """One session's extend, then its draft tree (draft_server/tree.py), read back in one copy."""
        session, sampler = step.session, step.session.sampler  # sampled: children drawn from q
        first = session.length + len(step.next_tokens)
        draws = draws_for([sampler], [first], step.tree.depth, self.draft_vocab, self.device)  # uploaded now
        values = None
        if draws is not None:  # draw j of each depth with stream j (j = 0: keyed as the chain's drafts)
            k = min(step.tree.top_k, self.draft_vocab)
            uniforms, values = upload([([[sampler.uniform(first + n, j) for n in range(step.tree.depth)]
                                         for j in range(k)], torch.float64),
                                        (self.sibling_rates.log_values(step.tree.depth, k), torch.float32)],
                                       self.device)
            draws = replace(draws, uniforms=uniforms)
        if self.config.parallel_drafting and sampler is None:  # the tree from the one forward (tree.py)
            model, m = self.model, len(step.next_tokens)
            tokens, positions = upload([(list_, torch.long) for list_ in model.parallel_inputs(
                step.next_tokens, session.length, max(1, min(step.tree.depth, self.config.num_depths)))], self.device)
            a = model.parallel_draft(to_device(step.features, self.device, self.dtype), tokens, positions, session.kv,
                                     self._mask_row)
            session.length += m
            tree = parallel_tree(model, a, step.tree)
        else:
            a, position = self._extend(step)
            if self.rollout_graphs is not None and sampler is None:  # a greedy tree from its bucket's graph
                k, depth, _ = tree_shape(step.tree, self.draft_vocab)
                kv, valid = self.batch_buffers.lone(session.kv, session.length, (depth - 1) * k)
                tree = self.rollout_graphs.tree(a, kv, position, step.tree, valid)
            else:
                tree = grow_tree(self.model, a, session.kv, position, step.tree, sampler and sampler.temperature,
                                 draws, self.q_top_n, values)
        tokens, q, (parents,) = read_rollout(tree.tokens, tree.q, tree.parents)  # q: one per node, or None
        session.proposed = []  # no chain for an ahead to assume
        if sampler is not None:
            session.last_tree = (tokens, parents)
        return Drafts(tokens, q, parents)

    @torch.inference_mode()
    def _run_ahead(self, step: _Ahead) -> list[Branch]:
        """The new committed pairs and the assumed drafts, then K batched steps per branch (ahead.branches)."""
        session, device, k = step.session, self.device, step.k
        m, j_max = len(step.next_tokens), len(step.assumed)
        start = session.length
        session.kv.crop(start)
        if self.eager_only:  # the pairs only (the module docstring): the next round proposes
            if m:
                self._extend(_Step(session, step.features, step.next_tokens, 0))
            return []
        # what the host knows, uploaded before any forward (on a GPU an upload waits for the stream)
        assumed, prefix, tokens = upload([(step.assumed, torch.long),
                                          (self.outcomes.logprobs(j_max, session.sampler is not None), torch.float32),
                                          (step.next_tokens if m else step.assumed, torch.long)], device)  # [J], [J+1]
        n = min(step.branches, self.draft_vocab)
        b = min(step.branches, (j_max + 1) * n)  # the branches: the best b of J+1 forks x n bonus tokens
        positions = torch.arange(start, start + len(tokens), device=device)
        features = to_device(step.features, device, self.dtype)
        rows = step.rows.to(self.dtype) if m == 0 else None  # the hidden states that proposed them: on the device
        if session.sampler is None and self.greedy_ahead is not None and self.greedy_ahead.fits(k, j_max, n, b):
            out = self.greedy_ahead(features, tokens, positions, session.kv.k, session.kv.v, rows, assumed, prefix,
                                    n, k)
        else:
            # every uniform a branch may draw with: the one at base+1+t is column t (sliced per fork)
            draws = draws_for([session.sampler] * b, [start + m + 1] * b, j_max + k, self.draft_vocab, device)
            out = branches(self.model, features, tokens, positions, session.kv.k, session.kv.v, rows, assumed,
                           prefix, self._draft_id, n, b, k, session.sampler and session.sampler.temperature, draws,
                           self.q_top_n)
        drafts, q, rows, forks, bonus, session.kv.k, session.kv.v = out
        session.length = start + m
        session.kv.crop(session.length)  # the committed pairs are kept; the assumed drafts are not
        drafts, qs, (forks, bonus) = read_rollout(drafts, q, forks, bonus)  # [B * K], [B * K], [B] x2
        session.proposed = [(drafts[i * k : (i + 1) * k], rows[i]) for i in range(b)]
        return [Branch(accepted=forks[i], bonus=bonus[i], drafts=drafts[i * k : (i + 1) * k],
                       q=qs[i * k : (i + 1) * k] if qs else None) for i in range(b)]


def _group(step: _Step | _Ahead) -> bool | None:
    """Which steps share forwards: a session's first chain proposes (True), its later ones (False); trees and
    aheads (None) run one session at a time."""
    if isinstance(step, _Ahead) or step.tree is not None:
        return None
    return step.session.length == 0


def _raised(result):
    if isinstance(result, BaseException):
        raise result
    return result
