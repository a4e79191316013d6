"""The `tandem` command line. Each subcommand is a thin shell over a library call."""

from __future__ import annotations

import argparse
import json
import sys


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def add_generation_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized with the target's tokenizer)")
    src.add_argument("--prompt-ids", type=_ids, help="prompt token ids, comma-separated")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-draft-tokens", "-k", type=int, default=4, help="K, draft tokens per round")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop-token-ids", type=_ids, default=[])
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--no-speculation", action="store_true", help="target-only decoding")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def build_request(args: argparse.Namespace, prompt_ids: list[int]):
    from tandem.params import GenerationRequest, SamplingParams

    return GenerationRequest(
        prompt_ids=prompt_ids,
        max_new_tokens=args.max_new_tokens,
        num_draft_tokens=args.num_draft_tokens,
        sampling=SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed),
        stop_token_ids=args.stop_token_ids,
        ignore_eos=args.ignore_eos,
        speculate=not args.no_speculation,
    )


def print_result(result, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result.model_dump()))
    else:
        print(result.text if result.text is not None else result.token_ids)
        s = result.stats
        print(
            f"[{len(result.token_ids)} tokens, finish={result.finish_reason}, rounds={s['num_rounds']}, "
            f"mean acceptance length={s['mean_acceptance_length']:.2f}]",
            file=sys.stderr,
        )


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from tandem.tiny import make_tiny

    out = make_tiny(args.dir, seed=args.seed)
    print(f"wrote {out}/target, {out}/draft (reference layout), {out}/draft-speculators")
    return 0


def _resolve_models(args: argparse.Namespace) -> tuple[str, str | None]:
    """Explicit paths, or the built-in tiny pair when none are given."""
    target, draft = args.target, args.draft
    if target is None:
        from tandem.tiny import ensure_tiny

        tiny = ensure_tiny()
        target = str(tiny / "target")
        draft = draft or str(tiny / "draft")
    return target, draft


def cmd_generate(args: argparse.Namespace) -> int:
    if not args.in_process:
        print("tandem generate: give --in-process (the gRPC client arrives with the services)", file=sys.stderr)
        return 2
    from tandem.inprocess import InProcessGenerator

    target, draft = _resolve_models(args)
    generator = InProcessGenerator(
        target, None if args.no_speculation else draft, device=args.device, dtype=args.dtype
    )
    prompt_ids = args.prompt_ids
    if prompt_ids is None:
        prompt_ids = generator.tokenizer(args.prompt)["input_ids"]
    result = generator.generate(build_request(args, prompt_ids), detokenize=True)
    print_result(result, args.json)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny", help="write a tiny target + EAGLE-3 draft pair in the real formats")
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_tiny)

    p = sub.add_parser("generate", help="generate once, in-process or against a running coordinator")
    p.add_argument("--in-process", action="store_true", help="load both engines in this process")
    p.add_argument("--target", help="target checkpoint directory (default: the built-in tiny pair)")
    p.add_argument("--draft", help="EAGLE-3 head directory")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    add_generation_args(p)
    p.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"tandem {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
