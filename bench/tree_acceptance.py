"""Mean acceptance length of draft trees against the chain at the same depth, in-process, the gates off.

    python bench/tree_acceptance.py [--demo | --target DIR --draft DIR --prompts FILE] [-n 16]
                                    [--temperature 0,0.7,1] [--nodes 16] [--depth 5] [--top-k 2,4,8]

Both engines in this process (tandem_tools.inprocess), every round drafting the request's shape (no
acceptance gate, no tree policy): one seeded generation per held-out prompt for the chain of K = depth
and for a tree of N nodes at each top-k. Mean acceptance length is tokens committed per verify round,
bonus included (tandem.stats), over all the prompts' rounds; the ratio is the tree's over the chain's
(the aim: 1.25x at N=16 where the chain is not near its ceiling).

At a temperature above 0 it also prints what the trees' draws were worth: a_{d,j}, how often the j-th child
drawn at depth d was accepted once tried (its parent reached, children 0..j-1 rejected; the draft's
SiblingRates, counted over that temperature's trees), and the ceiling they put on any tree: with those rates
a node is reached with probability P(parent) (1 - a_{d,0}) ... (1 - a_{d,j-1}) a_{d,j}, a round commits
1 + the sum of its nodes' probabilities, and the best tree of N nodes keeps the N likeliest (`ceiling`; the
chain is the first children alone). The draft grows its sampled trees by the same worths, so the measured
tree sits near that ceiling, and the ceiling over the chain is what any shape can win with these draws.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from draft_server.tree import SiblingRates
from tandem.params import GenerationRequest, SamplingParams, TreeParams
from tandem.stats import mean_acceptance_length
from tandem_tools.inprocess import InProcessGenerator
from tandem_tools.profile import load_prompts


def measure(generator: InProcessGenerator, prompts: list[list[int]], tree: TreeParams | None, depth: int,
            temperature: float, max_new: int) -> float:
    accepted = rounds = 0
    for i, prompt in enumerate(prompts):
        result = generator.generate(GenerationRequest(
            prompt_ids=prompt, max_new_tokens=max_new, num_draft_tokens=depth, tree=tree, ignore_eos=True,
            sampling=SamplingParams(temperature=temperature, seed=i)))
        accepted += result.stats["num_accepted_tokens"]
        rounds += result.stats["num_rounds"]
    return mean_acceptance_length(accepted, rounds)


def ceiling(rates: dict[tuple[int, int], float], nodes: int, depth: int) -> float:
    """Tokens a round commits with the best tree of `nodes` nodes, at most `depth` deep, where the j-th child
    drawn at depth d is accepted with probability rates[d, j] once tried (0 where not measured)."""
    draws = 1 + max((j for _, j in rates), default=0)
    share: dict[tuple[int, int], float] = {}  # P(children 0..j-1 rejected) P(j accepted), once per (d, j)
    for d in range(1, depth + 1):
        rejected = 1.0
        for j in range(draws):
            share[d, j] = rejected * rates.get((d, j), 0.0)
            rejected *= 1 - rates.get((d, j), 0.0)
    frontier = [(-share[1, 0], 1, 0, 1.0)]  # (-probability, depth, j, the parent's probability)
    total = 0.0
    for _ in range(nodes):
        if not frontier:
            break
        value, d, j, reach = heapq.heappop(frontier)
        total -= value
        if d < depth:  # its first child
            heapq.heappush(frontier, (value * share[d + 1, 0], d + 1, 0, -value))
        if j + 1 < draws:  # its next sibling
            heapq.heappush(frontier, (-reach * share[d, j + 1], d, j + 1, reach))
    return 1.0 + total


def draw_rates(generator: InProcessGenerator) -> dict[tuple[int, int], float]:
    """The draft's measured a_{d,j} (SiblingRates' counts, without its prior)."""
    counts = generator.draft.sibling_rates
    return {key: counts.accepted.get(key, 0.0) / tried for key, tried in counts.tried.items() if tried}


def add_pair_arguments(parser: argparse.ArgumentParser, num_prompts: int) -> None:
    """The pair and its prompts, as pair_and_prompts reads them."""
    parser.add_argument("--demo", action="store_true", help="the demo pair (default without --target)")
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("--prompts", help="one prompt per line, or .jsonl with prompt / prompt_ids (default: the demo's held-out prompts)")
    parser.add_argument("--num-prompts", "-n", type=int, default=num_prompts)


def pair_and_prompts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, str, list[list[int]]]:
    """--target/--draft/--prompts/--num-prompts (the demo pair and its held-out prompts without --target) ->
    the pair's directories and the prompts' token ids, read as `tandem bench --prompts` reads them."""
    if args.target is None:
        from tandem_tools.demo import ensure_demo

        demo = ensure_demo()
        args.target, args.draft = str(demo / "target"), str(demo / "draft")
        args.prompts = args.prompts or str(demo / "prompts.jsonl")
    if args.draft is None or args.prompts is None:
        parser.error("--target needs --draft and --prompts")
    items = load_prompts(Path(args.prompts))[: args.num_prompts]
    if any(isinstance(item, str) for item in items):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.target)
        items = [item if isinstance(item, list) else tokenizer(item)["input_ids"] for item in items]
    return args.target, args.draft, items


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_pair_arguments(p, 16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", default="0,0.7,1")
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--top-k", default="2,4,8")
    p.add_argument("--q-top-n", type=int, help="sampled drafts: cut q to this many tokens (0: the whole q; default: "
                                               "the draft's, as the servers run it)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    target, draft, prompts = pair_and_prompts(p, args)
    generator = InProcessGenerator(target, draft, draft_cost=0, tree_policy=False)
    if args.q_top_n is not None:
        generator.draft.q_top_n = args.q_top_n
    shapes = [(f"chain K={args.depth}", None)] + [
        (f"tree N={args.nodes} top-k {k}", TreeParams(nodes=args.nodes, depth=args.depth, top_k=int(k)))
        for k in args.top_k.split(",")]
    rows = []
    print("| temperature | shape | mean acceptance length | over the chain |\n|---:|---|---:|---:|")
    ceilings = []
    for temperature in (float(t) for t in args.temperature.split(",")):
        chain = None
        generator.draft.sibling_rates = SiblingRates()  # this temperature's draws only
        for name, tree in shapes:
            tau = measure(generator, prompts, tree, args.depth, temperature, args.max_new_tokens)
            chain = chain or tau
            rows.append({"temperature": temperature, "shape": name, "mean_acceptance_length": round(tau, 3),
                         "over_chain": round(tau / chain, 3)})
            print(f"| {temperature:g} | {name} | {tau:.2f} | {tau / chain:.2f}x |", flush=True)
        if temperature > 0:
            rates = draw_rates(generator)
            best = ceiling(rates, args.nodes, args.depth)
            alone = ceiling({key: rate for key, rate in rates.items() if key[1] == 0}, args.depth, args.depth)  # first draws
            ceilings.append({"temperature": temperature, "rates": {f"{d},{j}": round(r, 3) for (d, j), r in sorted(rates.items())},
                             "chain": round(alone, 3), "best_tree": round(best, 3), "over_chain": round(best / alone, 3)})
    for row in ceilings:
        by_draw = ", ".join(f"draw {j}: " + " ".join(f"{row['rates'].get(f'{d},{j}', 0):.2f}" for d in range(1, args.depth + 1))
                            for j in range(3))
        print(f"temperature {row['temperature']:g}: a_(depth 1..{args.depth}, draw j) {by_draw}; with these draws a "
              f"chain commits {row['chain']:.2f} a round and the best tree of {args.nodes} nodes {row['best_tree']:.2f} "
              f"({row['over_chain']:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "ceilings": ceilings}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
