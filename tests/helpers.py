"""Test doubles that are not mocks of the math: drafts that propose from the target model itself."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from draft_server.sampling import DraftSampler, draft_q, draw
from tandem.protocol import Branch, DraftProbs, Drafts, Propose


def compile_eagerly(monkeypatch) -> None:
    """torch.compile with dynamo's "eager" backend for the rest of a test: the graphs, guards and recompiles as
    compiled code has them, none of inductor's ~20 s a compile (its options dropped: they are inductor's)."""
    compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile(fn, **{**kw, "backend": "eager", "options": None}))


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of counts against probs (a token of probability 0 must count 0)."""
    assert int(counts[probs == 0].sum()) == 0, "a token of probability 0 was committed"
    support = probs > 0
    expected = float(counts.sum()) * probs[support].double()
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    df = torch.tensor((int(support.sum()) - 1) / 2, dtype=torch.float64)  # half the degrees of freedom
    return float(torch.special.gammaincc(df, stat / 2))


class StepByStep:
    """A test draft written a call per step: `run(steps)` (the DraftBackend batch) calls its propose() or
    ahead() for each step, an exception standing for a step that failed."""

    def run(self, steps):
        out = []
        for s in steps:
            try:
                if isinstance(s, Propose):
                    extra = {"tree": s.tree} if s.tree is not None else {}
                    if s.sampling is not None:
                        extra["sampling"] = s.sampling
                    out.append(self.propose(s.session_id, s.features, s.next_tokens, s.k, s.open, **extra))
                else:
                    out.append(self.ahead(s.session_id, s.features, s.next_tokens, s.drafts, s.k, s.branches).result())
            except Exception as exc:  # noqa: BLE001 - a step that fails fails alone
                out.append(exc)
        return out


class OracleDraft(StepByStep):
    """A DraftBackend that proposes the target's own greedy continuation, each token replaced with
    probability `corrupt` by one of the target's other top-5 choices. High, varied acceptance
    exercises every accepted length in verify; the target model stands in for a perfect head."""

    def __init__(self, model, corrupt: float, seed: int = 0):
        self.model = model
        self.corrupt = corrupt
        self.rng = torch.Generator().manual_seed(seed)
        self.first_token: dict[str, int] = {}  # the prompt's x_0, which the pairs (F_i, x_{i+1}) never carry
        self.context: dict[str, list[int]] = {}
        self._logits_cache: dict[tuple[int, ...], torch.Tensor] = {}

    def expect(self, first_token: int) -> None:
        self._next_first = first_token

    def _last_logits(self, ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in self._logits_cache:
            with torch.inference_mode():
                self._logits_cache[key] = self.model(torch.tensor([ids])).logits[0, -1]
        return self._logits_cache[key]

    def propose(self, session_id, features, next_tokens, num_draft_tokens, create=False, sampling=None, tree=None):
        """The drafts are argmax-like (no q): the target counts q one-hot on them. With `tree`: a tree of
        the target's top_k at each node in a shuffled order (so the accepted path wanders through the
        node order), the argmax dropped with probability `corrupt`; two nodes expanded a depth."""
        if create:
            self.context[session_id] = [self._next_first]
        context = self.context[session_id]
        context.extend(next_tokens)
        rollout = list(context)
        if tree is not None:
            return self._tree(rollout, tree)
        drafts = []
        for _ in range(num_draft_tokens):
            top = self._last_logits(rollout).topk(5).indices
            pick = 0
            if float(torch.rand(1, generator=self.rng)) < self.corrupt:
                pick = int(torch.randint(1, 5, (1,), generator=self.rng))
            drafts.append(int(top[pick]))
            rollout.append(drafts[-1])
        return drafts

    def _tree(self, rollout: list[int], tree) -> Drafts:
        tokens, parents, frontier = [], [], [(-1, rollout)]  # frontier[0]: on the target's greedy path
        for _ in range(tree.depth):
            on_path, others = [], []
            for i, (parent, context) in enumerate(frontier):
                top = self._last_logits(context).topk(tree.top_k + 1).indices.tolist()
                children = top[1:] if float(torch.rand(1, generator=self.rng)) < self.corrupt else top[:-1]
                for j in torch.randperm(len(children), generator=self.rng).tolist():
                    if len(tokens) == tree.nodes:
                        break
                    tokens.append(children[j])
                    parents.append(parent)
                    node = (len(tokens) - 1, [*context, children[j]])
                    (on_path if i == 0 and children[j] == top[0] else others).append(node)
            frontier = (on_path + others)[:2]
        return Drafts(tokens, None, parents)

    def ahead(self, session_id, features, next_tokens, drafts, num_draft_tokens, branches=1):
        """Overlap: assume `drafts` accepted and the target's greedy bonus after them, then draft on (with
        the same corruption). With corrupt=0 against a greedy target every verify is a hit."""
        self.context[session_id].extend(next_tokens)
        assumed = [*self.context[session_id], *drafts]
        bonus = int(self._last_logits(assumed).argmax())
        rollout, upcoming = [*assumed, bonus], []
        for _ in range(num_draft_tokens):
            top = self._last_logits(rollout).topk(5).indices
            pick = 0
            if float(torch.rand(1, generator=self.rng)) < self.corrupt:
                pick = int(torch.randint(1, 5, (1,), generator=self.rng))
            upcoming.append(int(top[pick]))
            rollout.append(upcoming[-1])
        done: Future = Future()
        done.set_result([Branch(accepted=len(drafts), bonus=bonus, drafts=upcoming)])
        return done

    def release(self, session_id):
        self.context.pop(session_id, None)
        return True


class SamplingOracleDraft(StepByStep):
    """A draft that samples its drafts from a q of its own, as the draft engine does (draft_server.sampling:
    the request's temperature, top-k and top-p, cut to `top_n`, drawn with position-keyed uniforms), and
    sends that q. Its logits are the target's, tempered and biased by a fixed random vector, so q is near
    p but not p: drafts are accepted often (the accepted and bonus tokens carry mass), rejected often
    enough (the recovered tokens do too), and q's truncation and support differ from p's.

    Sessions may run concurrently (the target batches them); every prompt starts with `first_token`."""

    def __init__(self, model, first_token: int, top_n: int = 8, temper: float = 1.3, bias: float = 0.5,
                 seed: int = 0):
        self.model, self.first_token, self.top_n, self.temper = model, first_token, top_n, temper
        vocab = model.get_output_embeddings().weight.shape[0]
        self.bias = bias * torch.randn(vocab, generator=torch.Generator().manual_seed(seed))
        self.context: dict[str, list[int]] = {}
        self.samplers: dict[str, DraftSampler] = {}
        self._logits_cache: dict[tuple[int, ...], torch.Tensor] = {}

    def _logits(self, ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in self._logits_cache:
            with torch.inference_mode():
                self._logits_cache[key] = self.model(torch.tensor([ids])).logits[0, -1] / self.temper + self.bias
        return self._logits_cache[key]

    def propose(self, session_id, features, next_tokens, num_draft_tokens, create=False, sampling=None, tree=None):
        if create:
            self.context[session_id] = [self.first_token]
            self.samplers[session_id] = DraftSampler.for_request(sampling)
        self.context[session_id].extend(next_tokens)
        if tree is not None:
            return self._tree(session_id, list(self.context[session_id]), tree)
        return self._rollout(session_id, list(self.context[session_id]), num_draft_tokens)

    def _tree(self, session_id: str, rollout: list[int], tree) -> Drafts:
        """A sampled tree as the draft engine grows one: at each node its children drawn from q without
        replacement (child j from q without children 0..j-1, with that q_j), and where q runs out (a small
        top-k) its likeliest other tokens without q; the first two children expanded."""
        sampler, tokens, parents, q, frontier = self.samplers[session_id], [], [], [], [(-1, rollout)]
        for _ in range(tree.depth):
            expand = []
            for parent, context in frontier:
                ids, probs = draft_q(self._logits(context)[None], [sampler], self.top_n)  # [1, N]
                children: list[int] = []
                for j in range(tree.top_k):
                    if len(tokens) == tree.nodes:
                        break
                    left = [(i, p) for i, p in zip(ids[0].tolist(), probs[0].tolist(), strict=True)
                            if p > 0 and i not in children]
                    if left:
                        row = torch.tensor([p for _, p in left], dtype=torch.float64)
                        row = row / row.sum()
                        children.append(left[int(draw(row[None], [sampler.uniform(len(context), j)])[0])][0])
                        q.append(DraftProbs([i for i, _ in left], row.tolist()))
                    else:
                        logits = self._logits(context)
                        children.append(next(t for t in logits.argsort(descending=True).tolist() if t not in children))
                        q.append(DraftProbs([], []))
                    tokens.append(children[-1])
                    parents.append(parent)
                    if j < 2:
                        expand.append((len(tokens) - 1, [*context, children[-1]]))
            frontier = expand[:2]
        return Drafts(tokens, q, parents)

    def _rollout(self, session_id: str, rollout: list[int], k: int) -> Drafts:
        """k drafts after `rollout`, each drawn from q with the uniform of its position."""
        sampler, drafts, q = self.samplers[session_id], [], []
        for _ in range(k):
            ids, probs = draft_q(self._logits(rollout)[None], [sampler], self.top_n)  # [1, N]
            column = int(draw(probs, [sampler.uniform(len(rollout))])[0])
            support = int((probs > 0).sum())
            drafts.append(int(ids[0, column]))
            q.append(DraftProbs(ids[0, :support].tolist(), probs[0, :support].tolist()))
            rollout = [*rollout, drafts[-1]]
        return Drafts(drafts, q)

    def ahead(self, session_id, features, next_tokens, drafts, num_draft_tokens, branches=1):
        """Overlap: for j = 0..J drafts accepted, the target's likeliest tokens after them (never the
        rejected d_{j+1}) as the bonus, and K sampled drafts after each: up to `branches` outcomes."""
        context = self.context[session_id]
        context.extend(next_tokens)
        prepared = []
        for j in range(len(drafts) + 1):
            prefix = [*context, *drafts[:j]]
            likeliest = ((self._logits(prefix) - self.bias) * self.temper).topk(3).indices.tolist()  # the target's
            for bonus in [t for t in likeliest if j == len(drafts) or t != drafts[j]][:2]:
                upcoming = self._rollout(session_id, [*prefix, bonus], num_draft_tokens)
                prepared.append(Branch(accepted=j, bonus=bonus, drafts=list(upcoming), q=upcoming.q))
        done: Future = Future()
        done.set_result(prepared[:branches])
        return done

    def release(self, session_id):
        self.context.pop(session_id, None)
        self.samplers.pop(session_id, None)
        return True


class RecordingDraft(StepByStep):
    """Wraps a DraftEngine and keeps every propose() call's inputs and outputs."""

    def __init__(self, engine):
        self.engine = engine
        self.calls: list[tuple[torch.Tensor, list[int], int, list[int]]] = []

    def propose(self, session_id, features, next_tokens, num_draft_tokens, create=False, sampling=None):
        drafts = self.engine.propose(session_id, features, next_tokens, num_draft_tokens, create, sampling)
        self.calls.append((features.clone(), list(next_tokens), num_draft_tokens, drafts))
        return drafts

    def release(self, session_id):
        return self.engine.release(session_id)
