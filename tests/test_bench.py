"""`tandem bench` and the demo pair, fast: the bench on the tiny pair (both stacks, the assisted-generation
peer) writes the documented JSON and a plot; a demo built small through the same code as `tandem demo build`
has its files, held-out prompts, and a head the draft service loads from its files alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from draft_server.engine import DraftEngine
from tandem.params import GenerationRequest
from tandem_tools.bench.runners import _accepted_per_position
from tandem_tools.cli import main
from tandem_tools.demo import DemoSpec, build_demo, load_prompts, split_files, stdlib_files
from tandem_tools.inprocess import InProcessGenerator

RUN_KEYS = {"stack", "mode", "K", "temperature", "concurrency", "overlap", "tokens_per_s", "mean_acceptance_length",
            "accepted_per_position"}
# docs/architecture.md, "EAGLE-3 draft, reference layout"
REFERENCE_KEYS = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")),
}
# a demo small enough for the test suite: seconds, not minutes
SMALL = DemoSpec(
    train_bytes=150_000, vocab_size=384, hidden_size=64, intermediate_size=176, num_heads=4, num_kv_heads=2,
    target_steps=4, target_batch=4, seq_len=64, assistant_hidden_size=64, assistant_steps=4, head_steps=3,
    head_sequences=16, head_seq_len=32, head_batch=8, draft_vocab_size=256, num_prompts=3, prompt_tokens=16,
    threads=1,
)


def check_runs(runs: list[dict], stacks: set[str], ks: list[int], temperatures: list[float], peer: bool,
               peagle: bool = False) -> None:
    for run in runs:
        assert RUN_KEYS <= set(run), run
        assert run["stack"] in ("services", "in-process")
        assert run["mode"] in ("target-only", "eagle3", "assisted-peer", "p-eagle")
        # overlap as each stack runs by default: on through the services, off in-process (one device)
        assert run["overlap"] is (run["mode"] in ("eagle3", "p-eagle") and run["stack"] == "services")
        assert run["concurrency"] == 1
        if run["stack"] == "services" and run["mode"] in ("eagle3", "p-eagle"):  # the draft's time by head kind
            assert run["head"].startswith("eagle3" if run["mode"] == "eagle3" else "p-eagle")
            assert run["draft_ms_per_round"] > 0
        assert run["tokens_per_s"] > 0
        if run["mode"] == "target-only":
            assert run["K"] == 0 and run["mean_acceptance_length"] == 1.0 and run["accepted_per_position"] == []
        else:
            assert run["K"] in ks and len(run["accepted_per_position"]) == run["K"]
            assert all(0.0 <= p <= 1.0 for p in run["accepted_per_position"])
            assert 1.0 <= run["mean_acceptance_length"] <= run["K"] + 1
            # each accepted draft was accepted at its position: the two counts agree
            assert run["mean_acceptance_length"] == pytest.approx(1 + sum(run["accepted_per_position"]), abs=1e-3)
    seen = {(r["stack"], r["mode"], r["K"], r["temperature"]) for r in runs}
    expected = {(s, "target-only", 0, t) for s in stacks for t in temperatures}
    expected |= {(s, "eagle3", k, t) for s in stacks for k in ks for t in temperatures}
    if peer:
        expected |= {("in-process", "assisted-peer", k, t) for k in ks for t in temperatures}
    if peagle:
        expected |= {("services", "p-eagle", k, t) for k in ks for t in temperatures}
    assert seen == expected


def test_bench_on_tiny_pair_writes_runs_json_and_plot(tiny_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    # the target as its own assistant: a peer whose every confident draft is right
    code = main(["bench", "--target", str(tiny_dir / "target"), "--draft", str(tiny_dir / "draft"),
                 "--assistant", str(tiny_dir / "target"), "--stack", "services,in-process", "-k", "1,3",
                 "--temperature", "0,1", "--num-prompts", "2", "--max-new-tokens", "8", "--json", str(out),
                 "--out", str(tmp_path)])
    assert code == 0
    runs = json.loads(out.read_text())["runs"]
    check_runs(runs, {"services", "in-process"}, [1, 3], [0.0, 1.0], peer=True)
    assert out.with_suffix(".png").stat().st_size > 10_000
    table = capsys.readouterr().out
    assert table.count("\n| services |") == 6 and "| in-process | assisted-peer | 3 | 0 |" in table
    # greedy decoding is the target's on every stack: the same acceptance through the services and in-process
    by = {(r["stack"], r["mode"], r["K"], r["temperature"]): r for r in runs}
    for k in (1, 3):
        assert by["services", "eagle3", k, 0.0]["accepted_per_position"] == by["in-process", "eagle3", k, 0.0][
            "accepted_per_position"]
    assert by["in-process", "assisted-peer", 1, 0.0]["mean_acceptance_length"] > 1.5
    # accepted / verified drafts, ours from the stats, the peer's from its target forwards' lengths
    peer = by["in-process", "assisted-peer", 1, 0.0]
    assert peer["acceptance_per_draft"] == pytest.approx(peer["mean_acceptance_length"] - 1, abs=0.15)
    assert all(0 <= r["acceptance_per_draft"] <= 1 for r in runs if r["acceptance_per_draft"] is not None)


def test_peer_acceptance_is_read_from_where_each_target_forward_starts():
    # prompt of 10; rounds start with 0, 12, 13, 16 tokens in the KV; 8 new tokens in all
    forwards = [(13, 0), (4, 12), (4, 13), (4, 16)]
    # accepted: 12-10 = 2, 13-12-1 = 0, 16-13-1 = 2, (10+8-1)-16-1 = 0
    assert _accepted_per_position(forwards, 10, 8, 3) == [2, 2, 0]


@pytest.fixture(scope="module")
def small_demo(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    build_demo(cache / "demo", SMALL, progress=False)
    return cache


def test_small_demo_has_its_models_and_held_out_prompts(small_demo):
    demo = small_demo / "demo"
    info = json.loads((demo / "build.json").read_text())
    _, heldout = split_files(stdlib_files(), SMALL.heldout_every)
    prompts = load_prompts(demo)
    assert len(prompts) == SMALL.num_prompts
    assert {p["file"] for p in prompts} <= {f.name for f in heldout} == set(info["heldout_files"])
    assert all(len(p["prompt_ids"]) == SMALL.prompt_tokens for p in prompts)
    assert (demo / "target" / "tokenizer.json").read_text() == (demo / "assistant" / "tokenizer.json").read_text()
    # the head is lossless with the target it was trained for
    generator, target_only = InProcessGenerator(demo / "target", demo / "draft"), InProcessGenerator(demo / "target")
    request = GenerationRequest(prompt_ids=prompts[0]["prompt_ids"], max_new_tokens=12, num_draft_tokens=3,
                                ignore_eos=True)
    assert generator.generate(request).token_ids == target_only.generate(request).token_ids


def test_demo_head_is_in_the_reference_layout_and_the_draft_service_loads_it(small_demo, tmp_path, monkeypatch):
    head = small_demo / "demo" / "draft"
    assert {p.name for p in head.iterdir()} == {"config.json", "model.safetensors"}
    with safe_open(head / "model.safetensors", framework="pt") as f:
        assert set(f.keys()) == REFERENCE_KEYS  # no embed_tokens: the target's is read
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    config = json.loads((head / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == SMALL.draft_vocab_size
    assert config["target_hidden_size"] == SMALL.hidden_size and "speculators_model_type" not in config
    assert DraftEngine(head, small_demo / "demo" / "target").layout == "reference"
    # `bench --demo` through the services: the draft service loads the head from its files
    monkeypatch.setenv("TANDEM_CACHE", str(small_demo))
    out = tmp_path / "demo.json"
    assert main(["bench", "--demo", "--stack", "services", "-k", "2", "--temperature", "0", "-n", "2",
                 "--max-new-tokens", "6", "--json", str(out), "--out", str(tmp_path)]) == 0
    # and the demo's P-EAGLE head beside it, through services of its own
    assert DraftEngine(small_demo / "demo" / "draft-peagle", small_demo / "demo" / "target").config.kind == \
        f"p-eagle, {SMALL.peagle_layers} layer, {SMALL.peagle_depths} depths"
    check_runs(json.loads(out.read_text())["runs"], {"services"}, [2], [0.0], peer=True, peagle=True)


def test_train_draft_is_a_tandem_subcommand(tiny_dir, tmp_path):
    data = tmp_path / "data.py"
    data.write_text("def add(a, b):\n    return a + b\n\n" * 30)
    assert main(["train-draft", "--target", str(tiny_dir / "target"), "--data", str(data), "--out",
                 str(tmp_path / "head"), "--steps", "2", "--ttt-steps", "2", "--seq-len", "32", "--quiet"]) == 0
    assert DraftEngine(tmp_path / "head", tiny_dir / "target").layout == "reference"


def test_a_call_waits_out_a_service_marked_down_and_no_other_error(monkeypatch):
    import grpc

    from coordinator.client import TandemError
    from tandem_tools.bench import runners

    monkeypatch.setattr(runners, "PATIENCE_POLL_S", 0.0)
    answers = [TandemError(grpc.StatusCode.UNAVAILABLE, "the target service is down"), "info"]
    lines: list[str] = []

    def call():
        if isinstance(answer := answers.pop(0), Exception):
            raise answer
        return answer

    assert runners.patiently(call, lines.append) == "info"  # (ServicesRunner.settle's server_info, too)
    assert answers == [] and lines == ["bench: the server is not ready (the target service is down); trying again ..."]
    with pytest.raises(TandemError, match="INVALID_ARGUMENT"):
        runners.patiently(lambda: (_ for _ in ()).throw(TandemError(grpc.StatusCode.INVALID_ARGUMENT, "bad")),
                            lines.append)
    with pytest.raises(TandemError, match="UNAVAILABLE"):  # not for ever
        runners.patiently(lambda: (_ for _ in ()).throw(TandemError(grpc.StatusCode.UNAVAILABLE, "down")),
                            lines.append, patience=0.0)


def test_the_table_says_when_overlap_was_on_but_overlapped_nothing():
    from tandem_tools.bench.table import _overlap_cell

    assert _overlap_cell({"overlap": False, "temperature": 0.0}) == "off"
    assert _overlap_cell({"overlap": True, "temperature": 0.0, "overlap_hit_rate": 0.69}) == "on (69%)"
    assert _overlap_cell({"overlap": True, "temperature": 1.0, "overlap_hit_rate": None}) == \
        "on (greedy only: none overlapped)"
    assert _overlap_cell({"overlap": True, "temperature": 0.0, "overlap_hit_rate": None}) == "on (none overlapped)"
