"""The `tandem` command line. Each subcommand is a thin shell over a library call."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from tandem.aux_layers import CONVENTION_HELP, CONVENTIONS
from tandem.defaults import (
    API_KEY_FILE_HELP,
    API_KEY_HELP,
    MAX_WAITING_HELP,
    OVERLAP_HELP,
    SERVE_METRICS_PORT_HELP,
    SPEC_TOKEN_BUDGET_HELP,
    TLS_CA_HELP,
    TLS_CERT_HELP,
    TLS_KEY_HELP,
    TREE_HELP,
)
from tandem.dtypes import DTYPE_NAMES
from tandem_tools.demos import add_demo_arg

DTYPE_HELP = " | ".join(DTYPE_NAMES) + " (default float32)"
TRANSPORT_HELP = "feature path target -> draft: auto | grpc | shm | cuda-ipc | nccl (default auto: cuda-ipc on one GPU node, nccl across GPUs, shm on one host, else grpc)"


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def _grammar(text: str):
    """KIND[:VALUE] -> a GrammarSpec: json_object, json_schema:FILE, regex:PATTERN, choice:A,B,..., grammar:FILE
    (Lark or GBNF)."""
    import json
    from pathlib import Path

    from tandem.params import GRAMMAR_KINDS, GrammarSpec

    kind, _, value = text.partition(":")
    if kind not in GRAMMAR_KINDS or (kind == "json_object") != (value == ""):
        raise argparse.ArgumentTypeError(f"a grammar is json_object, json_schema:FILE, regex:PATTERN, choice:A,B "
                                         f"or grammar:FILE; got {text!r}")
    if kind in ("json_schema", "grammar"):
        try:
            value = Path(value).read_text()
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"{kind}: {exc}") from None
    elif kind == "choice":
        value = json.dumps(value.split(","))
    return GrammarSpec(kind=kind, value=value)


def _tree(text: str):
    from tandem.params import parse_tree

    try:
        return parse_tree(text)
    except ValueError as exc:  # pydantic's ValidationError is one: its first error's message
        errors = getattr(exc, "errors", None)
        message = errors()[0]["msg"].removeprefix("Value error, ") if callable(errors) else str(exc)
        raise argparse.ArgumentTypeError(message) from None


def add_generation_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized with the target's tokenizer)")
    src.add_argument("--prompt-ids", type=_ids, help="prompt token ids, comma-separated")
    src.add_argument("--chat", metavar="TEXT",
                     help="a user message, rendered with the target's chat template (the model answers it)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-draft-tokens", "-k", type=int, default=4, help="K, draft tokens per round")
    p.add_argument("--tree", type=_tree, metavar="NODES[,DEPTH[,TOP_K]]", help="an EAGLE-2 draft tree, not a chain")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop-token-ids", type=_ids, default=[])
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--no-speculation", action="store_true", help="target-only decoding")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable): the text ends before it, finish_reason 'stop'")
    p.add_argument("--stream", action="store_true", help="print the text as it arrives")
    p.add_argument("--json", action="store_true", help="print one JSON object (with --stream: one per delta)")


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
        tree=args.tree,
    )


# -- the services -------------------------------------------------------------------------------


def add_engine_args(p: argparse.ArgumentParser, batch_tokens: str) -> None:
    """Flags of both engines (EngineSettings); `batch_tokens` names what --max-batch-tokens counts."""
    p.add_argument("--aux-layer-convention", choices=CONVENTIONS, help=CONVENTION_HELP)
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default cpu)")
    p.add_argument("--dtype", help=DTYPE_HELP)
    p.add_argument("--transport", help=TRANSPORT_HELP)


def add_service_args(p: argparse.ArgumentParser, port_help: str) -> None:
    """Flags every service takes; unset flags fall back to TANDEM_<SERVICE>_* variables, then defaults."""
    p.add_argument("--host", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help=port_help)
    p.add_argument("--max-sessions", type=int, help="concurrent generations before RESOURCE_EXHAUSTED (default 64)")
    p.add_argument("--grace-period", type=float, help="seconds in-flight requests get on SIGTERM (default 30)")
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level (default INFO)")
    p.add_argument("--metrics-port", type=int,
                   help="serve Prometheus /metrics on this port (default: off; 0 = any free port)")
    p.add_argument("--tls-cert", help=TLS_CERT_HELP)
    p.add_argument("--tls-key", help=TLS_KEY_HELP)
    p.add_argument("--tls-ca", help=TLS_CA_HELP)


def add_key_args(p: argparse.ArgumentParser) -> None:
    """The coordinator's API keys (tandem/auth.py)."""
    p.add_argument("--api-key", action="append", help=API_KEY_HELP)
    p.add_argument("--api-key-file", help=API_KEY_FILE_HELP)


def _service(settings_class: str, module: str) -> Callable[[argparse.Namespace], int]:
    """A service's subcommand: its settings from the flags (errors before any heavy import), then
    `module.serve(settings)`."""
    def run(args: argparse.Namespace) -> int:
        from tandem import config

        settings = config.load_settings(getattr(config, settings_class), **vars(args))
        return importlib.import_module(module).serve(settings)

    return run


def _later(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """The subcommand `module.name`, imported when it runs: building the parser stays light."""
    return lambda args: getattr(importlib.import_module(module), name)(args)


def add_speculation_args(p: argparse.ArgumentParser) -> None:
    """The K policy's flags (tandem/policy.py), the same on `serve` and `coordinator`."""
    p.add_argument("--spec-token-budget", type=int, help=SPEC_TOKEN_BUDGET_HELP)
    p.add_argument("--overlap", choices=["on", "off"], help=OVERLAP_HELP + " (default on)")
    p.add_argument("--tree", metavar="NODES[,DEPTH[,TOP_K]]", help=TREE_HELP)


def add_http_args(p: argparse.ArgumentParser) -> None:
    """The OpenAI-compatible HTTP front's flags (coordinator/http/), the same on `serve` and `coordinator`."""
    p.add_argument("--http-port", type=int,
                   help="serve the OpenAI-compatible HTTP API on this port of --host (default: off; 0 = any free port)")
    p.add_argument("--served-model-name", help="the model name of the HTTP API (default: the target's directory name)")
    p.add_argument("--chat-template", help="the HTTP API's chat template: a jinja2 file or the template itself "
                   "(default: the target checkpoint's)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny", help="write a tiny target + EAGLE-3 draft pair in the real formats")
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_later("tandem_tools.tiny", "cmd_make_tiny"))

    p = sub.add_parser("make-certs", help="write a CA's certificate and one certificate and key it signs for these "
                                          "hosts (TLS and mutual TLS of the three services; the CA's key is dropped)")
    p.add_argument("dir")
    p.add_argument("hosts", nargs="*", metavar="HOST", help="names and IPs besides localhost, 127.0.0.1 and ::1")
    p.set_defaults(func=_later("tandem.security", "cmd_make_certs"))

    p = sub.add_parser("generate", help="generate once, against a running coordinator or in-process")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--server", metavar="HOST:PORT", help="the coordinator to call (e.g. from `tandem serve`)")
    where.add_argument("--in-process", action="store_true", help="load both engines in this process")
    p.add_argument("--timeout", type=float, default=None, help="--server: deadline in seconds")
    p.add_argument("--api-key", help="--server: the coordinator's API key (default $TANDEM_API_KEY)")
    p.add_argument("--tls-ca", help="--server: TLS, checking the coordinator's certificate against this CA "
                                    "(default $TANDEM_TLS_CA; none: plain)")
    p.add_argument("--target", help="target checkpoint directory (default: the built-in tiny pair)")
    p.add_argument("--draft", help="EAGLE-3 head directory")
    add_demo_arg(p)
    p.add_argument("--compare", action="store_true",
                   help="--in-process: run the request target-only too and print both speeds and the speed-up")
    p.add_argument("--aux-layer-convention", choices=CONVENTIONS, help="--in-process: " + CONVENTION_HELP)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    p.add_argument("--overlap", choices=["on", "off"], default="off",
                   help="--in-process: " + OVERLAP_HELP + " (default off; --server: the coordinator's setting)")
    add_generation_args(p)
    p.set_defaults(func=_later("tandem_tools.generate", "cmd_generate"))

    p = sub.add_parser("serve", help="start the target, draft and coordinator services (three processes)")
    p.add_argument("--target", help="target checkpoint directory (default: the built-in tiny pair)")
    p.add_argument("--draft", help="EAGLE-3 head directory (default with no --target: the tiny head)")
    add_demo_arg(p)
    p.add_argument("--aux-layer-convention", choices=CONVENTIONS, help=CONVENTION_HELP)
    p.add_argument("--target-device", help="device of the target process (default cpu)")
    p.add_argument("--draft-device", help="device of the draft process (default cpu)")
    p.add_argument("--dtype", help=DTYPE_HELP)
    p.add_argument("--transport", help=TRANSPORT_HELP)
    p.add_argument("--host", help="interface the coordinator binds (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="the coordinator's port (default 50050; 0 = any free port)")
    p.add_argument("--grace-period", type=float, help="seconds in-flight requests get on SIGTERM (default 30)")
    add_speculation_args(p)
    add_http_args(p)
    p.add_argument("--metrics-port", type=int, help=SERVE_METRICS_PORT_HELP)
    add_key_args(p)
    p.add_argument("--tls", choices=["on", "off"], help="on: TLS on the fronts and mutual TLS between the services, "
                                                        "from a CA made for this run (default off)")
    p.set_defaults(func=_later("tandem_tools.serve", "cmd_serve"))

    p = sub.add_parser("target", help="run the target service (one process, one device)")
    p.add_argument("--model", help="target checkpoint directory (TANDEM_TARGET_MODEL)")
    p.add_argument("--draft", help="draft directory: only its config.json is read, for the capture layer ids")
    add_engine_args(p, "new tokens")
    p.add_argument("--max-batch-size", type=int, help="sessions' steps the largest forward is sized for (default 32)")
    p.add_argument("--max-batch-tokens", type=int, help="new tokens the largest forward is sized for (default 4096)")
    p.add_argument("--kv-cache-gib", type=float,
                   help="KV cache of all sessions (default: the GPU memory left after a forward, the ring and a "
                        "margin; half the RAM on a CPU)")
    add_service_args(p, "port (default 50051; 0 = any free port)")
    p.set_defaults(func=_service("TargetSettings", "target_server.service"))

    p = sub.add_parser("draft", help="run the draft service (one process, one device)")
    p.add_argument("--model", help="EAGLE-3 head directory (TANDEM_DRAFT_MODEL)")
    p.add_argument("--target", help="target checkpoint directory: its embed_tokens is read")
    add_engine_args(p, "new pairs + drafts")
    p.add_argument("--kv-cache-gib", type=float,
                   help="KV cache of all sessions' committed pairs (default: the GPU memory left after a propose and "
                        "a margin, within its part of a GPU it shares with the target; half the RAM on a CPU)")
    add_service_args(p, "port (default 50052; 0 = any free port)")
    p.set_defaults(func=_service("DraftSettings", "draft_server.service"))

    p = sub.add_parser("coordinator", help="run the coordinator service (no model, no torch)")
    p.add_argument("--target-addr", metavar="HOST:PORT", help="the target service")
    p.add_argument("--draft-addr", metavar="HOST:PORT", help="the draft service (none: target-only decoding)")
    p.add_argument("--draft-timeout", type=float,
                   help="seconds a draft step may take before the generation goes on target-only (default 10)")
    add_speculation_args(p)
    p.add_argument("--max-waiting", type=int, help=MAX_WAITING_HELP)
    add_http_args(p)
    add_key_args(p)
    add_service_args(p, "port (default 50050; 0 = any free port)")
    p.set_defaults(func=_service("CoordinatorSettings", "coordinator.server"))

    p = sub.add_parser("load", help="load test: concurrent streaming clients, every output checked")
    from tandem_tools import load

    load.add_args(p)
    p.set_defaults(func=load.run)

    p = sub.add_parser("profile", help="profile a workload: traffic per link and kind, time per stage, a trace")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--server", metavar="HOST:PORT", help="a running coordinator")
    where.add_argument("--target", help="start the three services on this target checkpoint (default: tiny pair)")
    p.add_argument("--draft", help="with --target: the EAGLE-3 head directory")
    p.add_argument("--target-device", default="cpu", help="with --target: the target's device")
    p.add_argument("--draft-device", default="cpu", help="with --target: the draft's device")
    p.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    p.add_argument("--overlap", choices=["on", "off"], default="on",
                   help="with --target: " + OVERLAP_HELP + " (default on)")
    p.add_argument("--transport", default="auto", help="with --target: " + TRANSPORT_HELP)
    p.add_argument("--prompts", metavar="FILE", help="one prompt per line, or .jsonl with prompt / prompt_ids")
    p.add_argument("--num-requests", "-n", type=int, default=16)
    p.add_argument("--concurrency", "-c", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-draft-tokens", "-k", type=int, default=4)
    p.add_argument("--tree", type=_tree, metavar="NODES[,DEPTH[,TOP_K]]", help="every request asks for this tree")
    p.add_argument("--grammar", type=_grammar, metavar="KIND[:VALUE]",
                   help="every request is constrained: json_object, json_schema:FILE, regex:PATTERN, choice:A,B, "
                        "grammar:FILE; the report gives the masks' cost per round")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="request i gets seed + i")
    p.add_argument("--ignore-eos", action="store_true", help="every request generates --max-new-tokens")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of each request in seconds")
    p.add_argument("--out", default="tandem-profile", metavar="DIR",
                   help="where report.json, trace.json and traffic.png go (default ./tandem-profile)")
    p.set_defaults(func=_later("tandem_tools.profile", "cmd_profile"))

    # torch-free registrations: the commands import their heavy modules when they run
    from draft_server.train_cli import add_train_parser
    from tandem_tools.bench import add_bench_parser
    from tandem_tools.demos import add_demo_parser

    add_train_parser(sub)
    add_demo_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, OSError) as exc:  # ConfigError and PairMismatch are ValueErrors
        print(f"tandem {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
