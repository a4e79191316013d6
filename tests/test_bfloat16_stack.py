"""bfloat16, as every GPU deployment runs: the three services with target and draft in bfloat16 on the CPU.
Speculative decoding is exact only up to the arithmetic: a verify's K+1 rows round as a matrix of K+1 rows,
a decode's one row as a vector, so greedy outputs may part where two logits are within bfloat16's rounding.
What must hold is that EAGLE-3 agrees with bfloat16 target-only decoding at least as well as target-only
decoding agrees with itself when batched (the same rounding's noise floor)."""

from __future__ import annotations

import statistics
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from processes import start_stack, stop_stack

from coordinator.client import TandemClient

PROMPTS = 6
NEW_TOKENS = 24


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, vocab, (int(n),), generator=g).tolist() for n in torch.randint(3, 30, (PROMPTS,),
                                                                                          generator=g)]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The mean share of each output two runs share from its start."""
    shares = []
    for x, y in zip(a, b, strict=True):
        same = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        shares.append(same / max(len(x), len(y), 1))
    return statistics.fmean(shares)


@pytest.fixture(scope="module")
def stack(tiny_dir, tmp_path_factory):
    procs = start_stack(tiny_dir, tmp_path_factory.mktemp("bf16"), target_args=["--dtype", "bfloat16"],
                        draft_args=["--dtype", "bfloat16"])
    yield procs["coordinator"].address
    stop_stack(procs)


def _run(address: str, prompts: list[list[int]], k: int, together: bool) -> list[list[int]]:
    def one(prompt: list[int]) -> list[int]:
        with TandemClient(address, timeout=120) as client:
            return client.generate(prompt_ids=prompt, max_new_tokens=NEW_TOKENS, num_draft_tokens=k,
                                   ignore_eos=True).token_ids

    if not together:
        return [one(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


@pytest.mark.slow
def test_bfloat16_eagle3_agrees_with_target_only_as_well_as_target_only_agrees_with_itself_batched(stack, hf_target):
    prompts = _prompts(hf_target.config.vocab_size)
    alone = _run(stack, prompts, 0, together=False)
    batched = _run(stack, prompts, 0, together=True)
    floor = agreement(alone, batched)
    assert all(len(out) == NEW_TOKENS for out in alone)
    for together in (False, True):
        eagle = _run(stack, prompts, 4, together)
        assert agreement(eagle, alone) >= floor, (together, agreement(eagle, alone), floor)
