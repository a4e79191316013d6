"""How the draft picks a draft token for a sampled request (speculative sampling): from its own
distribution q, which it then sends with the draft so that the target can accept it losslessly
(target_server/acceptance.py).

    q      the head's softmax at the request's temperature, with the request's top-k and then top-p
           (the target's order: transformers' warpers), cut to the `top_n` likeliest tokens and
           renormalised; top_n 0 keeps every token. Any q the draft really samples from is lossless;
           truncation only costs acceptance, and it bounds what crosses the wire: a support of N ids and
           N probabilities per draft, not the whole draft vocabulary.
    draw   by inverse CDF with a uniform keyed by the session and the position of the drafted token:
           a seeded request draws the same way alone or batched, through an ahead step or a propose,
           whatever the rounds before it. A uniform is used once per position in the committed output
           (a position, once verified, is never drafted again), and what is committed before a position
           does not depend on its uniform, so the draws are as fresh as a generator's.

Greedy requests never come here: their drafts are the argmax, as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tandem.params import SamplingParams
from tandem.staging import upload

_MASK64 = (1 << 64) - 1
_DRAFT_STREAM = 0x5D2A_F7C3_91B4_0E6D  # keeps the draft's uniforms apart from the target's seeded generator


@dataclass(frozen=True)
class DraftSampler:
    """A sampled session's settings on the draft."""

    temperature: float
    top_k: int  # 0: off
    top_p: float  # 1.0: off
    key: int  # the session's stream of uniforms, from the request's seed (random without one)

    @classmethod
    def for_request(cls, params: SamplingParams) -> DraftSampler:
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        return cls(params.temperature, params.top_k, params.top_p, _splitmix64(seed ^ _DRAFT_STREAM))

    def uniform(self, position: int, j: int = 0) -> float:
        """The uniform in [0, 1) that draws the draft token at sequence `position`; `j` > 0: an independent
        stream for a tree's further draws at that position (draft_server/tree.py)."""
        key = self.key if j == 0 else _splitmix64(self.key ^ (j * 0xD1B54A32D192ED03 & _MASK64))
        return (_splitmix64((key + position) & _MASK64) >> 11) * 2.0**-53


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(frozen=True)
class QSettings:
    """Sampled rows' settings as device tensors, made once per rollout rather than at each step: on a GPU
    a copy from the host waits for the stream, a host sync."""

    temperature: torch.Tensor  # [B, 1]
    top_k: list[int]  # each row's, min(top_k, vocab), the vocab when off
    top_k_col: torch.Tensor  # [B, 1]: top_k on the device
    top_p: torch.Tensor  # [B, 1]
    cut_only: bool  # no row has top-k or top-p: q is the top_n cut alone

    @classmethod
    def of(cls, samplers: list[DraftSampler], vocab: int, device: torch.device) -> QSettings:
        top_k = [min(s.top_k, vocab) or vocab for s in samplers]
        temperature, top_k_col, top_p = upload([([s.temperature for s in samplers], torch.float32),
                                               (top_k, torch.long), ([s.top_p for s in samplers], torch.float32)],
                                              device)  # one copy that leaves the host free
        return cls(temperature=temperature[:, None], top_k=top_k, top_k_col=top_k_col[:, None], top_p=top_p[:, None],
                   cut_only=all(k == vocab for k in top_k) and all(s.top_p >= 1.0 for s in samplers))


def q_width(settings: QSettings, vocab: int, top_n: int) -> int:
    """The columns of the sorted probabilities draft_q reads: the top_n cut's, and the top-k mass's."""
    n = vocab if top_n <= 0 else min(top_n, vocab)
    return max(n, *(k for k in settings.top_k if k < vocab), 1)


def draft_q(logits: torch.Tensor, samplers: list[DraftSampler] | QSettings, top_n: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, Vd] over the draft vocabulary -> (ids [B, N] draft ids, likeliest first; probs [B, N]
    fp32, each row summing to 1 over its support, a prefix of the row, and 0 after it). `samplers`: one
    per row, or their QSettings for the vocabulary Vd."""
    vocab = logits.shape[-1]
    s = samplers if isinstance(samplers, QSettings) else QSettings.of(samplers, vocab, logits.device)
    probs = torch.softmax(logits.float() / s.temperature, dim=-1)  # [B, Vd]
    n = vocab if top_n <= 0 else min(top_n, vocab)
    width = q_width(s, vocab, top_n)
    if width < vocab:
        sorted_p, ids = probs.topk(width, dim=-1)  # [B, width]
    else:
        sorted_p, ids = probs.sort(dim=-1, descending=True)
    if s.cut_only:
        kept = sorted_p[:, :n]
        return ids[:, :n], kept / kept.sum(-1, keepdim=True)
    keep = torch.arange(width, device=logits.device)[None] < s.top_k_col  # [B, width]
    # top-p works on the top-k mass, renormalised: the mass of the likelier tokens over it
    mass = torch.where(s.top_k_col < vocab, (sorted_p * keep).sum(-1, keepdim=True), 1.0)  # [B, 1]
    before = (torch.cumsum(sorted_p, -1) - sorted_p) / mass  # [B, width]
    keep = keep & (before < s.top_p)
    kept = (sorted_p * keep)[:, :n]
    return ids[:, :n], kept / kept.sum(-1, keepdim=True)


def draw(probs: torch.Tensor, uniforms: list[float] | torch.Tensor) -> torch.Tensor:
    """probs [B, N] (rows as draft_q gives them) -> the column each row draws with its uniform, [B].
    `uniforms` [B], a list or a tensor (float64 from DraftSampler.uniform: cast as the list would be)."""
    cdf = torch.cumsum(probs, dim=-1)  # [B, N]
    u = torch.as_tensor(uniforms, device=cdf.device).to(cdf.dtype)[:, None] * cdf[:, -1:]
    column = (cdf <= u).sum(-1)  # the first column whose cdf passes u
    return torch.minimum(column, (probs > 0).sum(-1) - 1)  # rounding never lands past the support
