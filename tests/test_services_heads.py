"""Heads beyond the one-layer EAGLE-3 chain through the three services: a P-EAGLE head (all K drafts in one
forward) and an EAGLE-3 head of two layers, written in the published layouts (tests/published_heads.py)
with random weights. Greedy output is the target's alone whatever the drafts are: these check that
drafting with them (proposes, the aheads they answer without branches, trees) never changes a token."""

from __future__ import annotations

import pytest
from published_heads import canonical_weights, layer_fields, write_nemo, write_speculators
from transformers import LlamaConfig

from coordinator.client import TandemClient
from tandem.params import GenerationRequest, SamplingParams
from tandem_tools.inprocess import InProcessGenerator
from tests.serving import serve
from tests.test_services import id_prompts

pytestmark = pytest.mark.slow

HEADS = ["peagle-nemo", "eagle3-2-layers-speculators"]


def _pair(root, tiny_dir, kind):
    """A pair directory: the tiny target and the head `kind` as its draft."""
    root.mkdir()
    (root / "target").symlink_to(tiny_dir / "target")
    if kind == "peagle-nemo":
        family = LlamaConfig(**layer_fields(), num_hidden_layers=8).to_dict()
        write_nemo(root / "draft", canonical_weights(41, layers=2, mask_hidden=True), family, parallel_drafting=True,
                   mask_token_id=0, num_depths=4)
    else:
        layer = {**LlamaConfig(**layer_fields(), num_hidden_layers=2).to_diff_dict(), "model_type": "llama"}
        write_speculators(root / "draft", canonical_weights(42, layers=2), layer)
    return root


@pytest.fixture(scope="module", params=HEADS)
def served(request, tiny_dir, tmp_path_factory):
    root = _pair(tmp_path_factory.mktemp("pair") / request.param, tiny_dir, request.param)
    stack = serve(root, root / "serve.log", [])
    stack.root = root
    yield stack
    stack.stop()


def test_greedy_output_with_the_head_is_target_only_output(served):
    prompts = id_prompts(6, 512, seed=11)
    with TandemClient(served.grpc, timeout=120) as client:
        for i, prompt in enumerate(prompts):
            k = 1 + i % 5  # past the P-EAGLE head's 4 depths too: it drafts 4
            got = client.generate(prompt_ids=prompt, max_new_tokens=24, num_draft_tokens=k)
            alone = client.generate(prompt_ids=prompt, max_new_tokens=24, speculate=False)
            assert got.token_ids == alone.token_ids, (prompt, k)
            assert got.stats["num_draft_tokens"] > 0  # the head drafted
        tree = client.generate(prompt_ids=prompts[0], max_new_tokens=20, num_draft_tokens=3,
                               tree={"nodes": 8, "depth": 3, "top_k": 3})
        assert tree.token_ids == client.generate(prompt_ids=prompts[0], max_new_tokens=20, speculate=False).token_ids


def test_sampled_output_with_the_head_is_the_in_process_one(served):
    """Speculative sampling with the head's q (a P-EAGLE head's q of each depth from its one forward): the
    services give what both engines give in this process, seed for seed."""
    generator = InProcessGenerator(served.root / "target", served.root / "draft", draft_cost=0)
    with TandemClient(served.grpc, timeout=120) as client:
        for seed, prompt in enumerate(id_prompts(2, 512, seed=12)):
            params = {"max_new_tokens": 20, "num_draft_tokens": 3, "temperature": 1.0, "top_p": 0.9, "seed": seed}
            got = client.generate(prompt_ids=prompt, **params)
            sampling = {k: params.pop(k) for k in ("temperature", "top_p", "seed")}
            want = generator.generate(GenerationRequest(prompt_ids=prompt, sampling=SamplingParams(**sampling),
                                                        **params), overlap=True)
            assert got.token_ids == want.token_ids and got.stats["num_draft_tokens"] > 0
