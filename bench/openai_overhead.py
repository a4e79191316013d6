"""What the OpenAI-compatible HTTP front costs over the gRPC path: the same streamed chat completions at
the same load through both, measured side by side in one run.

    python bench/openai_overhead.py [--target DIR --draft DIR | --demo] [-c 16] [-n 256] [--max-new-tokens 64]

One `tandem serve --http-port 0` stack (default: the tiny pair, built fresh with its chat template). Two
clients take turns block by block (4c requests each, c in flight; tandem_tools/bench/openai.py):
    openai-http   POST /v1/chat/completions, stream, ignore_eos (httpx; what the openai SDK sends)
    grpc          the same conversation rendered with the target's chat template here, GenerateStream
Greedy, so both generate the same tokens. Printed: the bench table, and per generated token the
difference HTTP - gRPC in TPOT ((latency - TTFT) / (tokens - 1), the mean over requests) and in the
coordinator's and services' CPU time (from /proc: independent of what else the machine runs).
The bar: the HTTP front adds no more than 1 ms per generated token at concurrency 16.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem_tools.bench.openai import BUILTIN_PROMPTS, GrpcChat, OpenAIChat, openai_table, run_openai_bench
from tandem_tools.serve import launch, stop

BAR_MS = 1.0


def descendants(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            out += [int(child), *descendants(int(child))]
    return out


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of the processes (Linux /proc/PID/stat, in clock ticks)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--demo", action="store_true", help="the demo pair (tandem demo build)")
    which.add_argument("--target", help="target checkpoint directory (with --draft)")
    parser.add_argument("--draft")
    parser.add_argument("--concurrency", "-c", type=int, default=16)
    parser.add_argument("--num-requests", "-n", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--serve-arg", action="append", default=[], help="more `tandem serve` flags")
    args = parser.parse_args()

    if args.demo:
        from tandem_tools.demo import ensure_demo

        demo = ensure_demo()
        target, draft = demo / "target", demo / "draft"
    elif args.target:
        target, draft = Path(args.target), Path(args.draft)
    else:
        from tandem_tools.tiny import make_tiny

        tiny = make_tiny(tempfile.mkdtemp(prefix="tandem-tiny-"))
        target, draft = tiny / "target", tiny / "draft"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    lines: list[str] = []
    log = Path(tempfile.mkdtemp(prefix="tandem-openai-overhead-")) / "serve.log"
    proc, address = launch(["--target", str(target), "--draft", str(draft), "--port", "0", "--http-port", "0",
                            *args.serve_arg], log, lines=lines)
    url = next(line.split(" on ", 1)[1].strip() for line in lines if "OpenAI-compatible HTTP" in line)
    services = descendants(proc.pid)
    print(f"serve: gRPC {address}, HTTP {url}; log {log}", file=sys.stderr)
    runners = [OpenAIChat(url, target.name),
               GrpcChat(address, lambda m: list(tokenizer.apply_chat_template(
                   m, add_generation_prompt=True, tokenize=True, return_dict=False)))]
    try:
        results = run_openai_bench(runners, [[{"role": "user", "content": p}] for p in BUILTIN_PROMPTS],
                                   [args.concurrency], args.num_requests, args.max_new_tokens, 0.0,
                                   echo=lambda m: print(m, file=sys.stderr, flush=True),
                                   cpu=lambda: cpu_seconds(services))
    finally:
        for runner in runners:
            runner.close()
        stop(proc)
    print(openai_table(results))
    http, grpc_ = (next(r for r in results if r["path"] == p) for p in ("openai-http", "grpc"))
    tpot = http["tpot_mean_ms"] - grpc_["tpot_mean_ms"]
    cpu = http["server_cpu_ms_per_token"] - grpc_["server_cpu_ms_per_token"]
    print(f"\nconcurrency {args.concurrency}, {http['requests']} requests x {args.max_new_tokens} tokens per path")
    print(f"TPOT mean: HTTP {http['tpot_mean_ms']:.2f} ms, gRPC {grpc_['tpot_mean_ms']:.2f} ms: "
          f"HTTP - gRPC = {tpot:+.3f} ms per generated token")
    print(f"server CPU per generated token: HTTP {http['server_cpu_ms_per_token']:.3f} ms, "
          f"gRPC {grpc_['server_cpu_ms_per_token']:.3f} ms: HTTP - gRPC = {cpu:+.3f} ms")
    print(f"TTFT mean: HTTP {http['ttft_mean_ms']:.1f} ms, gRPC {grpc_['ttft_mean_ms']:.1f} ms: "
          f"HTTP - gRPC = {http['ttft_mean_ms'] - grpc_['ttft_mean_ms']:+.1f} ms per request")
    print(f"tokens/s: HTTP {http['tokens_per_s']:.1f}, gRPC {grpc_['tokens_per_s']:.1f}")
    verdict = "within" if tpot <= BAR_MS else "OVER"
    print(f"{verdict} the {BAR_MS:g} ms per token bar")
    return 0 if tpot <= BAR_MS else 1


if __name__ == "__main__":
    sys.exit(main())
