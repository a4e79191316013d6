"""`tandem generate`: one request, in-process (both engines here) or against a running coordinator."""

from __future__ import annotations

import argparse
import json
import sys

from tandem_tools.cli import build_request


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


def _resolve_models(args: argparse.Namespace) -> tuple[str, str | None]:
    """Explicit paths, a demo, or the built-in tiny pair when none are given."""
    target, draft = args.target, args.draft
    if getattr(args, "demo", None):
        if target or draft:
            raise ValueError("--demo is a target and a draft: give it or --target/--draft, not both")
        from tandem_tools.demos import ensure_named_demo

        demo = ensure_named_demo(args.demo)
        return str(demo / "target"), str(demo / "draft")
    if target is None:
        from tandem_tools.tiny import ensure_tiny

        tiny = ensure_tiny()
        target = str(tiny / "target")
        draft = draft or str(tiny / "draft")
    return target, draft


def print_deltas(deltas, as_json: bool) -> None:
    """--stream: the text as it arrives (or one JSON object per delta), then the summary."""
    last = None
    for delta in deltas:
        last = delta
        if as_json:
            print(json.dumps(delta.model_dump()), flush=True)
        else:
            print(delta.text, end="", flush=True)
    if not as_json and last is not None:
        print()
        s = last.stats or {}
        print(
            f"[finish={last.finish_reason}, rounds={s.get('num_rounds')}, "
            f"mean acceptance length={s.get('mean_acceptance_length', 0.0):.2f}]",
            file=sys.stderr,
        )


def cmd_generate(args: argparse.Namespace) -> int:
    if args.server:
        return _generate_remote(args)
    if not args.in_process and not args.demo:
        print("tandem generate: give --server HOST:PORT (a running coordinator), --in-process or --demo",
              file=sys.stderr)
        return 2
    from tandem_tools.inprocess import InProcessGenerator

    target, draft = _resolve_models(args)
    generator = InProcessGenerator(
        target, None if args.no_speculation else draft, device=args.device, dtype=args.dtype,
        aux_layer_convention=args.aux_layer_convention,
    )
    try:
        return _generate_in_process(args, generator)
    finally:
        generator.close()  # its scheduler's thread ends before the interpreter does


def _generate_in_process(args, generator) -> int:
    prompt_ids = args.prompt_ids
    if args.chat is not None:
        prompt_ids = list(generator.tokenizer.apply_chat_template(
            [{"role": "user", "content": args.chat}], add_generation_prompt=True, tokenize=True, return_dict=False))
    elif prompt_ids is None:
        prompt_ids = generator.tokenizer(args.prompt)["input_ids"]
    request = build_request(args, prompt_ids)
    if args.compare:
        from tandem_tools.inprocess import compare

        return compare(generator, request, args.json, overlap=args.overlap == "on")
    if args.stop or args.stream:  # the coordinator's text path: incremental detokenizer and stop strings
        from coordinator.client import GenerateDelta, GenerateResult
        from tandem.text import text_deltas

        deltas = (
            GenerateDelta(token_ids=d.token_ids, text=d.text, finish_reason=d.finish_reason,
                          stats=d.stats.as_dict() if d.stats is not None else None)
            for d in text_deltas(generator.stream(request, overlap=args.overlap == "on"),
                                 generator.tokenizer.backend_tokenizer, args.stop)
        )
        if args.stream:
            print_deltas(deltas, args.json)
            return 0
        pieces = list(deltas)
        result = GenerateResult(
            token_ids=[t for d in pieces for t in d.token_ids], text="".join(d.text for d in pieces),
            finish_reason=pieces[-1].finish_reason, stats=pieces[-1].stats,
        )
    else:
        result = generator.generate(request, detokenize=True, overlap=args.overlap == "on")
    print_result(result, args.json)
    return 0


def _generate_remote(args: argparse.Namespace) -> int:
    """`generate --server`: the gRPC client only (no torch in this process)."""
    from coordinator.client import TandemClient, TandemError

    names = ("max_new_tokens", "num_draft_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids",
             "stop", "ignore_eos")
    params = {name: getattr(args, name) for name in names} | {"speculate": not args.no_speculation, "tree": args.tree}
    if args.chat is not None:
        params["messages"] = [{"role": "user", "content": args.chat}]
    try:
        with TandemClient(args.server, timeout=args.timeout, api_key=args.api_key, tls_ca=args.tls_ca) as client:
            if args.stream:
                print_deltas(client.generate_stream(args.prompt, args.prompt_ids, **params), args.json)
            else:
                print_result(client.generate(args.prompt, args.prompt_ids, **params), args.json)
    except TandemError as exc:
        print(f"tandem generate: {exc.code.name}: {exc.details}", file=sys.stderr)
        return 1
    return 0


