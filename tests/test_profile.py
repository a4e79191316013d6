"""`tandem profile` end to end: it starts the three processes itself, and what it reports crossing the
links is what must cross — features of every position, token ids of every token — as counted by each
service at its own send site too; trace.json and traffic.png are real."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.defaults import DRAFT_Q_TOP_N
from tandem.params import GenerationRequest
from tandem.traffic import ids_size, varint_size
from tandem_tools.inprocess import InProcessGenerator

PROMPTS = [{"prompt": "def main("}, {"prompt_ids": [5, 17, 99, 3, 250, 8, 41]}, {"prompt": "class Foo:\n    def "},
           {"prompt_ids": list(range(2, 40))}]
MAX_NEW, K = 20, 3
LINKS = ("coordinator->target", "target->coordinator", "coordinator->draft", "draft->coordinator")


@pytest.fixture(scope="module")
def run(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    proc = subprocess.run(
        [sys.executable, "-m", "tandem_tools.cli", "profile", "--target", str(tiny_dir / "target"),
         "--draft", str(tiny_dir / "draft"), "--prompts", str(prompts), "--num-requests", "4", "--concurrency", "2",
         "--max-new-tokens", str(MAX_NEW), "--num-draft-tokens", str(K), "--ignore-eos", "--transport", "grpc",
         "--out", str(out / "run")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    report = json.loads((out / "run" / "report.json").read_text())
    return out / "run", report, proc.stdout


@pytest.fixture(scope="module")
def reference(tiny_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    generator = InProcessGenerator(tiny_dir / "target", tiny_dir / "draft", draft_cost=0)
    expected = []
    for p in PROMPTS:
        ids = p.get("prompt_ids") or generator.tokenizer(p["prompt"])["input_ids"]
        result = generator.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=MAX_NEW, num_draft_tokens=K,
                                                      ignore_eos=True))
        expected.append((ids, result.token_ids))
    torch.set_num_threads(threads)
    return generator, expected


def test_profile_writes_a_report_with_the_documented_fields(run):
    _, report, _ = run
    assert {"links", "totals", "latency", "acceptance", "transport"} <= set(report)
    for link in LINKS:
        entry = report["links"][link]
        assert {"bytes", "messages", "by_kind"} <= set(entry)
        assert {"features", "token_ids", "control"} <= set(entry["by_kind"])
        assert entry["bytes"] == sum(entry["by_kind"].values()) and entry["messages"] > 0
    assert "target->draft" in report["links"]  # the fast-path link, empty over gRPC
    totals = report["totals"]
    assert totals["requests"] == totals["completed"] == 4 and totals["generated_tokens"] == 4 * MAX_NEW
    assert totals["rounds"] == sum(r["num_rounds"] for r in report["requests"]) > 0
    stages = report["latency"]["stages"]
    assert set(stages) == {"target_compute", "draft_compute", "transport", "coordinator", "queueing"}
    assert stages["target_compute"] > 0 and stages["draft_compute"] > 0 and stages["transport"] > 0
    for request in report["requests"]:  # every round's stages add up to its wall time
        for r in request["rounds"]:
            assert sum(r["stages_ms"].values()) == pytest.approx(r["wall_ms"], abs=1e-6)
    acceptance = report["acceptance"]
    assert len(acceptance["accepted_per_position"]) == K
    assert acceptance["mean_acceptance_length"] == pytest.approx(
        1 + acceptance["num_accepted_tokens"] / totals["rounds"])
    assert report["transport"]["name"] == "grpc"
    draft = report["draft"]  # the draft's time per round, with the kind of head it drafted with
    assert draft["head"] == "eagle3, 1 layer" and draft["proposes"] > 0 and draft["compute_ms_per_propose"] > 0


def test_feature_bytes_on_the_target_link_are_positions_times_3h_times_dtype_size(run, reference):
    _, report, _ = run
    generator, expected = reference
    row = 3 * generator.target.hidden_size * 4  # float32
    assert report["transport"]["feature_row_bytes"] == row
    total = 0
    for request, (prompt, generated) in zip(report["requests"], expected, strict=True):
        # F of every prompt position, then F of t, d_1..d_a each round: every committed token but the last
        positions = len(prompt) + len(generated) - 1
        features = sum(r["bytes"].get("target->coordinator", 0) for r in request["rounds"])
        assert features > positions * row  # the rest is control
        total += positions * row
        assert request["prompt_tokens"] == len(prompt)
    assert report["links"]["target->coordinator"]["by_kind"]["features"] == total
    assert report["links"]["target->coordinator"]["feature_rows"] == total // row
    # the draft gets the same features, except the last verify's (the generation ended): at most K+1 rows each
    relayed = report["links"]["coordinator->draft"]["by_kind"]["features"]
    assert total - 4 * (K + 1) * row <= relayed < total
    prompt_tokens = sum(len(p) for p, _ in expected)
    assert report["totals"]["prompt_tokens"] == prompt_tokens


def test_token_id_bytes_match_the_tokens_that_crossed(run, reference):
    _, report, _ = run
    _, expected = reference
    back_bytes = back_count = 0
    for request, (prompt, generated) in zip(report["requests"], expected, strict=True):
        # target -> coordinator: t (a singular field), then per round the accepted (packed) and the bonus
        tokens = iter(generated)
        for r in request["rounds"]:
            accepted = [next(tokens) for _ in range(r["num_accepted"])]
            last = next(tokens)
            back_bytes += ids_size(accepted) + (varint_size(last) if last else 0)
            back_count += len(accepted) + 1
        assert next(tokens, None) is None
    link = report["links"]["target->coordinator"]
    assert (link["token_ids"], link["by_kind"]["token_ids"]) == (back_count, back_bytes)
    assert back_count == 4 * MAX_NEW
    # the prompt crosses once, to the target: its ids in the prefill
    to_target = report["links"]["coordinator->target"]
    prompts = sum(ids_size(p) for p, _ in expected)
    drafts = report["acceptance"]["num_draft_tokens"]
    verify_tokens = report["totals"]["rounds"] + drafts  # t and d_1..d_k per verify
    assert to_target["token_ids"] == sum(len(p) for p, _ in expected) + verify_tokens
    assert to_target["by_kind"]["token_ids"] >= prompts + verify_tokens - report["totals"]["rounds"]
    draft_back = report["links"]["draft->coordinator"]
    assert draft_back["token_ids"] == drafts


def test_every_service_counted_the_same_bytes_at_its_send_site(run):
    _, report, _ = run
    send_site = report["transport"]["send_site"]
    for link in LINKS:
        for kind in ("features", "token_ids"):
            assert send_site[link][kind] == report["links"][link]["by_kind"][kind], (link, kind)


def test_trace_is_chrome_trace_json_with_events_from_all_three_processes(run):
    out, report, _ = run
    trace = json.loads((out / "trace.json").read_text())
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {"coordinator", "target", "draft"} <= set(names.values())
    pid = {name: p for p, name in names.items()}
    for e in events:
        assert e["ph"] in {"X", "M", "s", "f", "i"}
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
    slices = [e for e in events if e["ph"] == "X"]
    for process in ("coordinator", "target", "draft"):
        assert any(e["pid"] == pid[process] for e in slices), process
    rounds = [e for e in slices if e["pid"] == pid["coordinator"] and e["name"].startswith("round ")]
    assert len(rounds) == report["totals"]["rounds"]
    # each service step sits inside the coordinator's round trip for it (one timeline)
    verify = {(e["tid"], e["ts"]): e for e in slices if e["pid"] == pid["coordinator"] and e["name"] == "verify"}
    served = [e for e in slices if e["pid"] == pid["target"] and e["name"] == "verify"]
    assert len(served) == len(verify)
    for e in served:
        outer = [v for (tid, ts), v in verify.items() if tid == e["tid"] and ts <= e["ts"]
                 and e["ts"] + e["dur"] <= ts + v["dur"] + 1e-3]
        assert len(outer) == 1, e
    flows = [e for e in events if e["ph"] in "sf"]
    assert {e["pid"] for e in flows} >= {pid["coordinator"], pid["target"], pid["draft"]}


def test_traffic_png_is_a_plot(run):
    out, _, _ = run
    data = (out / "traffic.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 1200 and height >= 800
    assert len(data) > 50_000  # bars, labels and text, not an empty canvas


def test_the_summary_table_is_printed(run):
    out, report, stdout = run
    assert "B/token" in stdout and "time share" in stdout
    line = next(line for line in stdout.splitlines() if line.startswith("target->coordinator"))
    assert f"{report['links']['target->coordinator']['bytes_per_token']:.1f}" in line
    assert "target_compute" in stdout and "transport" in stdout
    assert f"draft (eagle3, 1 layer): {report['draft']['compute_ms_per_propose']:.2f} ms" in stdout
    assert str(out / "trace.json") in stdout
    assert Path(out / "report.json").is_file()
    assert report["grammar"]["constrained_requests"] == 0 and "grammar:" not in stdout


def test_sampled_drafts_send_their_q_and_the_report_counts_it_per_round(tiny_dir, tmp_path):
    """Speculative sampling: every sampled draft's q crosses draft -> coordinator and is relayed to the
    target, counted as draft_probs at both ends, and the report gives its bytes per drafted round."""
    proc = subprocess.run(
        [sys.executable, "-m", "tandem_tools.cli", "profile", "--target", str(tiny_dir / "target"),
         "--draft", str(tiny_dir / "draft"), "--num-requests", "2", "--concurrency", "1", "--temperature", "1",
         "--seed", "3", "--max-new-tokens", "12", "--num-draft-tokens", str(K), "--ignore-eos",
         "--out", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    links, q = report["links"], report["draft_probs"]
    assert q["bytes"] == links["draft->coordinator"]["by_kind"]["draft_probs"] > 0
    assert q["relayed_to_target_bytes"] == links["coordinator->target"]["by_kind"]["draft_probs"] == q["bytes"]
    assert report["transport"]["send_site"]["draft->coordinator"]["draft_probs"] == q["bytes"]
    drafted = sum(r["num_drafts"] > 0 for request in report["requests"] for r in request["rounds"][1:])
    assert q["drafted_rounds"] == drafted and q["bytes_per_round"] == pytest.approx(q["bytes"] / drafted)
    assert 5 <= q["bytes_per_draft"] <= DRAFT_Q_TOP_N * (3 + 4)  # per support token: an id varint, a float
    assert "q (sampled drafts' distributions)" in proc.stdout


def test_a_constrained_workload_reports_the_grammars_cost_per_round(tiny_dir, tmp_path):
    """--grammar constrains every request: the report gives the coordinator's mask time per round, its share
    of round time, and the drafts the grammar cut or forced, and the summary prints it in one line."""
    proc = subprocess.run(
        [sys.executable, "-m", "tandem_tools.cli", "profile", "--target", str(tiny_dir / "target"),
         "--draft", str(tiny_dir / "draft"), "--num-requests", "2", "--concurrency", "1", "--max-new-tokens", "12",
         "--num-draft-tokens", str(K), "--grammar", "json_object", "--out", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    grammar = report["grammar"]
    assert grammar["constrained_requests"] == 2 and grammar["rounds"] == report["totals"]["rounds"]
    assert grammar["mask_ms_per_round"] > 0 and 0 < grammar["share_of_round_time"] < 1
    assert grammar["cuts_per_round"] > 0  # the tiny head drafts free text, which JSON cuts
    line = next(line for line in proc.stdout.splitlines() if line.startswith("grammar:"))
    assert f"{grammar['mask_ms_per_round']:.2f} ms of masks per round" in line


def test_the_grammar_flag_reads_each_kind():
    import argparse

    from tandem_tools.cli import _grammar

    assert _grammar("json_object").kind == "json_object"
    assert json.loads(_grammar("choice:red,green").value) == ["red", "green"]
    assert _grammar("regex:[a-z]+:x").value == "[a-z]+:x"
    for bad in ("yaml", "json_object:x", "regex:", "json_schema:/no/such/file"):
        with pytest.raises(argparse.ArgumentTypeError):
            _grammar(bad)
