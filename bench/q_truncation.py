"""What cutting the draft's q to its N likeliest tokens costs in acceptance, and what it saves on the wire.

    python bench/q_truncation.py [--demo | --target DIR --draft DIR] [-n 32] [--top-n 1,4,8,16,32,64,0]

Both engines in this process (tandem_tools.inprocess), the acceptance gate off, K drafts every round, one
seeded generation per held-out prompt, for each temperature and each N (0: the whole draft vocabulary;
1: the draft's argmax, the rule before speculative sampling). Per verified draft it records:

    E[accept]     sum_x min(p(x), q(x)): the chance that a draft drawn from q is accepted, given the
                  context it was verified in (exact, from the target's p and the q sent; less noisy
                  than counting the accepted drafts)
    accepted      the drafts the target did accept, over those it verified
    q bytes       what q costs on the wire per draft: its support ids (varints) + 4 bytes per probability

and per configuration the mean acceptance length (tokens per verify round, bonus included).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from tandem.params import GenerationRequest, SamplingParams
from tandem.traffic import ids_size
from tandem_tools.inprocess import InProcessGenerator
from target_server import acceptance


class Recorder:
    """Wraps the acceptance rule while installed (`with recorder:`): E[accept] of every verified draft that
    came with q; a subclass keeps something else of those drafts by overriding `reached`."""

    def __init__(self):
        self.expected: list[float] = []
        self._rule = acceptance.accept_sampled

    def __enter__(self) -> Recorder:  # noqa: PYI034 (typing.Self needs 3.11)
        acceptance.accept_sampled = self
        return self

    def __exit__(self, *exc) -> None:
        acceptance.accept_sampled = self._rule

    def reached(self, probs: torch.Tensor, q: torch.Tensor) -> None:
        """The target's p [n, V] and the draft's q [n, V] of the n drafts the rule verified."""
        self.expected += torch.minimum(probs, q).sum(-1).tolist()

    def __call__(self, probs, drafts, generator, q=None):
        k = drafts.numel()
        if q is not None and k:
            # a draft is verified only if the ones before it were accepted: count what the rule reaches
            accepted, bonus = self._rule(probs, drafts, generator, q)
            reached = min(k, accepted + 1)
            self.reached(probs[:reached], q[:reached])
            return accepted, bonus
        return self._rule(probs, drafts, generator, q)


def measure(generator: InProcessGenerator, prompts: list[list[int]], temperature: float, top_n: int, k: int,
            max_new: int, seed: int) -> dict:
    generator.draft.q_top_n = top_n
    recorder = Recorder()
    q_bytes: list[int] = []
    propose = generator.draft.propose

    def counting_propose(*args, **kwargs):
        drafts = propose(*args, **kwargs)
        q_bytes.extend(ids_size(d.ids) + 4 * len(d.probs) for d in drafts.q or ())
        return drafts

    generator.draft.propose = counting_propose
    rounds = drafted = accepted = 0
    started = time.perf_counter()
    try:
        with recorder:
            for i, prompt in enumerate(prompts):
                request = GenerationRequest(prompt_ids=prompt, max_new_tokens=max_new, num_draft_tokens=k,
                                            ignore_eos=True, sampling=SamplingParams(temperature=temperature, seed=seed + i))
                stats = generator.generate(request).stats
                rounds += stats["num_rounds"]
                drafted += stats["num_draft_tokens"]
                accepted += stats["num_accepted_tokens"]
    finally:
        generator.draft.propose = propose
    verified = len(recorder.expected)
    return {
        "temperature": temperature, "top_n": top_n, "K": k,
        "expected_acceptance": round(statistics.fmean(recorder.expected), 4) if verified else 0.0,
        "accepted_per_verified_draft": round(accepted / verified, 4) if verified else 0.0,
        "acceptance_per_draft": round(accepted / drafted, 4) if drafted else 0.0,
        "mean_acceptance_length": round((rounds + accepted) / rounds, 4) if rounds else 0.0,
        "q_bytes_per_draft": round(statistics.fmean(q_bytes), 1) if q_bytes else 0.0,
        "q_bytes_per_round": round(sum(q_bytes) / rounds, 1) if rounds else 0.0,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--demo", action="store_true", help="the demo pair (default without --target)")
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--num-prompts", "-n", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--temperature", default="0.7,1")
    p.add_argument("--top-n", default="1,4,8,16,32,64,0", help="0: the whole draft vocabulary")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.target:
        target, draft = Path(args.target), Path(args.draft)
        from transformers import AutoTokenizer

        from tandem_tools.demo import heldout_prompts, split_files, stdlib_files

        tokenizer = AutoTokenizer.from_pretrained(target)
        prompts = [x["prompt_ids"] for x in heldout_prompts(tokenizer, split_files(stdlib_files(), 10)[1],
                                                             args.num_prompts, 48, args.seed)]
    else:
        from tandem_tools.demo import ensure_demo, load_prompts

        demo = ensure_demo()
        target, draft = demo / "target", demo / "draft"
        prompts = [x["prompt_ids"] for x in load_prompts(demo)][: args.num_prompts]
    generator = InProcessGenerator(target, draft, draft_cost=0)
    vocab = generator.draft.config.draft_vocab_size
    rows = []
    print("| temperature | N | E[accept] per verified draft | accepted / verified | acceptance per draft "
          "| mean acceptance length | q bytes per draft | q bytes per round |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for temperature in (float(t) for t in args.temperature.split(",")):
        for top_n in (int(n) for n in args.top_n.split(",")):
            row = measure(generator, prompts, temperature, top_n, args.k, args.max_new_tokens, args.seed)
            rows.append(row)
            label = f"all {vocab}" if top_n == 0 else ("1 (argmax)" if top_n == 1 else str(top_n))
            print(f"| {temperature:g} | {label} | {row['expected_acceptance']:.3f} | {row['accepted_per_verified_draft']:.3f} "
                  f"| {row['acceptance_per_draft']:.3f} | {row['mean_acceptance_length']:.2f} "
                  f"| {row['q_bytes_per_draft']:.0f} | {row['q_bytes_per_round']:.0f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
