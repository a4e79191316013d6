"""Shared fixtures: the tiny target + draft pair, built once per test session in the real formats."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandem_tools.tiny import make_tiny

# The tiny pair's head is random (no draft is ever accepted), so the coordinator's acceptance gate would
# soon stop drafting, and the tests of what drafting does would test target-only decoding; and adaptive K's
# default budget (24 tokens a round) cuts K at 4 generations and more, where the tests compare what concurrent
# requests get with a fixed K's. A budget of 0 turns both off: every round drafts the request's K. The tests
# pin it; tests/test_batching.py runs the gate and a budget where they are the subject. Services started by
# tests inherit this.
os.environ.setdefault("TANDEM_COORDINATOR_SPEC_TOKEN_BUDGET", "0")
# The native target's forward runs eagerly in tests (a compile costs ~20 s a bucket on this CPU);
# tests/test_native.py compiles one engine of its own.
os.environ.setdefault("TANDEM_COMPILE", "0")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def generator(tiny_dir):
    """Both engines of the tiny pair in this process (tandem_tools.inprocess), one per test module."""
    from tandem_tools.inprocess import InProcessGenerator

    # the tiny head is random: the acceptance gate would shut at once (its cost set to 0, as for the
    # coordinator above), and the tests of drafting need drafts
    return InProcessGenerator(tiny_dir / "target", tiny_dir / "draft", draft_cost=0)


@pytest.fixture(scope="module")
def hf_target(tiny_dir):
    """The tiny target as plain transformers loads it: the reference for greedy output."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir / "target").eval()


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """The tiny models are latency-bound: one thread avoids OpenMP spin contention on a 2-core machine
    (5x faster here when other processes are busy). Subprocesses set their own."""
    import torch

    torch.set_num_threads(1)
