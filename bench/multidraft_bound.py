"""What any lossless rule could accept from several draws of the draft's q, and the tree ceiling that sets.

    python bench/multidraft_bound.py [--demo | --target DIR --draft DIR --prompts FILE] [-n 32]
                                     [--temperature 1,0.7] [--draws 8] [--nodes 16] [--depth 5]

A sampled tree's siblings are several draws from the draft's q at one position, and the target keeps at most
one of them. Whatever rule picks it (sequential rejection without replacement, as the target does; SpecTr's
optimal transport; any other), the token it outputs must still follow p, so with S the set of draws:

    P(some draw accepted) = sum_x P(output x, x in S) <= sum_x min(p(x), P(x in S))

an upper bound on every lossless rule, for draws with replacement (P(x in S) = 1 - (1 - q(x))^k) and
without (the draft's way; P(x in S) estimated from sampled prefixes of the draws, each prefix's chance of x
at the next draw added exactly, so the estimate is smooth where min() would bias a raw count). This script
runs a seeded chain in-process (both engines here, the gate off, q not cut) and records the target's p and
the draft's whole q at every verified draft. Per temperature it prints:

    sequential   what the target's rule takes: a first draw sum min(p, q), a second after the first was
                 rejected (exact, over which first draw was rejected)
    bound k      the bound above for k draws, with and without replacement
    ceiling      the most a round commits with the best tree of N nodes where the first k children of a node
                 are accepted together at most bound k (tree_acceptance.ceiling with those as draw rates,
                 the same at every depth), against the chain's first draws: no rule or shape gets past it
                 with these draws
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from q_truncation import Recorder
from tree_acceptance import add_pair_arguments, ceiling, pair_and_prompts

from tandem.params import GenerationRequest, SamplingParams
from tandem_tools.inprocess import InProcessGenerator


class RowRecorder(Recorder):
    """(p, q) over their joint support at every draft the target's rule verified."""

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[torch.Tensor, torch.Tensor]] = []

    def reached(self, probs: torch.Tensor, q: torch.Tensor) -> None:
        for p_i, q_i in zip(probs, q, strict=True):
            support = ((p_i > 1e-7) | (q_i > 0)).nonzero()[:, 0]
            self.rows.append((p_i[support].double(), q_i[support].double()))


def record(generator: InProcessGenerator, prompts: list[list[int]], temperature: float, k: int, max_new: int
           ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(p, q) at every verified draft of seeded K-chains, q not cut."""
    generator.draft.q_top_n = 0
    with RowRecorder() as recorder:
        for i, prompt in enumerate(prompts):
            generator.generate(GenerationRequest(prompt_ids=prompt, max_new_tokens=max_new, num_draft_tokens=k,
                                                 ignore_eos=True, sampling=SamplingParams(temperature=temperature, seed=i)))
    return recorder.rows


def sequential(p: torch.Tensor, q: torch.Tensor) -> tuple[float, float]:
    """The target's rule: a first draw accepted w.p. sum min(p, q); a second, drawn from q without the
    rejected first and tried against the residual r = max(0, p - q) / its mass, averaged over the first."""
    first = float(torch.minimum(p, q).sum())
    rejected = (q - p).clamp(min=0)  # P(first draw x and it was rejected)
    residual = (p - q).clamp(min=0)
    if residual.sum() <= 0:
        return first, 0.0
    residual /= residual.sum()
    firsts = (rejected > 1e-9 * rejected.sum()).nonzero()[:, 0]
    scale = 1 / (1 - q[firsts]).clamp(min=1e-12)  # q without x, renormalised (residual(x) = 0 there)
    second = torch.minimum(q[None] * scale[:, None], residual[None]).sum(1)
    return first, float((rejected[firsts] * second).sum() / rejected[firsts].sum())


def inclusion(q: torch.Tensor, draws: int, samples: int, generator: torch.Generator) -> torch.Tensor:
    """[draws, V]: row k-1 is P(x among the first k draws from q without replacement), estimated over
    `samples` sampled orders (Gumbel top-k), each adding its prefix's exact chance of x at the next draw."""
    support = (q > 0).nonzero()[:, 0]
    qs = q[support]
    noise = torch.empty(samples, qs.numel(), dtype=q.dtype).exponential_(generator=generator).log()
    order = (qs.log()[None] - noise).topk(min(draws, qs.numel()), 1).indices  # [S, draws]
    removed = torch.cat([torch.zeros(samples, 1, dtype=q.dtype), qs[order].cumsum(1)], 1)  # before each draw
    rank = torch.full((samples, qs.numel()), draws, dtype=torch.long)
    rank.scatter_(1, order, torch.arange(order.shape[1]).expand(samples, -1))
    out = torch.zeros(draws, q.numel(), dtype=q.dtype)
    total = torch.zeros_like(qs)
    for j in range(draws):
        if j < order.shape[1]:  # draw j: x not among draws 0..j-1, then q(x) / what they left
            total = total + ((rank >= j) * (qs[None] / (1 - removed[:, j:j + 1]).clamp(min=1e-12))).mean(0)
        out[j, support] = total.clamp(max=1)
    return out


def bounds(rows: list[tuple[torch.Tensor, torch.Tensor]], draws: int, samples: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    firsts, seconds, iid, wor = [], [], [], []
    for p, q in rows:
        first, second = sequential(p, q)
        firsts.append(first)
        seconds.append(second * (1 - first))  # weighed by the chance the first is rejected
        iid.append([float(torch.minimum(p, 1 - (1 - q) ** k).sum()) for k in range(1, draws + 1)])
        wor.append(torch.minimum(p[None], inclusion(q, draws, samples, generator)).sum(1).tolist())
    first = statistics.fmean(firsts)
    return {
        "verified_drafts": len(rows),
        "first_draw": round(first, 4),
        "second_draw": round(statistics.fmean(seconds) / (1 - first), 4) if first < 1 else 0.0,
        "bound_with_replacement": [round(statistics.fmean(column), 4) for column in zip(*iid, strict=True)],
        "bound_without_replacement": [round(statistics.fmean(column), 4) for column in zip(*wor, strict=True)],
    }


def as_rates(cumulative: list[float], depth: int) -> dict[tuple[int, int], float]:
    """Cumulative acceptance of a node's first k children -> the j-th child's rate once 0..j-1 failed."""
    rates, before = {}, 0.0
    for j, reach in enumerate(cumulative):
        rate = (reach - before) / (1 - before) if before < 1 else 0.0
        rates.update({(d, j): max(rate, 0.0) for d in range(1, depth + 1)})
        before = max(before, reach)
    return rates


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_pair_arguments(p, 32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("-k", type=int, default=3, help="the chain that visits the positions")
    p.add_argument("--temperature", default="1,0.7")
    p.add_argument("--draws", type=int, default=8, help="draws per node bounded")
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--samples", type=int, default=256, help="sampled orders per position (without replacement)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    target, draft, prompts = pair_and_prompts(p, args)
    torch.set_num_threads(1)
    generator = InProcessGenerator(target, draft, draft_cost=0)
    results = []
    for temperature in (float(t) for t in args.temperature.split(",")):
        row = {"temperature": temperature, **bounds(record(generator, prompts, temperature, args.k, args.max_new_tokens),
                                                    args.draws, args.samples, 0)}
        rates = as_rates(row["bound_without_replacement"], args.depth)
        row["chain"] = round(ceiling({key: r for key, r in rates.items() if key[1] == 0}, args.depth, args.depth), 3)
        row["best_tree"] = round(ceiling(rates, args.nodes, args.depth), 3)
        row["over_chain"] = round(row["best_tree"] / row["chain"], 3)
        results.append(row)
        print(f"temperature {temperature:g}, {row['verified_drafts']} verified drafts: the target's rule takes a first "
              f"draw {row['first_draw']:.3f}, a second {row['second_draw']:.3f}; any rule, k = 1..{args.draws} draws: "
              f"with replacement {' '.join(f'{b:.3f}' for b in row['bound_with_replacement'])}, without "
              f"{' '.join(f'{b:.3f}' for b in row['bound_without_replacement'])}; ceiling: chain {row['chain']:.2f}, "
              f"best tree of {args.nodes} {row['best_tree']:.2f} ({row['over_chain']:.2f}x)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
