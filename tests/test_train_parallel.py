"""P-EAGLE training (draft_server/train_parallel.py): COD sampling, and the flat forward with the cross-depth
mask computing what the one-forward propose computes at inference."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from draft_server.checkpoint import SPECULATORS, load_draft, save_draft
from draft_server.model import DraftKV, Eagle3Config, Eagle3Draft
from draft_server.train_parallel import cod_sample, parallel_forward


def _head(layers: int = 2) -> Eagle3Draft:
    torch.manual_seed(0)
    layer = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5)
    config = Eagle3Config(layer=layer, target_hidden_size=16, draft_vocab_size=64, num_layers=layers,
                          parallel_drafting=True, mask_token_id=5, num_depths=4)
    return Eagle3Draft(config).eval()


def test_cod_keeps_every_anchor_at_depth_0_and_whole_chains_deeper():
    lengths = [40, 25, 3]
    anchor, depth, real = cod_sample(lengths, 39, 5, 0.7, 0.2, torch.Generator().manual_seed(1))
    for row, length in enumerate(lengths):
        a, d = anchor[row][real[row]], depth[row][real[row]]
        assert a[d == 0].tolist() == list(range(39))
        for k in range(1, int(d.max()) + 1):
            chains = set(a[d == k].tolist())
            assert chains <= set(a[d == k - 1].tolist())  # a chain is never cut in the middle
            assert all(i + 1 + k < length for i in chains)  # every element's target is inside the sequence
        if length == 40:
            assert (d == 1).sum() == int(38 * 0.7) and (d == 4).sum() == int(35 * 0.7**4)


def test_the_flat_training_forward_is_the_one_forward_propose():
    """Element (anchor i, depth d) of the masked training forward gives what a propose after the pairs 0..i
    gives as draft d+1: the mask lets it see exactly the committed context and its own chain."""
    draft = _head()
    torch.manual_seed(2)
    t = 12
    ids, features = torch.randint(0, 64, (1, t)), torch.randn(1, t, 48)
    anchor, depth, _ = cod_sample([t], t - 1, 4, 1.0, 1.0, torch.Generator())  # every chain to every depth
    with torch.no_grad():
        flat = parallel_forward(draft, ids, features, anchor, depth)[0]
        for i in (0, 4, 7):
            kv = DraftKV()
            tokens, positions = draft.parallel_inputs(ids[0, 1 : i + 2].tolist(), 0, 4)
            rows = draft.parallel_draft(features[0, : i + 1], torch.tensor(tokens), torch.tensor(positions), kv)
            assert kv.length == i + 1  # the masked positions' KV is dropped
            for d in range(4):
                if i + 1 + d < t:
                    at = int(((anchor[0] == i) & (depth[0] == d)).nonzero())
                    torch.testing.assert_close(flat[at], rows[d], atol=1e-5, rtol=1e-5)


def test_the_offline_scorer_picks_what_a_propose_after_each_position_drafts():
    """bench/head_accuracy.py scores a P-EAGLE head from one flat forward: at index i its picks are the drafts a
    greedy propose after the pairs 0..i proposes."""
    from tests.test_trees import _bench

    draft = _head()
    torch.manual_seed(3)
    t = 10
    ids, features = torch.randint(0, 64, (1, t)), torch.randn(1, t, 48)
    with torch.no_grad():
        picks = _bench("head_accuracy").depth_picks(draft, ids, features, 4)
        assert [len(p) for p in picks] == [t - 1] * 4
        for i in (0, 3, 8):
            tokens, positions = draft.parallel_inputs(ids[0, 1 : i + 2].tolist(), 0, 4)
            rows = draft.parallel_draft(features[0, : i + 1], torch.tensor(tokens), torch.tensor(positions), DraftKV())
            assert draft.to_target_ids(draft.draft_logits(rows).argmax(-1)).tolist() == [int(p[i]) for p in picks]


def test_a_peagle_head_saved_in_either_layout_loads_back(tmp_path):
    draft = _head(layers=3)
    for layout in ("reference", SPECULATORS):
        out = save_draft(draft, tmp_path / layout, layout=layout, include_embeddings=True)
        loaded = load_draft(out)
        assert loaded.config.kind == "p-eagle, 3 layers, 4 depths" and loaded.config.mask_token_id == 5
        for key, tensor in draft.state_dict().items():
            assert torch.equal(loaded.state_dict()[key], tensor), (layout, key)


def test_a_batch_of_proposes_drafts_what_each_propose_alone_drafts(tiny_dir, tmp_path):
    """Several sessions' proposes in one batch (padded, a P-EAGLE head's masked positions after each session's
    own pairs; every layer's KV stacked) give each session what it gets alone, round after round."""
    from published_heads import canonical_weights, layer_fields, write_speculators

    from draft_server.engine import DraftEngine
    from tandem.protocol import Propose

    layer = {**LlamaConfig(**layer_fields(), num_hidden_layers=2).to_diff_dict(), "model_type": "llama"}
    for name, fields in (("eagle3", {}), ("peagle", {"speculators_model_type": "peagle", "mask_token_id": 3,
                                                     "num_depths": 4})):
        head = write_speculators(tmp_path / name, canonical_weights(51, layers=2, mask_hidden=bool(fields)), layer,
                                 **fields)
        batched, alone = DraftEngine(head, tiny_dir / "target"), DraftEngine(head, tiny_dir / "target")
        torch.manual_seed(3)
        sizes = [[5, 9, 2], [1, 3, 4], [2, 1, 6]]  # per round, per session: new pairs
        for r, round_sizes in enumerate(sizes):
            # K 5, 4, 3: past the P-EAGLE head's 4 depths for the first session
            steps = [Propose(f"s{i}", torch.randn(m, 192), torch.randint(0, 512, (m,)).tolist(), 5 - i, open=r == 0)
                     for i, m in enumerate(round_sizes)]
            got = batched.run(steps)
            want = [alone.run([step])[0] for step in steps]
            assert [list(d) for d in got] == [list(d) for d in want], (name, r)


def test_a_peagle_tree_is_the_first_level_and_the_chain_from_the_one_forward(tiny_dir, tmp_path):
    from published_heads import canonical_weights, layer_fields, write_speculators

    from draft_server.engine import DraftEngine
    from tandem.params import TreeParams

    layer = {**LlamaConfig(**layer_fields(), num_hidden_layers=1).to_diff_dict(), "model_type": "llama"}
    head = write_speculators(tmp_path / "peagle", canonical_weights(52, mask_hidden=True), layer,
                             speculators_model_type="peagle", mask_token_id=3, num_depths=5)
    trees, chains = DraftEngine(head, tiny_dir / "target"), DraftEngine(head, tiny_dir / "target")
    torch.manual_seed(4)
    features, tokens = torch.randn(6, 192), torch.randint(0, 512, (6,)).tolist()
    tree = trees.propose("s", features, tokens, 4, create=True, tree=TreeParams(nodes=8, depth=4, top_k=3))
    chain = chains.propose("s", features, tokens, 4, create=True)
    assert tree.parents == [-1, -1, -1, 0, 3, 4] and len(set(tree[:3])) == 3
    assert [tree[0], *tree[3:]] == list(chain)  # the top path is the chain's drafts


def test_a_compiled_peagle_propose_drafts_what_the_eager_one_does(tiny_dir, tmp_path, monkeypatch):
    """TANDEM_COMPILE: a P-EAGLE head of two layers proposes after a session's first in one compiled call
    (rollout.ParallelPropose, every layer's KV in and out), its drafts the eager engine's round after round;
    all its graphs compiled at start-up, nothing after, whatever the new pairs; sampled proposes stay eager."""
    from helpers import compile_eagerly
    from published_heads import canonical_weights, layer_fields, write_speculators

    from draft_server.engine import DraftEngine
    from draft_server.rollout import ParallelPropose
    from tandem.params import SamplingParams

    layer = {**LlamaConfig(**layer_fields(), num_hidden_layers=2).to_diff_dict(), "model_type": "llama"}
    head = write_speculators(tmp_path / "peagle", canonical_weights(53, layers=2, mask_hidden=True), layer,
                             speculators_model_type="peagle", mask_token_id=3, num_depths=4)
    compile_eagerly(monkeypatch)
    monkeypatch.setattr(ParallelPropose, "KS", (1, 3, 4))
    monkeypatch.setenv("TANDEM_COMPILE", "1")
    torch._dynamo.reset()
    compiled = DraftEngine(head, tiny_dir / "target")
    monkeypatch.setenv("TANDEM_COMPILE", "0")
    eager = DraftEngine(head, tiny_dir / "target")
    assert compiled.parallel_propose is not None and compiled.parallel_propose.ks == [1, 3, 4]
    assert eager.parallel_propose is None and compiled.greedy_propose is None
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    calls = []
    propose = compiled.parallel_propose._propose
    compiled.parallel_propose._propose = lambda *args: calls.append(args[4]) or propose(*args)
    sampled = SamplingParams(temperature=0.8, seed=1)
    torch.manual_seed(5)
    for i, k in enumerate([4, 3, 4, 2, 1, 4]):
        m = 6 if i == 0 else 1 + i % 3
        features, tokens = torch.randn(m, 192), torch.randint(0, 512, (m,)).tolist()
        got, want = (engine.propose("g", features, tokens, k, create=i == 0) for engine in (compiled, eager))
        assert list(got) == list(want), (i, k)
        for engine in (compiled, eager):
            engine.propose("s", features, tokens, k, create=i == 0, sampling=sampled)
    assert calls == [3, 4, 1, 4]  # the first propose eager (its KV empty), K=2 not compiled; sampled ones eager
    assert compiled.sessions.get("g").kv.length == eager.sessions.get("g").kv.length
    for layer_index in range(2):
        torch.testing.assert_close(compiled.sessions.get("g").kv.layer(layer_index).k,
                                   eager.sessions.get("g").kv.layer(layer_index).k, atol=1e-5, rtol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # nothing compiled after start-up
    from tandem_tools.opcount import OpCounter

    for engine in (compiled, eager):  # one host read a propose, compiled or not
        features, tokens = torch.randn(3, 192), torch.randint(0, 512, (3,)).tolist()
        with OpCounter() as ops:
            engine.propose("g", features, tokens, 4)
        assert ops.reads <= 1, dict(ops.sync_ops)
