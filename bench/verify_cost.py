"""What a verify costs the target against a plain decode, batch by batch: the bound on what drafting can win
under load. With two waves a step verifies half the running requests with K drafts each while the draft
proposes for the other half, so at n requests drafting commits about n/2 x (mean acceptance length) tokens
per verify(n/2, K) where target-only commits n per decode(n): where the verify's cost grows with its tokens
(a CPU), drafting cannot win at high load however well the two services overlap; where it stays flat (a GPU's
memory-bound forward), it does.

    python bench/verify_cost.py [--target DIR] [--device cpu] [--batches 1,8,16] [--k 0,2,5] [--reps 30]

Prints the median ms of one target batch of n sessions each verifying K drafts (K=0: a decode), in-process,
eager, with the sessions' prompts from the demo pair's held-out prompts.
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

from tandem.params import SamplingParams
from tandem.protocol import Prefill, Verify
from tandem_tools.demo import default_demo_dir, ensure_demo
from target_server.engine import TargetEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="target checkpoint (default: the demo pair's, built if missing)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="1,8,16")
    parser.add_argument("--k", default="0,2,5")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the target's core in the services)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    demo = ensure_demo(default_demo_dir())
    engine = TargetEngine(args.target or demo / "target", device=args.device)
    batches, ks = [int(b) for b in args.batches.split(",")], [int(k) for k in args.k.split(",")]
    prompts = [json.loads(line)["prompt_ids"] for line in (demo / "prompts.jsonl").open()]
    n_max = max(batches)
    prompts = (prompts * (1 + n_max // len(prompts)))[:n_max]
    greedy = SamplingParams()
    prefilled = engine.run([Prefill(f"s{i}", p, greedy, want_features=False, max_new_tokens=4096)
                            for i, p in enumerate(prompts)])
    token = {f"s{i}": r.token for i, r in enumerate(prefilled)}
    print("| sessions | K | tokens | ms per batch | vs a decode of the same sessions |\n|---:|---:|---:|---:|---:|")
    for n in batches:
        decode = None
        for k in ks:
            times = []
            for _ in range(args.reps):
                steps = [Verify(f"s{i}", token[f"s{i}"], [token[f"s{i}"]] * k, k > 0) for i in range(n)]
                start = time.perf_counter()
                results = engine.run(steps)
                times.append(time.perf_counter() - start)
                for i, r in enumerate(results):
                    token[f"s{i}"] = r.bonus
            ms = statistics.median(times) * 1e3
            decode = ms if k == 0 else decode
            ratio = f"{ms / decode:.2f}x" if decode else "-"
            print(f"| {n} | {k} | {n * (k + 1)} | {ms:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
