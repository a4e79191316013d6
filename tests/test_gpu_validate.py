"""bench/gpu_validate.py's dry run: every stage of the GPU validation run at tiny shapes on the CPU, as one
call on the GPU machine runs them, with what it leaves under --out (one JSON line per item, the log, the
table) and inside the time CI gives it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_validation_dry_run_passes_every_stage_in_under_two_minutes(tmp_path):
    out = tmp_path / "out"
    begun = time.monotonic()
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_validate.py"), "--dry-run", "--out", str(out)],
                          check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - begun
    assert done.returncode == 0, done.stdout[-3000:] + (out / "validate.log").read_text()[-3000:]
    rows = [json.loads(line) for line in (out / "validate.jsonl").read_text().splitlines()]
    stages = {row["stage"] for row in rows}
    assert stages == {"versions", "pytest", "forward", "rollout", "transports", "services"}, stages
    assert not [row for row in rows if row["result"] == "FAIL"]
    items = {(row["stage"], row["item"]): row for row in rows}
    for n in (1, 6, 16, 96):
        assert items[("forward", f"eager {n} tokens")]["syncs"] <= 1
    assert items[("forward", "compiled 1 tokens")]["result"] == "PASS"
    assert items[("services", "EAGLE-3 K=4 at 1")]["result"] == "PASS"
    assert "| forward | eager 1 tokens | PASS |" in (out / "table.md").read_text()
    assert (out / "validate.log").stat().st_size > 0
    assert wall < 120, f"the dry run took {wall:.0f} s"
