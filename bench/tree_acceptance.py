"""Mean acceptance length of draft trees against the chain at the same depth, in-process, the gates off.

    python bench/tree_acceptance.py [--demo | --target DIR --draft DIR --prompts FILE] [-n 16]
                                    [--temperature 0,0.7,1] [--nodes 16] [--depth 5] [--top-k 2,4,8]

Both engines in this process (tandem_tools.inprocess), every round drafting the request's shape (no
acceptance gate, no tree policy): one seeded generation per held-out prompt for the chain of K = depth
and for a tree of N nodes at each top-k. Mean acceptance length is tokens committed per verify round,
bonus included (tandem.stats), over all the prompts' rounds; the ratio is the tree's over the chain's
(issue 22 asks for 1.25x at N=16 where the chain is not near its ceiling).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--demo", action="store_true", help="the demo pair (default without --target)")
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--prompts", help="one prompt per line, or .jsonl with prompt / prompt_ids (default: the demo's held-out prompts)")
    p.add_argument("--num-prompts", "-n", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", default="0,0.7,1")
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--top-k", default="2,4,8")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if args.target is None:
        from tandem_tools.demo import ensure_demo

        demo = ensure_demo()
        args.target, args.draft = str(demo / "target"), str(demo / "draft")
        args.prompts = args.prompts or str(demo / "prompts.jsonl")
    if args.draft is None or args.prompts is None:
        p.error("--target needs --draft and --prompts")
    items = load_prompts(Path(args.prompts))[: args.num_prompts]  # as `tandem bench --prompts` reads them
    if any(isinstance(item, str) for item in items):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.target)
        items = [item if isinstance(item, list) else tokenizer(item)["input_ids"] for item in items]
    prompts = items
    generator = InProcessGenerator(args.target, args.draft, draft_cost=0, tree_policy=False)
    shapes = [(f"chain K={args.depth}", None)] + [
        (f"tree N={args.nodes} top-k {k}", TreeParams(nodes=args.nodes, depth=args.depth, top_k=int(k)))
        for k in args.top_k.split(",")]
    rows = []
    print("| temperature | shape | mean acceptance length | over the chain |\n|---:|---|---:|---:|")
    for temperature in (float(t) for t in args.temperature.split(",")):
        chain = None
        for name, tree in shapes:
            tau = measure(generator, prompts, tree, args.depth, temperature, args.max_new_tokens)
            chain = chain or tau
            rows.append({"temperature": temperature, "shape": name, "mean_acceptance_length": round(tau, 3),
                         "over_chain": round(tau / chain, 3)})
            print(f"| {temperature:g} | {name} | {tau:.2f} | {tau / chain:.2f}x |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
