"""What profiling costs: throughput of the same workload with profiling off and on, measured in one run.

    python bench/profile_overhead.py [--target DIR --draft DIR] [-n 16] [-c 4] [--max-new-tokens 64] [--reps 5]

Two `tandem serve` stacks run side by side on the same models:
    off   no /metrics endpoint, plain requests
    on    /metrics on all three services, scraped every --scrape-interval seconds (harder than a
          Prometheus would), and every request asks for its profile (GenerateRequest.profile: step
          timing from the services, per-round accounting in the coordinator, the profile sent back)
Both always count bytes at the serializers (tandem/traffic.py): that is not optional, so it is in both.
The two alternate, batch by batch (off, on, on, off, ...), so that drift of the machine hits both alike;
the figure is generated tokens per second over all batches of each. On a busy machine throughput is
noisy, so the CPU time the three service processes spend per generated token (read from /proc, Linux)
is printed too: it does not depend on what else the machine runs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.client import build_request
from tandem.v1 import coordinator_pb2_grpc
from tandem_tools.profile import DEFAULT_PROMPTS, LaunchedStack, ProfileConfig


def batch(stub, args, profile: bool) -> tuple[int, float]:
    """One batch of requests; (generated tokens, seconds)."""

    def one(i: int) -> int:
        request = build_request(prompt=DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)], max_new_tokens=args.max_new_tokens,
                                num_draft_tokens=args.num_draft_tokens, ignore_eos=True)
        request.profile = profile
        tokens = 0
        for msg in stub.GenerateStream(request, timeout=600):
            tokens += len(msg.token_ids)
            if msg.finish_reason and profile:
                assert msg.HasField("profile")
        return tokens

    start = time.monotonic()
    with ThreadPoolExecutor(args.concurrency) as pool:
        tokens = sum(pool.map(one, range(args.num_requests)))
    return tokens, time.monotonic() - start


def cpu_seconds(root_pid: int) -> float:
    """user + system CPU seconds of a process and its children (tandem serve and its three services)."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    pids, total = [root_pid], 0.0
    while pids:
        pid = pids.pop()
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            pids += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        except (OSError, ValueError, IndexError):
            continue
    return total


def scraper(addresses: list[str], interval: float, stop: threading.Event) -> None:
    while not stop.wait(interval):
        for address in addresses:
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
                response.read()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("--target-device", default="cpu")
    parser.add_argument("--draft-device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("-n", "--num-requests", type=int, default=16)
    parser.add_argument("-c", "--concurrency", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("-k", "--num-draft-tokens", type=int, default=4)
    parser.add_argument("--reps", type=int, default=6, help="batches of each (after one warm-up batch each)")
    parser.add_argument("--scrape-interval", type=float, default=1.0)
    args = parser.parse_args()

    config = ProfileConfig(out=Path("."), target=args.target, draft=args.draft, target_device=args.target_device,
                           draft_device=args.draft_device, dtype=args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        print("starting two stacks (profiling off / on) ...", flush=True)
        stacks = {"off": LaunchedStack(config, Path(tmp) / "off.log", with_metrics=False),
                  "on": LaunchedStack(config, Path(tmp) / "on.log", with_metrics=True)}
        stop = threading.Event()
        channels = {name: grpc.insecure_channel(s.address) for name, s in stacks.items()}
        stubs = {name: coordinator_pb2_grpc.CoordinatorStub(c) for name, c in channels.items()}
        try:
            threading.Thread(target=scraper, args=(list(stacks["on"].metrics.values()), args.scrape_interval, stop),
                             daemon=True).start()
            for name in ("off", "on"):  # warm-up
                batch(stubs[name], args, profile=name == "on")
            totals = {"off": [0, 0.0, 0.0], "on": [0, 0.0, 0.0]}  # tokens, seconds, CPU seconds
            for rep in range(args.reps):
                for name in (("off", "on") if rep % 2 == 0 else ("on", "off")):
                    cpu = cpu_seconds(stacks[name].proc.pid)
                    tokens, seconds = batch(stubs[name], args, profile=name == "on")
                    cpu = cpu_seconds(stacks[name].proc.pid) - cpu
                    for i, v in enumerate((tokens, seconds, cpu)):
                        totals[name][i] += v
                    print(f"  batch {rep + 1} {name:>3}: {tokens / seconds:8.1f} tok/s, "
                          f"{1e3 * cpu / tokens:6.2f} CPU ms/token", flush=True)
        finally:
            stop.set()
            for channel in channels.values():
                channel.close()
            for stack in stacks.values():
                stack.stop()
    off = totals["off"][0] / totals["off"][1]
    on = totals["on"][0] / totals["on"][1]
    cpu_off = 1e3 * totals["off"][2] / totals["off"][0]
    cpu_on = 1e3 * totals["on"][2] / totals["on"][0]
    print(f"profiling off: {off:.1f} tok/s, {cpu_off:.2f} CPU ms/token (all three services)")
    print(f"profiling on:  {on:.1f} tok/s, {cpu_on:.2f} CPU ms/token")
    print(f"throughput on / off = {on / off:.3f} ({100 * (1 - on / off):+.1f}% overhead); "
          f"CPU per token on / off = {cpu_on / cpu_off:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
