#!/usr/bin/env python3
"""Print the coordinator image's requirements: pyproject.toml's dependencies minus the model-only ones.

    python deploy/coordinator_requirements.py pyproject.toml > requirements.txt

The coordinator relays token ids and features and reads a tokenizer; it never imports torch or
loads weights. Its image installs `tandem` with --no-deps plus this list, so that a new light
dependency (grpc, pydantic, ...) reaches it without anyone editing a second list, while the heavy
ones stay out. tests/test_deploy.py builds that environment and checks that the coordinator, the
client and the health probe run in it without torch.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

# Only the target and draft services need these (and what they pull in, CUDA builds included).
MODEL_ONLY = frozenset({"torch", "transformers", "safetensors", "accelerate"})  # numpy stays: grammars


def requirement_name(spec: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", spec.strip(), maxsplit=1)[0].lower().replace("_", "-")


def coordinator_requirements(pyproject: Path) -> list[str]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if requirement_name(d) not in MODEL_ONLY]


def main(argv: list[str]) -> int:
    pyproject = Path(argv[1] if len(argv) > 1 else "pyproject.toml")
    print("\n".join(coordinator_requirements(pyproject)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
