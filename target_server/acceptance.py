"""The lossless acceptance rule of speculative decoding, for a linear chain of K drafts.

Drafts are deterministic (argmax of the draft), so the draft distribution q is one-hot:
accepting d_k with probability min(1, p/q) = p(d_k) and resampling from norm(max(0, p - q))
= p with d_k zeroed keeps the output distribution equal to sampling the target alone.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tandem.params import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> the distribution the target samples from, after temperature/top-k/top-p. [N, V] fp32."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k > 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    scores = warpers(None, logits.float())
    return torch.softmax(scores, dim=-1)


def accept_greedy(logits: torch.Tensor, drafts: torch.Tensor) -> tuple[int, int]:
    """logits [K+1, V], drafts [K] -> (accepted a, bonus b). Accept while d_k == argmax."""
    best = logits.argmax(dim=-1)  # [K+1]
    k = drafts.numel()
    accepted = int((drafts == best[:k]).int().cumprod(0).sum()) if k else 0
    return accepted, int(best[accepted])


def accept_sampled(
    probs: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator
) -> tuple[int, int]:
    """probs [K+1, V], drafts [K] -> (accepted a, bonus b), by the rule in the module docstring."""
    k = drafts.numel()
    accepted = 0
    if k:
        u = torch.rand(k, generator=generator, device=probs.device)  # [K]
        p_draft = probs[torch.arange(k, device=probs.device), drafts]  # [K]
        accepted = int((u < p_draft).int().cumprod(0).sum())
    final = probs[accepted]
    if accepted < k:
        final = final.clone()
        final[drafts[accepted]] = 0.0  # residual max(0, p - q) with q one-hot on d_a
    bonus = torch.multinomial(final / final.sum(), 1, generator=generator)
    return accepted, int(bonus)


def pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Sample one token from logits [V] (the prefill's first token)."""
    return accept(logits[None], torch.empty(0, dtype=torch.long, device=logits.device), params, generator)[1]


def accept(
    logits: torch.Tensor, drafts: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, int]:
    if params.greedy:
        return accept_greedy(logits, drafts)
    assert generator is not None
    return accept_sampled(target_probs(logits, params), drafts, generator)
