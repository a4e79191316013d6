"""A long batched run: does memory grow? Concurrent clients with mixed prompt lengths, lengths, K and
temperatures against `tandem serve`, printing the resident memory of each service every interval.

    python bench/batching_soak.py [--demo | --target DIR --draft DIR] [-c 16] [--duration 240] [--interval 15]

Every client loops: a random prompt of 1-60 tokens, 8-96 new tokens, K 1-5, temperature 0 or 0.7. The
KV of a finished generation must be given back (the target's pool blocks, which the pool keeps for the
next ones; the draft's cache): RSS should level off after the first interval and stay there. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.client import TandemClient
from tandem_tools.serve import launch
from tandem_tools.serve import stop as stop_serve


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def service_pids(serve_pid: int) -> dict[str, int]:
    """`tandem serve`'s children by service name (their argv: python -m tandem_tools.cli NAME ...)."""
    children = subprocess.run(["pgrep", "-P", str(serve_pid)], capture_output=True, text=True, check=False).stdout.split()
    return {Path(f"/proc/{pid}/cmdline").read_text().split("\0")[3]: int(pid) for pid in children}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--demo", action="store_true", help="the demo pair (default: the built-in tiny pair)")
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("-c", "--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=240)
    p.add_argument("--interval", type=float, default=15)
    args = p.parse_args()
    if args.demo:
        from tandem_tools.demo import ensure_demo

        pair = ensure_demo()
        target, draft = pair / "target", pair / "draft"
    elif args.target and args.draft:
        target, draft = Path(args.target), Path(args.draft)
    else:
        from tandem_tools.tiny import ensure_tiny

        pair = ensure_tiny()
        target, draft = pair / "target", pair / "draft"

    serve, address = launch(["--target", str(target), "--draft", str(draft), "--port", "0"])
    try:
        pids = service_pids(serve.pid)
        client = TandemClient(address, timeout=600)
        stop = time.monotonic() + args.duration
        done = {"requests": 0, "tokens": 0}

        def loop(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < stop:
                prompt = [rng.randint(5, 400) for _ in range(rng.randint(1, 60))]
                out = client.generate(prompt_ids=prompt, max_new_tokens=rng.randint(8, 96), ignore_eos=True,
                                      num_draft_tokens=rng.randint(1, 5), temperature=rng.choice([0.0, 0.0, 0.7]),
                                      seed=seed)
                done["requests"] += 1
                done["tokens"] += len(out.token_ids)

        start = time.monotonic()
        with ThreadPoolExecutor(args.clients) as pool:
            futures = [pool.submit(loop, i) for i in range(args.clients)]
            while time.monotonic() < stop:
                time.sleep(args.interval)
                memory = " ".join(f"{name}={rss_mib(pid):.0f}MiB" for name, pid in sorted(pids.items()))
                print(f"t={time.monotonic() - start:5.0f}s requests={done['requests']:5d} "
                      f"tokens={done['tokens']:7d} {memory}", flush=True)
            for future in futures:
                future.result()
    finally:
        stop_serve(serve)
    return 0


if __name__ == "__main__":
    sys.exit(main())
