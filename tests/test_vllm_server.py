"""`tandem bench --peer vllm-server` (tandem_tools/bench/vllm_server.py): vLLM's OpenAI server started from
its venv, driven by the bench's clients with streamed completions, its per-request acceptance read into the
bench's outcomes. A stand-in server speaks the protocol here (the real one compiles for ~100 s a start)."""

from __future__ import annotations

import json

import pytest
from test_vllm_peer import bench_args, fake_python

from tandem_tools.bench.runners import EAGLE3
from tandem_tools.bench.schedule import BenchConfig, Case, run_bench
from tandem_tools.bench.table import markdown_table
from tandem_tools.bench.vllm_peer import VllmError
from tandem_tools.bench.vllm_server import VLLM_SERVER, outcome_of, serve_command

# a stand-in for `vllm serve`: /health, and streamed /v1/completions with made-up drafts; it logs its argv
# and each request's body
FAKE_SERVER = """
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
if len(sys.argv) < 3:  # the import check
    sys.exit(0)
argv = sys.argv[1:]
log = os.environ["FAKE_VLLM_LOG"]
with open(log, "a") as f:
    f.write(json.dumps({"argv": argv}) + "\\n")
if os.environ.get("FAKE_VLLM_FAIL_HEAD") and "--speculative-config" in argv:
    sys.exit("ValueError: the head is not EAGLE-3")
spec = json.loads(argv[argv.index("--speculative-config") + 1]) if "--speculative-config" in argv else None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(log, "a") as f:
            f.write(json.dumps(body) + "\\n")
        n = body["max_tokens"]
        chunks = [{"choices": [{"index": 0, "text": "x"}]} for _ in range(n)]
        usage = {"choices": [], "usage": {"completion_tokens": n}}
        if spec is not None:
            k = spec["num_speculative_tokens"]
            histogram = [0] * (k + 1)
            histogram[1] = 2  # two verify steps, one draft accepted in each
            usage["metrics"] = {"speculative_decoding": {
                "acceptance_histogram": histogram, "num_spec_steps": 2, "num_accepted_draft_tokens": 2,
                "num_draft_tokens": 2 * k}}
        data = "".join(f"data: {json.dumps(c)}\\n\\n" for c in chunks + [usage]) + "data: [DONE]\\n\\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data.encode())


ThreadingHTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), Handler).serve_forever()
"""


def test_peer_takes_vllm_its_server_or_both():
    assert bench_args("--peer", "vllm-server").peer == ["vllm-server"]
    assert bench_args("--peer", "vllm,vllm-server").peer == ["vllm", "vllm-server"]
    assert bench_args().peer == []
    with pytest.raises(SystemExit):
        bench_args("--peer", "vllm,sglang")


def test_serve_command_starts_vllm_on_tandems_checkpoints_with_per_request_acceptance(tmp_path):
    plain = serve_command(tmp_path / "py", tmp_path / "target", None, 0, 8123, 100)
    assert plain[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", str(tmp_path / "target")]
    assert "--speculative-config" not in plain and "--no-enable-prefix-caching" in plain
    assert plain[plain.index("--dtype") + 1] == "float32" and plain[plain.index("--max-model-len") + 1] == "100"
    assert "--per-request-spec-decode-metrics" not in plain  # vLLM refuses it without speculative decoding
    eagle = serve_command(tmp_path / "py", tmp_path / "target", tmp_path / "head", 5, 8123, 100)
    assert eagle[eagle.index("--per-request-spec-decode-metrics") + 1] == "summary"
    assert json.loads(eagle[eagle.index("--speculative-config") + 1]) == {
        "method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": 5}


def test_a_completions_chunks_give_the_outcome_as_vllm_counts_its_acceptance():
    spec = {"acceptance_histogram": [3, 1, 0, 2], "num_spec_steps": 6, "num_accepted_draft_tokens": 7,
            "num_draft_tokens": 18}
    chunks = [{"choices": [{"text": "a"}]}, {"choices": [], "usage": {"completion_tokens": 13},
                                             "metrics": {"speculative_decoding": spec}}]
    outcome = outcome_of(chunks, 13)
    assert (outcome.tokens, outcome.rounds, outcome.accepted, outcome.drafted) == (13, 6, 7, 18)
    assert outcome.per_position == [3, 2, 2]  # steps that accepted draft 1, 2, 3
    case = Case(VLLM_SERVER, EAGLE3, 3, 0.0, 1, seconds=1.0, outcomes=[outcome])
    assert case.result()["mean_acceptance_length"] == pytest.approx(1 + 7 / 6, abs=1e-3)
    plain = outcome_of([{"choices": [], "usage": {"completion_tokens": 4}}], 4)
    assert (plain.rounds, plain.accepted) == (4, 0)
    with pytest.raises(VllmError, match="generated 3 tokens where 4 were asked"):
        outcome_of([{"usage": {"completion_tokens": 3}}], 4)
    with pytest.raises(VllmError, match="server: boom"):
        outcome_of([{"error": "boom"}], 4)


def test_vllm_server_cases_run_through_the_bench_clients_block_by_block(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_LOG", str(tmp_path / "asked.jsonl"))
    monkeypatch.setattr("tandem_tools.bench.vllm_server.VllmServerPeer.spin_s", 0.0)
    config = BenchConfig(target=tmp_path / "target", draft=tmp_path / "head", prompts=[[1, 2, 3], [4, 5]], stacks=[],
                         num_draft_tokens=[2], temperatures=[0.0], concurrency=[1, 2], max_new_tokens=4,
                         vllm_python=fake_python(tmp_path, FAKE_SERVER), vllm_peers=[VLLM_SERVER])
    lines = []
    runs = run_bench(config, tmp_path / "out", echo=lines.append)
    assert [(r["stack"], r["mode"], r["K"], r["concurrency"]) for r in runs] == [
        (VLLM_SERVER, "target-only", 0, 1), (VLLM_SERVER, "eagle3", 2, 1),
        (VLLM_SERVER, "target-only", 0, 2), (VLLM_SERVER, "eagle3", 2, 2)]
    by = {(r["mode"], r["concurrency"]): r for r in runs}
    assert all(r["generated_tokens"] == r["num_prompts"] * 4 and r["tokens_per_s"] > 0 for r in runs)
    assert by["eagle3", 2]["mean_acceptance_length"] == 2.0 and by["eagle3", 2]["accepted_per_position"] == [1.0, 0.0]
    assert by["target-only", 1]["mean_acceptance_length"] == 1.0
    assert "| vllm-server | eagle3 | 2 | 0 | 2 | off |" in markdown_table(runs)
    asked = [json.loads(line) for line in (tmp_path / "asked.jsonl").read_text().splitlines()]
    starts = [a["argv"] for a in asked if "argv" in a]
    assert len(starts) == 2 and "--speculative-config" not in starts[0] and "--speculative-config" in starts[1]
    bodies = [a for a in asked if "prompt" in a]
    assert {tuple(b["prompt"]) for b in bodies} == {(1, 2, 3), (4, 5)}  # token ids, as Tandem's clients send
    assert all(b["ignore_eos"] and b["stream"] and b["stream_options"]["include_usage"] for b in bodies)
    assert any("vLLM's server eagle3-k2 ready on http://127.0.0.1:" in line for line in lines)


def test_an_eagle3_server_that_fails_to_start_leaves_vllms_plain_decoding_in_the_bench(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_LOG", str(tmp_path / "asked.jsonl"))
    monkeypatch.setenv("FAKE_VLLM_FAIL_HEAD", "1")
    monkeypatch.setattr("tandem_tools.bench.vllm_server.VllmServerPeer.spin_s", 0.0)
    config = BenchConfig(target=tmp_path / "target", draft=tmp_path / "head", prompts=[[1, 2, 3]], stacks=[],
                         num_draft_tokens=[2], temperatures=[0.0], concurrency=[1], max_new_tokens=4,
                         vllm_python=fake_python(tmp_path, FAKE_SERVER), vllm_peers=[VLLM_SERVER])
    lines = []
    runs = run_bench(config, tmp_path / "out", echo=lines.append)
    assert [(r["stack"], r["mode"]) for r in runs] == [(VLLM_SERVER, "target-only")]
    skipped = [line for line in lines if line.startswith("bench: vLLM's server eagle3-k2 skipped")]
    assert skipped and "the head is not EAGLE-3" in skipped[0]


def test_a_missing_venv_skips_vllms_server_with_one_line(tiny_dir, tmp_path, capsys):
    from tandem_tools.cli import main

    assert main(["bench", "--target", str(tiny_dir / "target"), "--draft", str(tiny_dir / "draft"), "--stack",
                 "in-process", "-k", "1", "--temperature", "0", "-n", "1", "--max-new-tokens", "4", "--peer",
                 "vllm-server", "--vllm-python", str(tmp_path / "nowhere"), "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert err.count("bench: vLLM's server skipped:") == 1 and "| vllm-server |" not in out
