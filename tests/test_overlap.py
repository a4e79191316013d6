"""Overlapped drafting: the draft prepares the next round while the target verifies.

Drafts only choose what the target checks, so output must not change: greedy equals target-only and
sampling keeps the target's law, with hits and misses both exercised. The draft's KV keeps exact target
features for every committed position, whatever it assumed while speculating ahead.
"""

from __future__ import annotations

import pytest
import torch
from helpers import OracleDraft
from test_core import assert_same_or_tie, chi_square_p_value, hf_greedy, make_prompts

from draft_server.engine import DraftEngine
from tandem.params import GenerationRequest, SamplingParams
from tandem.policy import Speculation
from tandem_tools.inprocess import run_rounds
from target_server.acceptance import target_probs


def generate(generator, draft, request, **kw):
    tokens, event = [], None
    for event in run_rounds(generator.target, draft, request, max_context=generator.target.max_context,
                            speculation=Speculation(**kw)):
        tokens.extend(event.new_tokens)
    return tokens, event.stats


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_overlap_matches_target_only(generator, hf_target, k):
    """The real draft engine, its aheads on a worker thread: the same tokens as HF generate."""
    overlap_rounds = 0
    for prompt in make_prompts(8, generator.target.vocab_size, seed=3):
        request = GenerationRequest(prompt_ids=prompt, max_new_tokens=24, num_draft_tokens=k)
        tokens, stats = generate(generator, generator.draft, request, overlap=True, branches=4)
        assert_same_or_tie(hf_target, prompt, tokens, hf_greedy(hf_target, prompt, 24))
        overlap_rounds += stats.num_overlap_rounds
    assert overlap_rounds > 0
    assert generator.target.num_sessions == 0 and generator.draft.num_sessions == 0


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_with_overlap_and_mixed_hits_matches_target_only(generator, hf_target, k):
    """A mostly-right draft: hits and misses, every accepted length, the prepared drafts taken."""
    oracle = OracleDraft(hf_target, corrupt=0.25, seed=k)
    hits = misses = 0
    for prompt in make_prompts(8, generator.target.vocab_size, seed=1):
        oracle.expect(prompt[0])
        request = GenerationRequest(prompt_ids=prompt, max_new_tokens=24, num_draft_tokens=k)
        tokens, stats = generate(generator, oracle, request, overlap=True)
        assert_same_or_tie(hf_target, prompt, tokens, hf_greedy(hf_target, prompt, 24))
        hits += stats.num_overlap_hits
        misses += stats.num_overlap_rounds - stats.num_overlap_hits
        assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert hits > 0 and misses > 0


def test_concurrent_sessions_with_overlap_match_target_only(generator, hf_target):
    """Aheads and proposes of different sessions share the draft's batches: each output is still its own."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = make_prompts(6, generator.target.vocab_size, seed=8)

    def one(prompt):
        request = GenerationRequest(prompt_ids=prompt, max_new_tokens=20, num_draft_tokens=2)
        return generate(generator, generator.draft, request, overlap=True, branches=3)

    with ThreadPoolExecutor(3) as pool:
        outcomes = list(pool.map(one, prompts))
    for prompt, (tokens, stats) in zip(prompts, outcomes, strict=True):
        assert_same_or_tie(hf_target, prompt, tokens, hf_greedy(hf_target, prompt, 20))
        assert stats.num_overlap_rounds > 0
    assert generator.draft.num_sessions == 0


def test_an_always_right_draft_hits_every_round(generator, hf_target):
    oracle = OracleDraft(hf_target, corrupt=0.0)
    for prompt in make_prompts(4, generator.target.vocab_size, seed=5):
        oracle.expect(prompt[0])
        request = GenerationRequest(prompt_ids=prompt, max_new_tokens=40, num_draft_tokens=3, ignore_eos=True)
        tokens, stats = generate(generator, oracle, request, overlap=True)
        assert_same_or_tie(hf_target, prompt, tokens, hf_greedy(hf_target, prompt, 40))
        # 40 tokens at 4 per round: 10 verifies; each but the last two (too near the limit for another
        # round of 3 drafts) had the next round prepared, and every one of those hit
        assert stats.num_overlap_rounds >= stats.num_rounds - 2 > 0
        assert stats.num_overlap_hits == stats.num_overlap_rounds
        assert stats.overlap_hit_rate == 1.0
        assert stats.num_accepted_tokens == stats.num_draft_tokens  # every draft right


def test_overlap_off_or_a_draft_without_ahead_runs_sequentially(generator, hf_target):
    prompt = make_prompts(1, generator.target.vocab_size, seed=9)[0]
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=16, num_draft_tokens=3)
    _, stats = generate(generator, generator.draft, request)
    assert stats.num_overlap_rounds == 0

    class Sequential:  # propose and release only: the protocol without ahead
        def __init__(self, inner):
            self.inner = inner

        def propose(self, *args, **kw):
            return self.inner.propose(*args, **kw)

        def release(self, session_id):
            return self.inner.release(session_id)

    tokens, stats = generate(generator, Sequential(generator.draft), request, overlap=True)
    assert stats.num_overlap_rounds == 0
    assert_same_or_tie(hf_target, prompt, tokens, hf_greedy(hf_target, prompt, 16))


def test_overlap_leaves_sampled_generations_alone_unless_asked(generator):
    """The servers' default (overlap on, overlap_sampled off): a greedy generation overlaps, a sampled one
    drafts round by round; with overlap_sampled both overlap."""
    prompt = make_prompts(1, generator.target.vocab_size, seed=5)[0]
    greedy = GenerationRequest(prompt_ids=prompt, max_new_tokens=16, num_draft_tokens=3, ignore_eos=True)
    sampled = greedy.model_copy(update={"sampling": SamplingParams(temperature=1.0, seed=2)})
    assert generate(generator, generator.draft, greedy, overlap=True)[1].num_overlap_rounds > 0
    assert generate(generator, generator.draft, sampled, overlap=True)[1].num_overlap_rounds == 0
    assert generate(generator, generator.draft, sampled, overlap=True, overlap_sampled=True)[1].num_overlap_rounds > 0


def exact_first_three(model, prompt: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    """The target's own joint law of its first three sampled tokens."""
    law = {(): 1.0}
    with torch.inference_mode():
        for _ in range(3):
            prefixes = list(law)
            probs = target_probs(model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1], params)
            law = {(*p, t): law[p] * float(probs[row, t]) for row, p in enumerate(prefixes)
                   for t in probs[row].nonzero().flatten().tolist()}
    return law


def test_sampling_with_overlap_is_lossless(generator, hf_target):
    """400 seeded runs, K=1, the draft right half the time: the joint law of the first three tokens
    equals the target's own (chi-square, p > 0.001). Top-k 2 keeps that law to 8 cells. The third token
    is verified against a draft prepared during the previous verify whenever that one was a hit (and
    the first verify rejected its draft), so prepared drafts carry a good share of the mass."""
    params = SamplingParams(temperature=1.0, top_k=2)
    prompt = [17, 250, 33, 104]
    oracle = OracleDraft(hf_target, corrupt=0.5, seed=11)
    runs, hits = 400, 0
    observed: dict[tuple[int, ...], int] = {}
    for seed in range(runs):
        oracle.expect(prompt[0])
        request = GenerationRequest(
            prompt_ids=prompt, max_new_tokens=5, num_draft_tokens=1, ignore_eos=True,
            sampling=params.model_copy(update={"seed": seed}),
        )
        tokens, stats = generate(generator, oracle, request, overlap=True, overlap_sampled=True)
        hits += stats.num_overlap_hits
        observed[tuple(tokens[:3])] = observed.get(tuple(tokens[:3]), 0) + 1
    assert hits > runs // 8  # about one run in five
    p_value = chi_square_p_value(observed, exact_first_three(hf_target, prompt, params), runs)
    assert p_value > 1e-3, f"p = {p_value:.2e}"


# -- the draft engine's ahead step ---------------------------------------------------------------


def test_ahead_keeps_exact_features_for_committed_positions(generator):
    """An ahead appends the committed pairs with the target's features, as a propose does: the KV it
    leaves is the one the sequential path leaves, and nothing of the assumed drafts or rollouts."""
    target, draft = generator.target, generator.draft
    prompt = [5, 9, 200, 31, 7, 64]
    kv = {}
    for mode in ("sequential", "ahead"):
        sid = f"exact-{mode}"
        prefill = target.prefill(sid, prompt, SamplingParams())
        drafts = draft.propose(sid, prefill.features, [*prompt[1:], prefill.token], 3, create=True)
        result = target.verify(sid, prefill.token, drafts)
        pairs = [*result.accepted, result.bonus]
        if mode == "sequential":
            draft.propose(sid, result.features, pairs, 3)
        else:
            branches = draft.prepare(sid, None, [], drafts, 3, branches=3)  # during the verify
            assert len(branches) == 3 and all(len(b.drafts) == 3 for b in branches)
            follow = branches[0].drafts  # as if the next verify went out with these
            draft.prepare(sid, result.features, pairs, follow, 3, branches=2)
        session = draft.sessions.get(sid)
        committed = len(prompt) + len(pairs)  # pairs (F_i, x_{i+1}) of every committed position
        assert session.length == session.kv.length == committed
        kv[mode] = session.kv.k.clone(), session.kv.v.clone()
        target.release(sid)
        draft.release(sid)
    torch.testing.assert_close(kv["ahead"][0], kv["sequential"][0])
    torch.testing.assert_close(kv["ahead"][1], kv["sequential"][1])


def test_ahead_continues_the_rollout_it_assumes(generator, tiny_dir):
    """Assuming d_1..d_3 of a K=5 rollout, the all-accepted branch with the draft's top bonus is d_4
    followed by d_5: the ahead feeds the drafts as their rollout did."""
    target = generator.target
    draft = DraftEngine(tiny_dir / "draft", tiny_dir / "target")  # no verify outcomes seen: a uniform prior
    prompt = [11, 12, 13, 14]
    prefill = target.prefill("cont", prompt, SamplingParams())
    rollout = draft.propose("cont", prefill.features, [*prompt[1:], prefill.token], 5, create=True)
    branches = draft.prepare("cont", None, [], rollout[:3], 2, branches=64)
    main = [b for b in branches if b.accepted == 3 and b.bonus == rollout[3]]
    assert main and main[0].drafts[0] == rollout[4]
    assert len({(b.accepted, b.bonus) for b in branches}) == len(branches)  # distinct outcomes
    for b in branches:
        assert b.accepted == 3 or b.bonus != rollout[b.accepted]  # a rejected draft is never the bonus
    target.release("cont")
    draft.release("cont")


def test_ahead_refuses_drafts_it_did_not_propose(generator):
    from tandem.sessions import InvalidRequest

    target, draft = generator.target, generator.draft
    prefill = target.prefill("refuse", [3, 4, 5], SamplingParams())
    drafts = draft.propose("refuse", prefill.features, [4, 5, prefill.token], 2, create=True)
    with pytest.raises(InvalidRequest, match="proposed"):
        draft.prepare("refuse", None, [], [d + 1 for d in drafts], 2)
    target.release("refuse")
    draft.release("refuse")


# -- the services: the ahead step on the draft's stream ---------------------------------------------


def test_services_with_overlap_match_in_process_and_survive_a_killed_draft(tiny_dir, tmp_path, generator):
    """A coordinator with --overlap on sends the ahead beside the verify: greedy output is the in-process
    output, the stats and the profile count the overlapped rounds, and a draft killed while aheads are
    in flight leaves the output unchanged (the generation finishes target-only)."""
    import grpc
    from processes import start_stack, stop_stack

    from coordinator.client import TandemClient, build_request
    from tandem.v1 import coordinator_pb2_grpc

    procs = start_stack(tiny_dir, tmp_path, coordinator_args=["--overlap", "on", "--draft-timeout", "2"])
    address = procs["coordinator"].address
    try:
        with TandemClient(address, timeout=120) as client:
            overlap_rounds = 0
            for prompt in make_prompts(3, generator.target.vocab_size, seed=4):
                for k in (1, 3):
                    got = client.generate(prompt_ids=prompt, max_new_tokens=20, num_draft_tokens=k)
                    want = generator.generate(GenerationRequest(prompt_ids=prompt, max_new_tokens=20,
                                                                num_draft_tokens=k))
                    assert got.token_ids == want.token_ids
                    assert got.stats["num_overlap_hits"] <= got.stats["num_overlap_rounds"]
                    overlap_rounds += got.stats["num_overlap_rounds"]
            assert overlap_rounds > 0
            # a sampled request drafts round by round: the servers overlap greedy generations only
            # (defaults.OVERLAP_SAMPLED; sampled aheads run in-process, test_overlap_leaves_sampled_...)
            sampled = client.generate(prompt_ids=[5, 6, 7], max_new_tokens=20, num_draft_tokens=2, temperature=1.0,
                                      seed=3, ignore_eos=True)
            assert len(sampled.token_ids) == 20 and sampled.stats["num_overlap_rounds"] == 0
            assert sampled.stats["num_draft_tokens"] > 0

            request = build_request(prompt_ids=[5, 6, 7], max_new_tokens=20, num_draft_tokens=2)
            request.profile = True
            with grpc.insecure_channel(address) as channel:
                response = coordinator_pb2_grpc.CoordinatorStub(channel).Generate(request, timeout=120)
            rounds = response.profile.rounds
            assert response.stats.num_overlap_rounds > 0
            assert sum(bool(r.ahead_sent_ns) for r in rounds) == response.stats.num_overlap_rounds
            assert all(r.ahead_received_ns >= r.ahead_sent_ns for r in rounds)

            long = {"prompt_ids": [11, 12, 13, 14], "max_new_tokens": 150, "ignore_eos": True, "num_draft_tokens": 3}
            want = generator.generate(GenerationRequest(**long)).token_ids
            tokens, last = [], None
            for i, delta in enumerate(client.generate_stream(**long)):
                tokens += delta.token_ids
                last = delta
                if i == 5:
                    procs["draft"].kill()
            assert tokens == want
            assert last.stats["num_rounds_without_draft"] > 0
    finally:
        stop_stack(procs)
