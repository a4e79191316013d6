"""Speculative sampling with the draft's own distribution q is lossless: the output law is the target's.

The statistical test: for each case (temperature 0.7 and 1.0, with and without top-k/top-p, each alone or
batched, and two with overlap), RUNS seeded generations of a few tokens from one prompt,
drafted K=2 at a time by a draft that samples from its own q and sends it (helpers.SamplingOracleDraft:
accepted, recovered and bonus tokens all carry mass; with overlap, drafts prepared during the last
verify too). At each of the positions 1..3 (the drafted ones; position 0 is the prefill's own sample)
the empirical law of the next token given the tokens before it is compared with the target's exact
conditional law: a chi-square over (prefix, token) cells, rare cells pooled within each prefix. A check
fails at p < ALPHA; with 6 cases x 3 positions = 18 checks, the chance that a correct sampler fails
this file is at most 18 * ALPHA = 0.18% (Bonferroni). The same test on a sampler with a classic bug (the
recovered token drawn from p instead of max(0, p - q)) fails: at this size the check sees a wrong rule.
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import SamplingOracleDraft, chi_square_p

from draft_server.sampling import DraftSampler, draft_q, draw
from tandem.constraint import Grammars, unpack_rows, words
from tandem.params import GenerationRequest, GrammarSpec, SamplingParams
from tandem.policy import Speculation
from tandem.protocol import DraftProbs
from tandem.sessions import InvalidRequest
from tandem_tools.inprocess import run_rounds
from target_server import acceptance
from target_server.acceptance import target_probs

PROMPT = [17, 250, 33, 104]
RUNS, K, NEW_TOKENS = 800, 2, 4
POSITIONS = (1, 2, 3)
ALPHA = 1e-4  # per check

SETTINGS = {
    "t0.7": SamplingParams(temperature=0.7),
    "t1": SamplingParams(temperature=1.0),
    "t0.7-top_k8-top_p0.9": SamplingParams(temperature=0.7, top_k=8, top_p=0.9),
    "t1-top_k20-top_p0.8": SamplingParams(temperature=1.0, top_k=20, top_p=0.8),
}


def sample_runs(target, draft, params: SamplingParams, runs: int, mode: str, grammar: GrammarSpec | None = None,
                grammars=None) -> tuple[list[tuple[int, ...]], int]:
    """`runs` seeded generations of NEW_TOKENS tokens, and the overlap hits among their rounds. batched: 8
    at a time, so that the target verifies them in shared forwards; overlap: the draft prepares each next
    round during the verify (a hit verifies the drafts it prepared, with their q)."""
    speculation = Speculation(overlap=mode == "overlap", overlap_sampled=True)

    def one(seed: int) -> tuple[int, ...]:
        # an ahead runs only while a next round can follow: overlap needs a few more tokens
        new_tokens = NEW_TOKENS + 2 if mode == "overlap" else NEW_TOKENS
        request = GenerationRequest(prompt_ids=PROMPT, max_new_tokens=new_tokens, num_draft_tokens=K,
                                    ignore_eos=True, sampling=params.model_copy(update={"seed": seed}),
                                    grammar=grammar)
        events = run_rounds(target, draft, request, speculation=speculation, grammars=grammars)
        tokens, event = [], None
        for event in events:
            tokens += event.new_tokens
        hits.append(event.stats.num_overlap_hits)
        return tuple(tokens)

    hits: list[int] = []
    if mode != "batched":
        return [one(seed) for seed in range(runs)], sum(hits)
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(runs))), sum(hits)


def conditional_p_value(model, params: SamplingParams, samples: list[tuple[int, ...]], position: int,
                        process=None) -> float:
    """Goodness of fit of the token at `position` given the tokens before it, to the target's own
    conditional law: chi-square summed over the observed prefixes (cells with an expected count below 5
    pooled per prefix; a token the target cannot produce makes the statistic infinite). `process(logits,
    prefix)`: the target's logits at that prefix as the request's penalties or grammar make them."""
    groups: dict[tuple[int, ...], Counter] = {}
    for s in samples:
        groups.setdefault(s[:position], Counter())[s[position]] += 1
    prefixes = list(groups)
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT + list(p) for p in prefixes])).logits[:, -1]
        if process is not None:
            logits = torch.stack([process(row, prefix) for row, prefix in zip(logits, prefixes, strict=True)])
        probs = target_probs(logits, params)  # [prefixes, V]
    stat, df = 0.0, 0
    for prefix, row in zip(prefixes, probs, strict=True):
        observed, n = groups[prefix], sum(groups[prefix].values())
        cells, pooled_obs, pooled_exp = 0, 0, 0.0
        for token, expected in enumerate((row * n).tolist()):
            if expected >= 5:
                stat += (observed.get(token, 0) - expected) ** 2 / expected
                cells += 1
            else:
                pooled_obs += observed.get(token, 0)
                pooled_exp += expected
        if pooled_exp > 0:
            stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
            cells += 1
        elif pooled_obs:
            return 0.0  # the target gives those tokens no probability at all
        df += cells - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


@pytest.fixture(scope="module")
def oracle(hf_target):
    return SamplingOracleDraft(hf_target, PROMPT[0], top_n=8)


# every setting and every way of running, each setting alone or batched once (their pairs are each one path)
CASES = [("t0.7", "alone"), ("t1-top_k20-top_p0.8", "alone"), ("t1", "batched"), ("t0.7-top_k8-top_p0.9", "batched"),
         ("t1", "overlap"), ("t0.7-top_k8-top_p0.9", "overlap")]


@pytest.mark.parametrize("name, mode", CASES, ids=[f"{name}-{mode}" for name, mode in CASES])
def test_sampled_drafts_keep_the_targets_law(generator, hf_target, oracle, name, mode):
    params = SETTINGS[name]
    samples, hits = sample_runs(generator.target, oracle, params, RUNS, mode)
    if mode == "overlap":
        assert hits > RUNS // 4, hits  # prepared drafts carry a good share of the mass
    p_values = {j: conditional_p_value(hf_target, params, samples, j) for j in POSITIONS}
    assert min(p_values.values()) > ALPHA, (p_values, hits)
    assert generator.target.num_sessions == 0


PENALISED = SamplingParams(temperature=1.0, presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.4,
                           min_p=0.02)


def penalised(logits: torch.Tensor, prefix: tuple[int, ...]) -> torch.Tensor:
    """vLLM's penalties, written out: repetition over the prompt and the generated tokens, then frequency and
    presence over the generated ones."""
    counts = torch.bincount(torch.tensor(prefix, dtype=torch.long), minlength=logits.numel()).float()
    seen = counts > 0
    seen[PROMPT] = True
    r = PENALISED.repetition_penalty
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - PENALISED.frequency_penalty * counts - PENALISED.presence_penalty * (counts > 0).float()


def test_penalised_sampling_keeps_the_penalised_targets_law(generator, hf_target, oracle):
    """The penalties at a verify's draft positions count the drafts before them: with a draft that knows
    nothing of them, the output law is the penalised target's."""
    samples, _ = sample_runs(generator.target, oracle, PENALISED, RUNS, "alone")
    p_values = {j: conditional_p_value(hf_target, PENALISED, samples, j, penalised) for j in POSITIONS}
    assert min(p_values.values()) > ALPHA, p_values


@pytest.mark.parametrize("drafter", ["oracle", "engine"])
def test_constrained_sampling_keeps_the_masked_targets_law(generator, hf_target, oracle, drafter):
    """A regex: drafts it forbids are cut, forced ones drafted; the output law is the target's masked by it.
    engine: the draft engine draws each draft from its own q masked by the grammar, and sends that q."""
    grammar = GrammarSpec(kind="regex", value="[a-z ]{1,60}")
    grammars = Grammars((generator.target_dir / "tokenizer.json").read_text(), generator.target.vocab_size,
                        generator.target.eos_token_ids)
    params = SETTINGS["t1"]
    draft = oracle if drafter == "oracle" else generator.draft
    samples, _ = sample_runs(generator.target, draft, params, RUNS, "alone", grammar, grammars)

    def masked(logits, prefix):
        matcher = grammars.matcher(grammar)
        assert matcher.consume_tokens(list(prefix)), prefix
        allowed = torch.from_numpy(unpack_rows(matcher.compute_bitmask()[: 4 * words(logits.numel())],
                                               logits.numel())[0])
        return logits.masked_fill(~allowed, float("-inf"))

    p_values = {j: conditional_p_value(hf_target, params, samples, j, masked) for j in POSITIONS}
    assert min(p_values.values()) > ALPHA, p_values


def test_the_check_sees_a_residual_drawn_from_p(generator, hf_target, oracle, monkeypatch):
    """The power of the check: a recovered token drawn from p (not max(0, p - q)) favours the drafts'
    tokens, and the same test at the same size rejects it."""
    def biased(probs, drafts, generator, q=None):
        k = drafts.numel()
        rows = torch.arange(k)
        u = torch.rand(k, generator=generator)
        q_draft = q[rows, drafts] if q is not None else torch.ones(k)
        accepted = int((u * q_draft < probs[rows, drafts]).int().cumprod(0).sum())
        return accepted, int(torch.multinomial(probs[accepted], 1, generator=generator))

    monkeypatch.setattr(acceptance, "accept_sampled", biased)
    params = SETTINGS["t1"]
    samples, _ = sample_runs(generator.target, oracle, params, RUNS, "batched")
    p_value = min(conditional_p_value(hf_target, params, samples, j) for j in POSITIONS)
    assert p_value < ALPHA, p_value


def test_seeded_sampled_requests_repeat_alone_and_batched(generator):
    """The real draft engine samples its drafts (q travels with them); a seed fixes the output, whichever
    sessions share the batches."""
    requests = [GenerationRequest(prompt_ids=[4 + i, 5, 6], max_new_tokens=16, num_draft_tokens=3, ignore_eos=True,
                                  sampling=SamplingParams(temperature=0.7 + 0.1 * i, top_k=40 * (i % 2), seed=i))
                for i in range(6)]
    alone = [generator.generate(r).token_ids for r in requests]
    start = threading.Barrier(len(requests))

    def one(request):
        start.wait()
        return generator.generate(request).token_ids

    with ThreadPoolExecutor(len(requests)) as pool:
        assert list(pool.map(one, requests)) == alone
    assert generator.draft.num_sessions == 0


# -- the draft's q ------------------------------------------------------------------------------------


def test_q_is_the_tempered_head_under_top_k_top_p_and_the_cut():
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.0, -1.0, -2.0, -9.0]])
    plain = DraftSampler(temperature=0.5, top_k=0, top_p=1.0, key=0)
    ids, probs = draft_q(logits, [plain], top_n=0)
    torch.testing.assert_close(probs[0], torch.softmax(logits[0] / 0.5, -1).sort(descending=True).values)
    ids, probs = draft_q(logits, [plain], top_n=3)  # the cut: the 3 likeliest, renormalised
    assert ids[0].tolist() == [0, 1, 2]
    torch.testing.assert_close(probs[0], torch.softmax(logits[0, :3] / 0.5, -1))
    # top-k 4, then top-p 0.9 of that renormalised mass (the target's order), then the cut to 6
    both = DraftSampler(temperature=1.0, top_k=4, top_p=0.9, key=0)
    ids, probs = draft_q(logits, [both], top_n=6)
    p = torch.softmax(logits[0, :4], -1)  # top-k 4
    keep = int(((torch.cumsum(p, 0) - p) < 0.9).sum())
    assert (probs[0] > 0).sum() == keep and ids[0, :keep].tolist() == list(range(keep))
    torch.testing.assert_close(probs[0, :keep], p[:keep] / p[:keep].sum())


def test_draws_follow_q():
    """Over many keys, the inverse-CDF draws of one row follow its probabilities (chi-square, p > 1e-4)."""
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125, 0.0]])
    sampler = DraftSampler.for_request(SamplingParams(temperature=1.0, seed=5))
    n = 4000
    counts = Counter(int(draw(probs, [sampler.uniform(position)])[0]) for position in range(n))
    assert set(counts) <= {0, 1, 2, 3}
    stat = sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(probs[0].tolist()) if p)
    assert float(torch.special.gammaincc(torch.tensor(1.5), torch.tensor(stat / 2))) > 1e-4
    assert DraftSampler.for_request(SamplingParams(temperature=1.0, seed=5)).uniform(7) == sampler.uniform(7)


def test_the_targets_draw_follows_its_distribution():
    """acceptance.sample (the recovered and bonus tokens, the prefill's first): over one seeded generator,
    its draws follow an unnormalised row with zeros (chi-square, p > 1e-4), never a token of mass 0, and the
    same seed repeats them."""
    probs = torch.tensor([0.0, 0.4, 0.0, 1.0, 0.6, 0.0, 0.0001])  # sums to 2.0001
    n = 6000
    draws = [acceptance.sample(probs, torch.Generator().manual_seed(1)) for _ in range(3)]
    assert len(set(draws)) == 1
    generator = torch.Generator().manual_seed(2)
    counts = torch.bincount(torch.tensor([acceptance.sample(probs, generator) for _ in range(n)]), minlength=7)
    assert chi_square_p(counts, probs / probs.sum()) > 1e-4


def test_a_batch_gives_each_row_the_q_it_gets_alone():
    """Rows with and without top-k or top-p in one batch: each row's q is its own."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    samplers = [DraftSampler(1.0, 0, 0.8, 1), DraftSampler(1.0, 5, 0.9, 2), DraftSampler(0.7, 0, 1.0, 3)]
    ids, probs = draft_q(logits, samplers, top_n=8)
    for row, sampler in enumerate(samplers):
        alone_ids, alone_probs = draft_q(logits[row : row + 1], [sampler], top_n=8)
        assert torch.equal(ids[row], alone_ids[0])
        torch.testing.assert_close(probs[row], alone_probs[0])


def test_the_target_refuses_a_q_that_does_not_fit_its_drafts(generator):
    target = generator.target
    first = target.prefill("bad-q", [5, 6, 7], SamplingParams(temperature=1.0, seed=0)).token
    fine = DraftProbs([3, 4], [0.5, 0.5])
    for drafts, q, message in [
        ([3, 4], [fine], "1 distributions for 2 drafts"),
        ([9], [fine], "outside the support"),
        ([3], [DraftProbs([3, 10**6], [0.5, 0.5])], "outside the vocabulary"),
        ([3], [DraftProbs([3, 4], [0.5, -0.5])], "finite and positive"),
        ([3], [DraftProbs([3, 3], [0.5, 0.5])], "repeats an id"),
    ]:
        with pytest.raises(InvalidRequest, match=message):
            target.verify("bad-q", first, drafts, q=q)
    assert target.verify("bad-q", first, [3], q=[fine]).bonus is not None  # the session goes on
    assert target.release("bad-q")
