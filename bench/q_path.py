"""What a sampled draft's q costs the CPU on its way, per round: the draft's read-back of its drafts and q
(draft_server/rollout.py: read_rollout), q into wire messages and their bytes, the target's reading of them
(tandem/convert.py), the dense rows (target_server/acceptance.py: dense_q) and the acceptance rule with its
recovered or bonus draw (accept). Best of 5 passes, microseconds per round.

    python bench/q_path.py [--k 3] [--top-n 256] [--vocab 2048] [--temperature 1]

Results: docs/benchmarks.md, "Sampling".
"""

from __future__ import annotations

import argparse
import time

import torch

from draft_server.rollout import read_rollout
from tandem.convert import draft_probs_from_pb, draft_probs_to_pb
from tandem.params import SamplingParams
from tandem.v1 import common_pb2
from target_server.acceptance import accept, dense_q


def best_us(fn, n: int = 500, passes: int = 5) -> float:
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n)
    return 1e6 * best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--top-n", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    k, n, vocab = args.k, args.top_n, args.vocab
    source = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(vocab, generator=source)[:n] for _ in range(k)])[None]  # [1, K, N]
    probs = torch.softmax(torch.randn(1, k, n, generator=source), -1)
    q = (ids, probs, (probs > 0).sum(-1))
    drafts = ids[:, :, 0]  # each draft in its q's support
    logits = torch.randn(k + 1, vocab, generator=source)
    params = SamplingParams(temperature=args.temperature, seed=0)
    generator = torch.Generator().manual_seed(1)

    drafted, qs, _ = read_rollout(drafts, q)
    wire = [common_pb2.DraftProbs.FromString(m.SerializeToString()) for m in draft_probs_to_pb(qs)]
    dense = dense_q(draft_probs_from_pb(wire), drafted, vocab)
    stages = {
        "draft: read_rollout": lambda: read_rollout(drafts, q),
        "draft: to wire": lambda: draft_probs_to_pb(qs),
        "target: from wire + dense_q": lambda: dense_q(draft_probs_from_pb(wire), drafted, vocab),
        "target: accept": lambda: accept(logits, torch.tensor(drafted), params, generator, dense),
    }
    times = {name: best_us(fn) for name, fn in stages.items()}
    print(f"K={k} N={n} V={vocab} T={args.temperature}: q {sum(m.ByteSize() for m in wire)} B a round")
    print("| stage | us a round |\n|---|---:|")
    for name, us in times.items():
        print(f"| {name} | {us:.1f} |")
    print(f"| all | {sum(times.values()):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
