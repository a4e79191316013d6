"""`tandem train-draft`: the command line of the EAGLE-3 trainer (draft_server/train.py).

Kept apart from the trainer so that `tandem` can register the subcommand without importing torch (the
coordinator's image has none); the trainer is imported when the command runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tandem.dtypes import DTYPE_NAMES


def cmd_train_draft(args: argparse.Namespace) -> int:
    from draft_server.train import train_draft

    parallel = None
    if args.parallel_drafting:
        from draft_server.train_parallel import ParallelDrafting

        parallel = ParallelDrafting(num_depths=args.num_depths, num_layers=args.num_layers,
                                    mask_token_id=args.mask_token_id, down_sample_ratio=args.down_sample_ratio,
                                    seed=args.seed)
    texts = chats = None
    if args.data:
        texts = [Path(path).read_text(encoding="utf-8", errors="replace") for path in args.data]
    if args.chats:
        chats = read_chats(args.chats)
    out = train_draft(
        args.target,
        texts,
        args.out,
        steps=args.steps,
        epochs=args.epochs,
        seconds=args.seconds,
        ttt_steps=args.ttt_steps,
        lr=args.lr,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        draft_vocab_size=args.draft_vocab_size,
        num_sequences=args.num_sequences,
        self_distill=True if args.self_distill else None,
        chats=chats,
        seed=args.seed,
        device=args.device,
        target_dtype=args.dtype,
        progress=not args.quiet,
        parallel=parallel,
    )
    print(f"wrote {out} (reference layout, no embed_tokens: use it with --target {args.target} --draft {out})")
    return 0


def read_chats(path: str | Path) -> list[list[dict]]:
    """A JSONL file of conversations: each line {"messages": [{"role": ..., "content": ...}, ...]} (the
    OpenAI chat format) or the list itself; the last message is the one the target answers."""
    chats = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        messages = item.get("messages") if isinstance(item, dict) else item
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError(f"{path}:{number}: expected {{\"messages\": [{{\"role\": ..., \"content\": ...}}]}}")
        chats.append(messages)
    if not chats:
        raise ValueError(f"{path} has no conversations")
    return chats


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """Register `tandem train-draft` on an argparse subparsers object."""
    p = subparsers.add_parser("train-draft", help="train an EAGLE-3 head for a local target checkpoint")
    p.add_argument("--target", required=True, help="target checkpoint directory (HF format, with tokenizer)")
    p.add_argument("--data", nargs="+", metavar="FILE", help="text files (default: the target's own continuations)")
    p.add_argument("--chats", metavar="JSONL",
                   help='conversations ({"messages": [...]} a line): the target answers each, the head learns the answers')
    p.add_argument("--self-distill", action="store_true", help="cut prompts from --data, train on the continuations")
    p.add_argument("--out", required=True, help="directory to write the head to")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    p.add_argument("--epochs", type=float, default=None, help="passes over the data (replaces --steps)")
    p.add_argument("--seconds", type=float, default=None, help="stop after this much time")
    p.add_argument("--ttt-steps", type=int, default=4, help="training-time-test steps (draft positions trained)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--draft-vocab-size", type=int, default=None, help="default: the target's vocabulary")
    p.add_argument("--num-sequences", type=int, default=1024, help="self-distilled sequences to generate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=DTYPE_NAMES, help="the frozen target's dtype")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--parallel-drafting", action="store_true",
                   help="train a P-EAGLE head: all drafts of a round in one forward (COD sampling, the cross-depth mask)")
    p.add_argument("--num-depths", type=int, default=5, help="P-EAGLE: drafts one forward gives")
    p.add_argument("--num-layers", type=int, default=1, help="P-EAGLE: decoder layers")
    p.add_argument("--mask-token-id", type=int, default=None, help="P-EAGLE: the masked positions' token "
                   "(default: the target's pad token, else its EOS)")
    p.add_argument("--down-sample-ratio", type=float, default=0.7,
                   help="P-EAGLE COD: depth d keeps max(ratio**d, 0.2) of the positions")
    p.set_defaults(func=cmd_train_draft)
    return p
