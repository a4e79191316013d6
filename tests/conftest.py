"""Shared fixtures: the tiny target + draft pair, built once per test session in the real formats."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.tiny import make_tiny


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny"))
