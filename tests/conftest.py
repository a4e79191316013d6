"""Shared fixtures: the tiny target + draft pair, built once per test session in the real formats."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.tiny import make_tiny


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """The tiny models are latency-bound: one thread avoids OpenMP spin contention on a 2-core machine
    (5x faster here when other processes are busy). Subprocesses set their own."""
    import torch

    torch.set_num_threads(1)
