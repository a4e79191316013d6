"""Verifying an EAGLE-2 draft tree in one target forward (target_server/engine.py, paged.py, runners.py,
acceptance.py): every node sees the committed past and its own path only, the accepted path's KV is
committed at its positions (moved when it is not the first branch) and the rest hidden, chains, trees
and prefills share a batch, the sampled rule keeps the target's distribution, and bad trees are refused."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import torch
from helpers import chi_square_p
from test_native import hf_generate
from transformers import MistralConfig, MistralForCausalLM

from tandem.params import MAX_TREE_NODES, SamplingParams
from tandem.protocol import PrefillResult, VerifyResult, tree_depths
from tandem.sessions import InvalidRequest, ResourceExhausted
from tandem_tools.opcount import OpCounter
from target_server.acceptance import accept_tree, target_probs
from target_server.engine import TargetEngine
from target_server.native import load_native
from target_server.paged import PagedKVPool, Span, bucket, plan
from target_server.steps import Session, Step

GREEDY = SamplingParams()
PROMPT = [0, 17, 42, 99, 7, 230, 11, 64, 301, 5, 88]
# node i + 1 = draft i; the root's children 1, 2, 9; node 1's 3, 4; 5 under 3, 6 and 7 under 4, 8 under 7
PARENTS = [-1, -1, 0, 0, 2, 3, 3, 6, -1]


def path_to(parents: list[int], node: int) -> list[int]:
    """The nodes from the root's child down to `node` (node i + 1 = draft i), without the root."""
    path = []
    while node:
        path.append(node)
        node = parents[node - 1] + 1
    return path[::-1]


def draw(g: torch.Generator, vocab: int, taken: set[int]) -> int:
    """A random token not in `taken`."""
    while (token := int(torch.randint(2, vocab, (1,), generator=g))) in taken:
        pass
    return token


def random_tree(parents: list[int], seed: int, vocab: int) -> list[int]:
    """Tokens for the tree's drafts, siblings distinct."""
    g, drafts = torch.Generator().manual_seed(seed), []
    for i, parent in enumerate(parents):
        drafts.append(draw(g, vocab, {drafts[j] for j in range(i) if parents[j] == parent}))
    return drafts


def last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1]


@pytest.fixture(scope="module")
def engines(tiny_dir) -> dict[str, TargetEngine]:
    return {name: TargetEngine(tiny_dir / "target", engine=name) for name in ("native", "hf")}


@contextmanager
def kept_logits(engine: TargetEngine):
    """The logits of the runner's forwards, kept in a list."""
    seen, forward = [], engine.runner.forward

    def keep(steps, pool):
        logits, features = forward(steps, pool)
        seen.append(logits.clone())
        return logits, features

    engine.runner.forward = keep
    try:
        yield seen
    finally:
        del engine.runner.forward


@pytest.mark.parametrize("name", ["native", "hf"])
def test_each_node_sees_the_past_and_its_own_path(engines, hf_target, name):
    """Two tree verifies in a row: every node's logits equal transformers' over the committed tokens and
    that node's path; the second tree reads the first one's committed path (moved: not the first branch)."""
    engine = engines[name]
    assert engine.supports_trees
    token = engine.prefill("a", PROMPT, GREEDY).token
    context = [*PROMPT]
    for seed in (1, 2):
        drafts = random_tree(PARENTS, seed, engine.vocab_size)
        if seed == 1:  # the target's choice on the root's last child: the path moves from slot L+9 to L+1
            drafts[8] = int(last_logits(hf_target, [*context, token]).argmax())
        tokens = [token, *drafts]
        with kept_logits(engine) as seen:
            result = engine.verify("a", token, drafts, parents=PARENTS)
        logits = seen[0]
        assert logits.shape[0] == len(tokens)
        for node in range(len(tokens)):
            ids = [*context, token, *(tokens[i] for i in path_to(PARENTS, node))]
            torch.testing.assert_close(logits[node], last_logits(hf_target, ids), rtol=1e-4, atol=1e-4)
        if seed == 1:
            assert result.accepted[:1] == [drafts[8]]
        context += [token, *result.accepted]
        token = result.bonus
    assert engine.release("a")


@pytest.mark.parametrize("attention", ["dense", "flex"])
def test_the_flex_and_dense_masks_hide_siblings(tiny_dir, hf_target, attention):
    """The native model's forward over a prefill and a tree in one flattened batch (flex_attention's
    mask_mod run eagerly): each node's logits as transformers computes its path alone."""
    native = load_native(tiny_dir / "target", torch.device("cpu"), torch.float32, ())
    config = hf_target.config
    pool = PagedKVPool(native.num_layers, config.num_key_value_heads, native.head_dim, torch.float32,
                       torch.device("cpu"), blocks=4)
    blocks = [pool.allocate(2), pool.allocate(2)]
    drafts = random_tree(PARENTS, 3, config.vocab_size)
    ids = [*PROMPT, 5, *drafts]  # a prefill of PROMPT (owner 0), a tree at position 0 of owner 1 (root 5)
    spans = [Span(0, blocks[0], 0, len(PROMPT)), Span(1, blocks[1], 0, 1 + len(drafts), PARENTS)]
    width = bucket(len(ids))
    positions, batch = plan(spans, width, pool, dense=attention == "dense")
    assert positions[len(PROMPT):len(ids)].tolist() == [0, *tree_depths(PARENTS)]
    with torch.inference_mode():
        hidden, _ = native(torch.tensor(ids + [0] * (width - len(ids))), positions, batch)
        logits = native.lm_head(hidden)
    torch.testing.assert_close(logits[len(PROMPT) - 1], last_logits(hf_target, PROMPT), rtol=1e-4, atol=1e-4)
    tokens = [5, *drafts]
    for node in range(len(tokens)):
        expected = last_logits(hf_target, [tokens[i] for i in [0, *path_to(PARENTS, node)]])
        torch.testing.assert_close(logits[len(PROMPT) + node], expected, rtol=1e-4, atol=1e-4)


def greedy_tree(truth: list[int], seed: int, vocab: int, branch: int) -> tuple[list[int], list[int]]:
    """(parents, drafts): the target's continuation `truth` on the root's child number `branch` (decoy
    branches before it, each with a child), with a decoy sibling before each of its deeper tokens: the path
    is never at the slots after the root's."""
    g = torch.Generator().manual_seed(seed)
    parents: list[int] = []
    drafts: list[int] = []

    def add(parent: int, token: int) -> int:
        parents.append(parent)
        drafts.append(token)
        return len(drafts) - 1

    def decoy(parent: int, avoid: int) -> int:
        return draw(g, vocab, {avoid, *(d for d, p in zip(drafts, parents, strict=True) if p == parent)})

    for _ in range(branch):
        node = add(-1, decoy(-1, truth[0]))
        add(node, decoy(node, -1))
    parent = -1
    for depth, token in enumerate(truth):
        if depth:
            add(parent, decoy(parent, token))
        parent = add(parent, token)
    return parents, drafts


@pytest.mark.parametrize("name", ["native", "hf"])
def test_greedy_accepts_the_true_branch_and_generation_goes_on_as_target_only(engines, hf_target, name):
    """Rounds of trees (the target's own continuation on the first, second or third branch, so the path's
    rows move), chains with a wrong draft, and plain decodes: the output is transformers' greedy generate,
    so each committed path's KV was where its positions are and the tree's leftovers stayed hidden."""
    engine = engines[name]
    expected = hf_generate(hf_target, PROMPT, 48)
    token = engine.prefill("g", PROMPT, GREEDY, max_new_tokens=60).token
    out = [token]
    for round_ in range(12):
        truth = expected[len(out):len(out) + 3]
        if round_ % 3 == 2:  # a chain: one right, then a wrong draft
            result = engine.verify("g", token, [truth[0], (truth[1] + 1) % engine.vocab_size])
            assert result.accepted == truth[:1]
        else:
            parents, drafts = greedy_tree(truth, round_, engine.vocab_size, branch=round_ % 4)
            result = engine.verify("g", token, drafts, parents=parents)
            assert result.accepted == truth
        out += [*result.accepted, result.bonus]
        token = result.bonus
    for _ in range(3):
        token = engine.verify("g", token, []).bonus
        out.append(token)
    assert out == expected[:len(out)]
    engine.release("g")


def test_a_tree_forward_that_fails_before_its_commit_leaves_nothing_visible(engines, hf_target):
    """A tree's forward that runs out of memory in its last layer (every other layer's rows written, no
    commit): the session goes on with a chain and a shorter tree as target-only decoding does."""
    engine = engines["native"]
    expected = hf_generate(hf_target, PROMPT, 12)
    token = engine.prefill("f", PROMPT, GREEDY).token

    def oom(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    hook = engine.model.model.layers[-1].self_attn.register_forward_pre_hook(oom)
    with pytest.raises(ResourceExhausted):
        engine.verify("f", token, random_tree(PARENTS, 5, engine.vocab_size), parents=PARENTS)
    hook.remove()
    out = [token]
    result = engine.verify("f", token, [expected[1], 2])  # positions up to the failed tree's deepest
    out += [*result.accepted, result.bonus]
    parents, drafts = greedy_tree(expected[len(out):len(out) + 2], 1, engine.vocab_size, branch=1)
    result = engine.verify("f", result.bonus, drafts, parents=parents)
    out += [*result.accepted, result.bonus]
    for _ in range(3):
        out.append(engine.verify("f", out[-1], []).bonus)
    assert out == expected[:len(out)]
    engine.release("f")


def test_a_tree_verify_returns_the_paths_features_and_logprobs(engines):
    """The features and logprobs of t and the accepted path's nodes, in path order: those of target-only
    decoding's steps."""
    engine = engines["native"]
    params = SamplingParams(logprobs=2)
    token = engine.prefill("c", PROMPT, params).token
    steps = [engine.verify("c", token, [])]
    steps.append(engine.verify("c", steps[0].bonus, []))
    engine.release("c")
    parents, drafts = greedy_tree([steps[0].bonus], 0, engine.vocab_size, branch=2)
    result = engine.verify("t", engine.prefill("t", PROMPT, params).token, drafts, parents=parents)
    assert (result.accepted, result.bonus) == ([steps[0].bonus], steps[1].bonus)
    torch.testing.assert_close(result.features, torch.cat([s.features for s in steps]), rtol=1e-4, atol=1e-4)
    for ours, ref in zip(result.logprobs, [s.logprobs[0] for s in steps], strict=True):
        assert ours.top_ids == ref.top_ids and abs(ours.logprob - ref.logprob) < 1e-4
    engine.release("t")


@pytest.mark.parametrize("name", ["native", "hf"])
def test_a_greedy_tree_verify_syncs_the_host_once(engines, hf_target, name):
    """The batch's argmax read with one tolist is the only host sync: the path's rows, features and
    moves are picked with index tensors built on the host."""
    engine = engines[name]
    token = engine.prefill("s", PROMPT, GREEDY).token
    drafts = random_tree(PARENTS, 4, engine.vocab_size)
    with OpCounter() as ops:
        result = engine.verify("s", token, drafts, parents=PARENTS)
    assert ops.reads <= 1, ops.sync_ops  # uploads: tests/test_host_syncs.py
    context = [*PROMPT, token, *result.accepted, result.bonus]
    truth = [int(last_logits(hf_target, context).argmax())]
    parents, drafts = greedy_tree(truth, 0, engine.vocab_size, branch=3)
    with OpCounter() as ops:  # the path's row moves (node 7 to the slot after the root's)
        result = engine.verify("s", result.bonus, drafts, parents=parents)
    assert ops.reads <= 1 and result.accepted[:1] == drafts[6:7], ops.sync_ops
    engine.release("s")


def outcome(result: PrefillResult | VerifyResult) -> tuple:
    return (result.token,) if isinstance(result, PrefillResult) else (result.accepted, result.bonus)


@pytest.mark.parametrize("name", ["native", "hf"])
def test_trees_chains_and_prefills_share_a_forward(engines, name):
    """One batched forward of a greedy tree, a prefill, a sampled tree and a chain gives each what it gets
    alone (the sampled tree seeded alike), and the sessions go on alike."""
    engine = engines[name]
    drafts = random_tree(PARENTS, 7, engine.vocab_size)
    kinds = {"tree": (GREEDY, PARENTS), "sampled": (SamplingParams(temperature=0.8, seed=5), PARENTS),
             "chain": (GREEDY, None)}

    def steps(tag: str) -> list[Step]:
        made = []
        for i, (sid, (params, parents)) in enumerate(kinds.items()):
            first = engine.prefill(f"{tag}{sid}", PROMPT[: 4 + i], params).token
            ids = [first, *(drafts if parents else drafts[:3])]
            made.append(Step("verify", engine.sessions.get(f"{tag}{sid}"), ids, True, None, parents))
        engine.sessions.add(f"{tag}new", Session(params=GREEDY, generator=None,
                                                  reserved=engine.kv_budget.reserve(64)))
        return [made[0], Step("prefill", engine.sessions.get(f"{tag}new"), PROMPT[2:], True), *made[1:]]

    alone = [engine._run_batch([step])[0] for step in steps("alone-")]
    batched = engine._run_batch(steps("batch-"))
    assert [outcome(r) for r in alone] == [outcome(r) for r in batched]
    for a, b in zip(alone, batched, strict=True):
        torch.testing.assert_close(a.features, b.features, rtol=1e-4, atol=1e-4)
    nexts: dict[str, list[tuple]] = {"alone-": [], "batch-": []}
    for tag, results in (("alone-", alone), ("batch-", batched)):
        for sid, result in zip(["tree", "new", "sampled", "chain"], results, strict=True):
            nexts[tag].append(outcome(engine.verify(f"{tag}{sid}", outcome(result)[-1], [3, 4])))
            engine.release(f"{tag}{sid}")
    assert nexts["alone-"] == nexts["batch-"]


def test_concurrent_trees_and_chains_batch_as_they_run_alone(engines, hf_target):
    """Threads submitting tree and chain verifies at once (the batcher puts them in shared forwards): each
    session's output is transformers' greedy generate."""
    engine = engines["native"]
    prompts = [PROMPT[: 3 + 2 * i] for i in range(4)]
    expected = [hf_generate(hf_target, p, 20) for p in prompts]
    start = threading.Barrier(len(prompts))

    def one(i: int) -> list[int]:
        token = engine.prefill(f"c{i}", prompts[i], GREEDY).token
        out = [token]
        start.wait()
        for round_ in range(5):
            truth = expected[i][len(out):len(out) + 3]
            if (i + round_) % 2:
                result = engine.verify(f"c{i}", token, truth[:2])
            else:
                branch = (i + round_) % 3
                parents, drafts = greedy_tree(truth, 10 * i + round_, engine.vocab_size, branch=branch)
                result = engine.verify(f"c{i}", token, drafts, parents=parents)
            out += [*result.accepted, result.bonus]
            token = result.bonus
        engine.release(f"c{i}")
        return out

    with ThreadPoolExecutor(len(prompts)) as pool:
        outputs = list(pool.map(one, range(len(prompts))))
    assert outputs == [ref[:len(out)] for out, ref in zip(outputs, expected, strict=True)]


def test_sampled_tree_acceptance_commits_the_targets_distribution():
    """Recursive rejection over a node's children keeps the target's distribution: with fixed logits at
    the nodes, 4000 seeds, the first committed token is distributed as p at the root (among its children
    one top-k has cut out, p = 0), and the second, when the first is the root's first child, as p at that
    child. Chi-square at a 1e-3 level each, so a correct rule fails by chance with probability 2e-3 over
    independent seeds (the seeds are fixed: the test's outcome is deterministic)."""
    params = SamplingParams(temperature=0.9, top_k=6)
    logits = torch.tensor([[2.0, 1.6, 1.1, 0.9, 0.4, 0.2, -1.0, -2.0],  # the root: top-k cuts tokens 6, 7
                           [0.1, 1.2, 0.3, 2.0, -0.5, 1.0, 0.8, 0.0],  # node 1 (token 3)
                           *torch.zeros(3, 8), [0.0] * 8, [0.0] * 8])
    tokens = [4, 3, 0, 7, 1, 5]  # t; the root's children 3, 0, 7 (p = 0); node 1's children 1, 5
    parents = [-1, -1, -1, 0, 0]
    first, second = torch.zeros(8), torch.zeros(8)
    for seed in range(4000):
        path, bonus = accept_tree(logits, tokens, parents, params, torch.Generator().manual_seed(seed))
        committed = [tokens[i] for i in path] + [bonus]
        first[committed[0]] += 1
        if path[:1] == [1]:
            second[committed[1]] += 1
    assert chi_square_p(first, target_probs(logits[:1], params)[0]) > 1e-3
    assert second.sum() > 300
    assert chi_square_p(second, target_probs(logits[1:2], params)[0]) > 1e-3


def test_bad_trees_are_refused_and_the_session_goes_on(engines, hf_target, tmp_path):
    """InvalidRequest naming the problem; the session's next verify is as if they never came."""
    engine = engines["native"]
    token = engine.prefill("b", PROMPT, GREEDY).token
    bad = [([1, 2, 3], [-1, 0], "2 parents for 3 drafts"),
           ([1, 2, 3], [-1, 2, 0], "draft 1 has 2"),
           ([1, 2], [-1, 5], "draft 1 has 5"),
           (list(range(2, MAX_TREE_NODES + 3)), [-1] * (MAX_TREE_NODES + 1), f"at most {MAX_TREE_NODES}"),
           ([1, 9, 9], [-1, 0, 0], "siblings must be distinct")]
    for drafts, parents, message in bad:
        with pytest.raises(InvalidRequest, match=message):
            engine.verify("b", token, drafts, parents=parents)
    assert engine.verify("b", token, []).bonus == int(last_logits(hf_target, [*PROMPT, token]).argmax())
    engine.release("b")
    # transformers' model with a sliding window cannot take a tree's mask: refused by name
    torch.manual_seed(0)
    shape = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
             "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 256}
    MistralForCausalLM(MistralConfig(**shape, sliding_window=8)).save_pretrained(tmp_path / "mistral")
    windowed = TargetEngine(tmp_path / "mistral", aux_layer_ids=[1, 2, 4])
    assert windowed.engine == "hf" and not windowed.supports_trees
    token = windowed.prefill("w", [1, 2, 3], GREEDY).token
    with pytest.raises(InvalidRequest, match="draft trees need the native engine"):
        windowed.verify("w", token, [4, 5], parents=[-1, -1])
    assert len(windowed.verify("w", token, [4, 5]).accepted) <= 2


@pytest.mark.slow
def test_the_compiled_forward_masks_a_tree(tiny_dir, hf_target):
    """flex_attention's mask_mod with the tree rule compiles (one bucket of 16: the prefill and the trees),
    and a compiled tree verify gives transformers' logits at every node and generate's tokens after it."""
    engine = TargetEngine(tiny_dir / "target", engine="native", compile=True)
    expected = hf_generate(hf_target, PROMPT, 16)
    token = engine.prefill("x", PROMPT, GREEDY).token
    out = [token]
    for round_ in range(3):
        truth = expected[len(out):len(out) + 3]
        parents, drafts = greedy_tree(truth, round_, engine.vocab_size, branch=2)  # 11 nodes
        tokens = [token, *drafts]
        with kept_logits(engine) as seen:
            result = engine.verify("x", token, drafts, parents=parents)
        for node in range(len(tokens)):
            ids = [*PROMPT, *out, *(tokens[i] for i in path_to(parents, node))]
            torch.testing.assert_close(seen[0][node], last_logits(hf_target, ids), rtol=1e-4, atol=1e-4)
        assert result.accepted == truth
        out += [*result.accepted, result.bonus]
        token = result.bonus
    assert out == expected[:len(out)] and engine.runner.buckets == {(16, engine.kv_pool.owner.shape[0])}
