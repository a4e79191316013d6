"""EAGLE-2 draft trees through the round loop and the services: greedy output is the target's own, sampled
output keeps the target's law, the tree gate picks the faster shape, and the tree's bytes are counted.

The engines' own tree tests are tests/test_tree_verify.py (the target's tree attention, path commit and
acceptance rule) and tests/test_tree_draft.py (the draft's dynamic tree)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import OracleDraft, SamplingOracleDraft
from test_speculative_sampling import ALPHA, POSITIONS, PROMPT, RUNS, SETTINGS, conditional_p_value

from tandem.config import CoordinatorSettings, load_settings
from tandem.convert import parents_from_pb, parents_to_pb
from tandem.gates import TreeGate
from tandem.params import GenerationRequest, SamplingParams, TreeParams, parse_tree
from tandem.policy import Speculation
from tandem.traffic import parts_of
from tandem.v1 import draft_pb2
from tandem_tools.inprocess import run_rounds

TREE = TreeParams(nodes=12, depth=4, top_k=3)
PROMPTS = [[5, 9, 33, 17], [101, 7, 64, 2, 250, 19, 3], [42], [8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8]]


def generate(target, draft, prompt: list[int], tree: TreeParams | None, speculation: Speculation | None = None,
             **sampling):
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=24, num_draft_tokens=3, ignore_eos=True,
                                sampling=SamplingParams(**sampling), tree=tree)
    tokens, event = [], None
    for event in run_rounds(target, draft, request, speculation=speculation or Speculation()):
        tokens += event.new_tokens
    return tokens, event.stats


@pytest.fixture(scope="module")
def greedy_reference(generator):
    return {tuple(p): generate(generator.target, None, p, None)[0] for p in PROMPTS}


@pytest.mark.parametrize("corrupt", [0.0, 0.4])
def test_greedy_trees_give_the_targets_tokens(generator, hf_target, greedy_reference, corrupt):
    """A tree of the target's top-k in a shuffled order: the accepted path runs through nodes anywhere in
    the tree (their KV moved into place), and the output is target-only's, alone and batched."""
    draft = OracleDraft(hf_target, corrupt=corrupt)

    def one(prompt):
        draft.expect(prompt[0])
        return generate(generator.target, draft, prompt, TREE)

    for prompt in PROMPTS:  # alone
        tokens, stats = one(prompt)
        assert tokens == greedy_reference[tuple(prompt)]
        assert stats.num_tree_rounds >= stats.num_rounds - 1 > 0  # the last round may have room for no draft
        assert stats.mean_acceptance_length > (3.0 if corrupt == 0 else 1.5)
    assert generator.target.num_sessions == 0


def test_greedy_trees_batched_with_chains(generator, hf_target, greedy_reference):
    """Tree and chain sessions verified in the same batches give each its own target-only tokens."""

    def one(i: int):
        draft = OracleDraft(hf_target, corrupt=0.3, seed=i)
        prompt = PROMPTS[i % len(PROMPTS)]
        draft.expect(prompt[0])
        return prompt, generate(generator.target, draft, prompt, TREE if i % 2 else None)[0]

    with ThreadPoolExecutor(8) as pool:
        for prompt, tokens in pool.map(one, range(16)):
            assert tokens == greedy_reference[tuple(prompt)]
    assert generator.target.num_sessions == 0


def test_the_real_draft_drafts_trees_in_process(generator, greedy_reference):
    """The draft engine's own trees (the tiny pair's random head: few accepted) end to end in-process."""
    for prompt in PROMPTS[:2]:
        tokens, stats = generate(generator.target, generator.draft, prompt, TreeParams(nodes=10, depth=3, top_k=4))
        assert tokens == greedy_reference[tuple(prompt)]
        assert stats.num_tree_rounds >= stats.num_rounds - 1 > 0  # the last round may have room for no draft
        assert stats.num_draft_tokens <= 10 * stats.num_tree_rounds


TREE_CASES = [("t1", "alone"), ("t0.7", "batched"), ("t0.7-top_k8-top_p0.9", "alone"), ("t1-top_k20-top_p0.8", "batched")]


@pytest.mark.parametrize("name, mode", TREE_CASES, ids=[f"{n}-{m}" for n, m in TREE_CASES])
def test_sampled_trees_keep_the_targets_law(generator, hf_target, name, mode):
    """Trees whose children are drawn from q without replacement, each with its q_j, as the draft engine
    draws them: each tried in draw order by min(1, p/q_j) with residual max(0, p - q_j)
    (target_server/acceptance.py), they sample the target's law: the same chi-square check as chains
    (tests/test_speculative_sampling.py), 3 positions a case, alone and batched."""
    params = SETTINGS[name]
    draft = SamplingOracleDraft(hf_target, PROMPT[0], top_n=8)
    tree = TreeParams(nodes=8, depth=2, top_k=3)

    def one(seed: int) -> tuple[int, ...]:
        request = GenerationRequest(prompt_ids=PROMPT, max_new_tokens=4, num_draft_tokens=2, ignore_eos=True,
                                    sampling=params.model_copy(update={"seed": seed}), tree=tree)
        return tuple(t for event in run_rounds(generator.target, draft, request) for t in event.new_tokens)

    if mode == "batched":
        with ThreadPoolExecutor(8) as pool:
            samples = list(pool.map(one, range(RUNS)))
    else:
        samples = [one(seed) for seed in range(RUNS)]
    p_values = {j: conditional_p_value(hf_target, params, samples, j) for j in POSITIONS}
    assert min(p_values.values()) > ALPHA, p_values


def test_the_tree_gate_runs_the_faster_shape():
    """Measured from pairs of a generation's rounds, a tree round next to a chain round: what a round commits
    depends on the text, and only pairs compare the shapes on the same text."""
    gate, choices, last = TreeGate(), [], None
    for i in range(2 * gate.MIN_ROUNDS + 1):  # measuring: the generation alternates
        tree = gate.use_tree(True, None if last is None else last[0])
        choices.append(tree)
        text = 3 if i % 4 < 2 else 1  # easy text, then hard: 3x the tokens a round
        # a tree commits 1.2x the chain's tokens in 1.5x its time: the chain is faster on any text
        committed, seconds = (1.2 * text, 0.015) if tree else (text, 0.010)
        gate.record(True, tree, committed, seconds, last)
        last = (tree, committed, seconds)
    assert choices[:4] == [True, False, True, False]
    runs = [gate.use_tree(True, False) for _ in range(10 * gate.EXPLORE_EVERY)]
    assert sum(runs) == 10  # the chain, and the tree one round in EXPLORE_EVERY
    assert gate.rate(False, True) is None  # sampled requests are measured apart
    before = gate.rate(True, False)
    gate.record(True, False, 6, 0.010, (False, 6, 0.010))  # two chain rounds: no pair, nothing counted
    gate.record(True, False, 6, 0.010)
    assert gate.rate(True, False) == before


def test_a_tree_request_keeps_its_tree_with_overlap_on(generator, hf_target, greedy_reference):
    """Overlap's ahead step drafts chains, and overlap is the servers' default: a tree request keeps its tree
    and drafts without overlap, and its tokens are the target's."""
    draft = OracleDraft(hf_target, corrupt=0.2)
    prompt = PROMPTS[1]
    draft.expect(prompt[0])
    tokens, stats = generate(generator.target, draft, prompt, TREE, Speculation(overlap=True))
    assert tokens == greedy_reference[tuple(prompt)]
    assert stats.num_tree_rounds > 0 and stats.num_overlap_rounds == 0


def test_tree_settings_name_what_is_wrong():
    assert parse_tree("16") == TreeParams(nodes=16)
    assert parse_tree("16,5,4") == TreeParams(nodes=16, depth=5, top_k=4)
    for bad, words in (("0", "tree nodes"), ("16,0", "tree depth"), ("a", "NODES[,DEPTH[,TOP_K]]"),
                       ("1,2,3,4", "NODES[,DEPTH[,TOP_K]]")):
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            parse_tree(bad)
    with pytest.raises(ValueError, match="--tree / TANDEM_COORDINATOR_TREE: tree nodes"):
        load_settings(CoordinatorSettings, target_addr="localhost:1", tree="99")


def test_the_cli_names_a_bad_tree(capsys):
    from tandem_tools.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--in-process", "--prompt-ids", "1", "--tree", "16,0"])
    assert "argument --tree: tree depth must be in [1, 16], got 0" in capsys.readouterr().err
    assert build_parser().parse_args(["bench", "--tree", "16,32"]).tree == [16, 32]


def test_the_trees_shape_crosses_as_one_byte_a_node():
    parents = [-1, -1, 0, 0, 1, 2]
    assert parents_from_pb(parents_to_pb(parents)) == parents
    response = draft_pb2.DraftResponse(drafts=[5, 6, 7, 8, 9, 10], parents=parents_to_pb(parents))
    kinds = parts_of(response).kinds(response.ByteSize())
    assert kinds["tree"] == len(parents)  # varints of 0..3
    assert kinds["control"] >= 0 and sum(kinds.values()) == response.ByteSize()


def test_under_load_a_tree_gives_way_to_the_chain():
    """A tree's verify is N+1 tokens wide for every session of the batch: past adaptive K's budget
    (n running x width), the round runs the chain."""
    from tandem.policy import KPolicy

    request = GenerationRequest(prompt_ids=[1], max_new_tokens=32, num_draft_tokens=3, tree=TreeParams(nodes=16))
    for running, tree in ((8, True), (16, False)):
        speculation = Speculation(fits=lambda width, n=running: n * width <= 256)
        policy = KPolicy(request, speculation, 32, has_draft=True)
        assert (policy.tree_for_round(3, 0) is not None) == tree


def test_a_wide_tree_is_verified_within_what_its_prefill_asked_for(generator):
    """A session holds its prompt and one verify's uncommitted tokens of the KV budget, and may grow to its
    prompt + max_new_tokens + that width: a chain's 17 unless its prefill says a tree's (verify_tokens, which
    the round loop sends for a tree request)."""
    from tandem.sessions import InvalidRequest

    target, greedy, wide = generator.target, SamplingParams(), list(range(-1, 39))  # a 40-node tree
    narrow = target.prefill("narrow", PROMPTS[0], greedy, False, max_new_tokens=8)
    with pytest.raises(InvalidRequest, match="its prefill asked for"):
        target.verify("narrow", narrow.token, [7] * 40, False, None, wide)
    roomy = target.prefill("roomy", PROMPTS[0], greedy, False, max_new_tokens=8, verify_tokens=41)
    assert target.sessions.get("narrow").reserved < len(PROMPTS[0]) + 41 <= target.sessions.get("roomy").reserved
    verdict = target.verify("roomy", roomy.token, [7] * 40, False, None, wide)
    assert verdict.accepted == [7] * len(verdict.accepted)
    for session in ("narrow", "roomy"):
        target.release(session)


def _bench(name: str):
    """bench/<name>.py as a module (the bench scripts are not a package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent.parent / "bench" / f"{name}.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_tree_acceptance_bench_measures_the_chain_and_each_tree(tiny_dir, tmp_path):
    """bench/tree_acceptance.py (the README's tree-against-chain rows), small, on the tiny pair."""
    import json

    bench = _bench("tree_acceptance")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS[:2]))
    out = tmp_path / "rows.json"
    assert bench.main(["--target", str(tiny_dir / "target"), "--draft", str(tiny_dir / "draft"), "--prompts",
                       str(prompts), "--max-new-tokens", "6", "--temperature", "0,1", "--nodes", "6", "--depth",
                       "3", "--top-k", "2", "--q-top-n", "0", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["temperature"], r["shape"]) for r in rows] == [
        (0.0, "chain K=3"), (0.0, "tree N=6 top-k 2"), (1.0, "chain K=3"), (1.0, "tree N=6 top-k 2")]
    assert all(r["mean_acceptance_length"] >= 1.0 for r in rows)
    assert rows[0]["over_chain"] == rows[2]["over_chain"] == 1.0
    # the sampled trees' draws, measured, and the most any tree of 6 nodes could commit with them
    [ceiling] = json.loads(out.read_text())["ceilings"]
    assert ceiling["temperature"] == 1.0 and ceiling["rates"] and ceiling["best_tree"] >= ceiling["chain"] >= 1.0
    # the ceiling itself: first draws alone make the chain; a second draw taken 0.3 of the time, one more node
    first = {(d, 0): 0.5 for d in (1, 2, 3)}
    assert bench.ceiling(first, 6, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert bench.ceiling({**first, (1, 1): 0.3}, 4, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.5 * 0.3)


def test_the_multidraft_bound_bench_bounds_every_rule_by_the_draws(tiny_dir, tmp_path):
    """bench/multidraft_bound.py (the README's bound on a sampled tree at temperature 1), small, on the tiny
    pair; and its parts on hand-made distributions."""
    import json

    import torch

    bench = _bench("multidraft_bound")
    # p = (0.5, 0.3, 0.2), q = (0.7, 0.2, 0.1): a first draw 0.8; rejected, it was token 0, and the second,
    # from (0, 2/3, 1/3) against the residual (0, 1/2, 1/2), is taken 1/2 + 1/3
    p, q = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    assert bench.sequential(p, q) == pytest.approx((0.8, 5 / 6))
    # without replacement, two draws of three tokens: P(x among them) = 1 - P(x is the one left)
    included = bench.inclusion(q, 3, 4000, torch.Generator().manual_seed(0))
    left = torch.tensor([0.2 * 0.1 / 0.9 + 0.1 * 0.2 / 0.8, 0.7 * 0.1 / 0.3 + 0.1 * 0.7 / 0.9,
                         0.7 * 0.2 / 0.3 + 0.2 * 0.7 / 0.8], dtype=torch.float64)
    assert included[0].tolist() == pytest.approx(q.tolist())
    assert included[1].tolist() == pytest.approx((1 - left).tolist(), abs=0.02)
    assert included[2].tolist() == pytest.approx([1.0, 1.0, 1.0], abs=0.02)
    assert bench.as_rates([0.5, 0.75], 2) == {(1, 0): 0.5, (2, 0): 0.5, (1, 1): 0.5, (2, 1): 0.5}

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS[:2]))
    out = tmp_path / "bound.json"
    assert bench.main(["--target", str(tiny_dir / "target"), "--draft", str(tiny_dir / "draft"), "--prompts",
                       str(prompts), "--max-new-tokens", "6", "--temperature", "1", "--draws", "3", "--nodes", "6",
                       "--depth", "3", "--samples", "16", "--json", str(out)]) == 0
    [row] = json.loads(out.read_text())
    assert row["verified_drafts"] > 0
    for bound in (row["bound_with_replacement"], row["bound_without_replacement"]):
        assert bound[0] == pytest.approx(row["first_draw"], abs=1e-3)  # one draw: the target's rule is optimal
        assert bound == sorted(bound) and bound[-1] <= 1.0
    # the rule never beats the bound for two draws
    assert row["first_draw"] + (1 - row["first_draw"]) * row["second_draw"] <= row["bound_without_replacement"][1] + 0.02
    assert row["best_tree"] >= row["chain"] >= 1.0
