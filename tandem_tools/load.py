"""`tandem load`: many concurrent streaming clients against a coordinator, every output checked.

    tandem load                                                  # starts `tandem serve` (the tiny pair)
    tandem load --server 127.0.0.1:50050 --clients 64 --duration 120

First each distinct prompt is generated once with speculation off: under greedy decoding that is what
the target alone says, so every speculative output must equal it token for token. Then `--clients`
threads stream generations back to back for `--duration` seconds (prompts and K in rotation) and
compare each one with its expected output. Prints throughput and latency percentiles (end to end and
time to first token; tandem.stats.percentile); exits 1 on any error or wrong output. No torch in this
process.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from tandem.stats import mean_acceptance_length, percentile

# Code-like prompts of varied length; each gets its own max_new_tokens so that lengths vary too.
PROMPTS = [
    "def main(", "import os\n", "class Foo:\n    def __init__(self", "for i in range(", "# héllo wörld ✓",
    "while True:\n", "return [x for x in", "SELECT * FROM users WHERE", "#include <stdio.h>\nint main(",
    "fn main() {\n    let", "async def fetch(url):\n    async with", "if __name__ == '__main__':\n",
    "The quick brown fox", "x = np.zeros((", "try:\n    import torch\nexcept", "<html><body><div class=",
]
MAX_NEW_TOKENS = [16, 24, 32, 40, 48, 56, 64]


@dataclass
class Results:
    latencies: list[float] = field(default_factory=list)  # seconds, request start to last delta
    first_token: list[float] = field(default_factory=list)  # seconds, request start to first token
    tokens: int = 0
    rounds: int = 0
    accepted: int = 0
    rounds_without_draft: int = 0
    errors: Counter = field(default_factory=Counter)  # status code name -> count
    error_samples: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def expected_outputs(address: str, prompts: list[str], timeout: float, parallel: int) -> list[dict]:
    """Each prompt once, target-only (speculate=False): the greedy output every speculative run must give."""
    from concurrent.futures import ThreadPoolExecutor

    from coordinator.client import TandemClient

    with TandemClient(address, timeout=timeout) as client, ThreadPoolExecutor(max(1, parallel)) as pool:
        def one(i: int) -> dict:
            result = client.generate(prompt=prompts[i], max_new_tokens=MAX_NEW_TOKENS[i % len(MAX_NEW_TOKENS)],
                                     speculate=False)
            return result.model_dump(include={"token_ids", "text", "finish_reason"})

        return list(pool.map(one, range(len(prompts))))


def run_client(address: str, prompts: list[str], expected: list[dict], counter, stop_at: float,
               timeout: float, results: Results) -> None:
    from coordinator.client import TandemClient, TandemError  # the CLI imports this module: keep grpc lazy
    with TandemClient(address, timeout=timeout) as client:
        while time.monotonic() < stop_at:
            n = next(counter)
            i, k = n % len(prompts), 1 + n % 6
            start = time.monotonic()
            first = None
            tokens: list[int] = []
            text: list[str] = []
            last = None
            try:
                for delta in client.generate_stream(
                    prompt=prompts[i], max_new_tokens=MAX_NEW_TOKENS[i % len(MAX_NEW_TOKENS)], num_draft_tokens=k
                ):
                    if first is None and delta.token_ids:
                        first = time.monotonic() - start
                    tokens += delta.token_ids
                    text.append(delta.text)
                    last = delta
            except TandemError as exc:
                with results.lock:
                    results.errors[exc.code.name] += 1
                    if len(results.error_samples) < 5:
                        results.error_samples.append(f"{exc.code.name}: {exc.details}")
                continue
            elapsed = time.monotonic() - start
            got = {"token_ids": tokens, "text": "".join(text), "finish_reason": last.finish_reason if last else None}
            with results.lock:
                if got != expected[i]:
                    results.wrong.append(f"prompt {i} K={k}: got {got['token_ids']}, expected {expected[i]['token_ids']}")
                    continue
                results.latencies.append(elapsed)
                results.first_token.append(first if first is not None else elapsed)
                results.tokens += len(tokens)
                stats = last.stats or {}
                results.rounds += stats.get("num_rounds", 0)
                results.accepted += stats.get("num_accepted_tokens", 0)
                results.rounds_without_draft += stats.get("num_rounds_without_draft", 0)


def run_load(address: str, clients: int, duration: float, timeout: float = 300.0) -> dict:
    """The load run against the coordinator at `address`; the report as a dict."""
    prompts = PROMPTS
    expected = expected_outputs(address, prompts, timeout, parallel=min(clients, len(prompts)))
    results = Results()
    counter = itertools.count()
    start = time.monotonic()
    threads = [
        threading.Thread(target=run_client, args=(address, prompts, expected, counter, start + duration, timeout,
                                                  results), daemon=True)
        for _ in range(clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.monotonic() - start
    ok = len(results.latencies)
    return {
        "server": address,
        "clients": clients,
        "duration_s": round(wall, 2),
        "distinct_prompts": len(prompts),
        "requests_ok": ok,
        "errors": dict(results.errors),
        "error_samples": results.error_samples,
        "wrong_outputs": len(results.wrong),
        "wrong_samples": results.wrong[:5],
        "requests_per_s": round(ok / wall, 2),
        "tokens_per_s": round(results.tokens / wall, 1),
        "latency_p50_s": round(percentile(results.latencies, 50), 4),
        "latency_p99_s": round(percentile(results.latencies, 99), 4),
        "first_token_p50_s": round(percentile(results.first_token, 50), 4),
        "first_token_p99_s": round(percentile(results.first_token, 99), 4),
        "mean_acceptance_length": round(mean_acceptance_length(results.accepted, results.rounds), 3),
        "rounds_without_draft": results.rounds_without_draft,
    }


def print_report(report: dict) -> None:
    r = report
    print(f"tandem load: {r['clients']} streaming clients for {r['duration_s']:.1f} s against {r['server']} "
          f"({r['distinct_prompts']} prompts, greedy, K 1-6, each output checked against target-only)")
    errors = f"{sum(r['errors'].values())} errors" + (f" {r['errors']}" if r["errors"] else "")
    print(f"  requests     {r['requests_ok']} ok, {errors}, {r['wrong_outputs']} wrong outputs")
    print(f"  throughput   {r['requests_per_s']:.2f} requests/s, {r['tokens_per_s']:.1f} tokens/s")
    print(f"  latency      p50 {r['latency_p50_s']:.3f} s, p99 {r['latency_p99_s']:.3f} s (end to end)")
    print(f"  first token  p50 {r['first_token_p50_s']:.3f} s, p99 {r['first_token_p99_s']:.3f} s")
    print(f"  speculation  mean acceptance length {r['mean_acceptance_length']:.2f}, "
          f"rounds without draft {r['rounds_without_draft']}")
    for sample in r["error_samples"] + r["wrong_samples"]:
        print(f"  ! {sample}")


def start_serve() -> tuple[subprocess.Popen, str]:
    """`tandem serve` on a free port (the built-in tiny pair); its process and address."""
    from tandem_tools.serve import launch

    return launch(["--port", "0"], env={**os.environ, "OMP_NUM_THREADS": "1"})


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", metavar="HOST:PORT", help="the coordinator (default: start `tandem serve` for the run)")
    p.add_argument("--clients", type=int, default=64, help="concurrent streaming clients (default 64)")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load (default 120)")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline of each request in seconds (default 300)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def run(args: argparse.Namespace) -> int:
    proc = None
    address = args.server
    if address is None:
        proc, address = start_serve()
    try:
        report = run_load(address, args.clients, args.duration, args.timeout)
    finally:
        if proc is not None:
            from tandem_tools.serve import stop

            stop(proc)
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0 if not report["errors"] and not report["wrong_outputs"] and report["requests_ok"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem_tools.load", description=__doc__.splitlines()[0])
    add_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
