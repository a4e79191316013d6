"""bench/gpu_validate.py's stages between processes: each fast path between two processes under many
sessions (every step's rows checked, the ring-reuse race provoked), and the three services on the demo pair
in float32, EAGLE-3 identical to target-only."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Link:
    """What check_transport reads of a run's sizes."""

    target_device: str
    draft_device: str
    dtype: str
    width: int
    ring_mib: int
    sessions: int
    steps: int
    max_rows: int


def pattern(tag: int, rows: int, width: int, dtype):
    """The rows a step is written with: integers below 251, exact in bfloat16 and float32."""
    import torch

    return ((torch.arange(rows * width) + tag * 7919) % 251).float().view(rows, width).to(dtype)


def _receiver(plan_bytes: bytes, device: str, requests, results, workers: int) -> None:
    """The draft's end in a child process: `workers` threads take (session, tag, rows, width, ref) and
    answer whether the rows they received are the ones written."""
    import torch

    from tandem.transports.endpoints import open_receiver
    from tandem.v1 import common_pb2

    torch.set_num_threads(1)
    receiver = open_receiver(common_pb2.TransportPlan.FromString(plan_bytes), device, None)
    results.put(("ready", 0, ""))

    def work() -> None:
        while (item := requests.get()) is not None:
            session, tag, rows, width, ref_bytes = item
            try:
                got = receiver.recv(common_pb2.FeatureRef.FromString(ref_bytes)).cpu()
                ok = torch.equal(got, pattern(tag, rows, width, got.dtype))
                results.put((session, tag, "ok" if ok else "rows differ from what was written"))
            except Exception as exc:  # noqa: BLE001 - reported per step
                results.put((session, tag, f"{type(exc).__name__}: {str(exc)[:200]}"))

    threads = [threading.Thread(target=work) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    receiver.close()


def check_transport(plan, transport: str) -> tuple[str, str]:
    import torch

    from tandem.transports.endpoints import TargetTransport
    from tandem.v1 import common_pb2

    device = torch.device(plan.target_device)
    draft_device = plan.draft_device
    dtype = getattr(torch, plan.dtype)
    sender = TargetTransport(transport, plan.target_device, plan.dtype, plan.width, ring_bytes=plan.ring_mib << 20,
                             max_inflight=4 * plan.sessions, timeout=30)
    opened = sender.open(common_pb2.TransportPlan(transport=transport, reason="gpu_validate"))
    ctx = mp.get_context("spawn")
    requests, results = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_receiver, args=(opened.SerializeToString(), draft_device, requests, results,
                                                 plan.sessions), daemon=True)
    child.start()
    replies: dict[int, queue.Queue] = {i: queue.Queue() for i in range(plan.sessions)}
    counts = {"ok": 0, "inline": 0, "bad": 0}
    problems: list[str] = []
    lock = threading.Lock()
    try:
        sender.start(opened)
        if results.get(timeout=120)[0] != "ready":
            return "FAIL", "the draft process did not attach"

        def dispatch() -> None:
            while (item := results.get()) is not None:
                replies[item[0]].put(item)

        threading.Thread(target=dispatch, daemon=True).start()

        def session(i: int) -> None:
            rng = torch.Generator().manual_seed(i)
            busy = torch.randn(1024, 1024, device=device) if device.type == "cuda" else None
            previous = None
            for k in range(plan.steps + 1):
                current = None
                if k < plan.steps:
                    tag = i * 100_000 + k
                    rows = int(torch.randint(1, plan.max_rows + 1, (1,), generator=rng))
                    features = pattern(tag, rows, plan.width, dtype).to(device)
                    ready = None
                    if busy is not None:  # the end of "the batch", then "the next forward" queued behind it
                        ready = torch.cuda.Event()
                        ready.record(torch.cuda.current_stream(device))
                        busy = busy @ busy / 1024
                    ref = sender.send(f"s{i}", features, ready)
                    if ref is None:
                        with lock:
                            counts["inline"] += 1
                    else:
                        current = (tag, rows, ref.SerializeToString())
                if previous is not None:  # read the last step only now: the session has sent its next one
                    tag, rows, ref = previous
                    requests.put((i, tag, rows, plan.width, ref))
                    _, got_tag, verdict = replies[i].get(timeout=60)
                    with lock:
                        if verdict == "ok" and got_tag == tag:
                            counts["ok"] += 1
                        else:
                            counts["bad"] += 1
                            problems.append(verdict)
                previous = current
            sender.release(f"s{i}")

        start = time.perf_counter()
        with ThreadPoolExecutor(plan.sessions) as pool:
            list(pool.map(session, range(plan.sessions)))
        wall = time.perf_counter() - start
    finally:
        for _ in range(plan.sessions):
            requests.put(None)
        results.put(None)
        sender.close()
        child.join(30)
        if child.is_alive():
            child.kill()
    steps = counts["ok"] + counts["bad"]
    detail = (f"{counts['ok']}/{steps} steps intact, {counts['inline']} inline (ring full), {plan.sessions} threads, "
              f"{steps / wall:.0f} steps/s, {plan.target_device} -> {draft_device}")
    if problems:
        detail += f"; first problem: {problems[0]}"
    return ("PASS" if counts["bad"] == 0 and counts["ok"] > 0 else "FAIL"), detail


def transports(sizes, record, pair) -> None:
    import torch

    device = sizes.device
    link = Link(device, device, "float32" if sizes.dry else "bfloat16", sizes.width, sizes.ring_mib, sizes.sessions,
                sizes.steps, sizes.max_rows)
    for transport in ("shm", "cuda-ipc"):
        if transport == "cuda-ipc" and not device.startswith("cuda"):
            record(transport, "SKIP", "needs CUDA")
            continue
        try:
            record(transport, *check_transport(link, transport))
        except Exception as exc:  # noqa: BLE001 - the table says what broke
            record(transport, "FAIL", f"{type(exc).__name__}: {str(exc)[:300]}")
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def generate_all(address: str, prompts: list[list[int]], new_tokens: int, k: int, concurrency: int = 1):
    """(token ids per prompt, the transport the features took, errors)."""
    from tandem_tools.profile import ProfileConfig, run_workload

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.jsonl"
        path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
        config = ProfileConfig(out=Path(tmp), prompts=path, num_requests=len(prompts), concurrency=concurrency,
                               max_new_tokens=new_tokens, num_draft_tokens=k, ignore_eos=True)
        records, _ = run_workload(address, config)
    records.sort(key=lambda r: r.index)
    transport = next((r.profile.transport for r in records if r.profile is not None), "?")
    return [r.token_ids for r in records], transport, [r.error for r in records if r.error]


def _pair(sizes, pair: Path | None) -> Path:
    if pair is not None:
        return pair
    if sizes.dry:
        from tandem_tools.tiny import ensure_tiny

        return ensure_tiny()
    if (ROOT / ".gpu" / "demo" / "target").is_dir():  # bench/gpu_bundle.sh's copy
        return ROOT / ".gpu" / "demo"
    from tandem_tools.demo import ensure_demo

    return ensure_demo()


def services(sizes, record, pair) -> None:
    """One stack: target-only (K=0) alone, then EAGLE-3 K=4 alone and batched, greedy in float32."""
    from tandem_tools.serve import launch, stop

    pair = _pair(sizes, pair)
    lines = (pair / "prompts.jsonl").read_text().splitlines() if (pair / "prompts.jsonl").is_file() else []
    prompts = [json.loads(line)["prompt_ids"] for line in lines[: sizes.prompts]] or \
        [[5 + i, 17, 3 * i + 1, 9] for i in range(sizes.prompts)]
    device = sizes.device
    args = ["--port", "0", "--target", str(pair / "target"), "--draft", str(pair / "draft"), "--target-device",
            device, "--draft-device", device, "--dtype", "float32", "--transport", "auto", "--grace-period", "5"]
    env = {**os.environ, "TANDEM_COORDINATOR_SPEC_TOKEN_BUDGET": "0"}  # neither adaptive K nor the gate
    if device.startswith("cuda"):
        import torch

        env.setdefault("TANDEM_TARGET_KV_CACHE_GIB", "8")  # the draft shares the GPU
        env.setdefault("TANDEM_COMPILE", "0")  # the forward stage times the compiled one; this checks the bits
        env.setdefault("TANDEM_CUDA_GRAPHS", "1")  # the draft's rollout graphs (the eager target takes none)
        del torch
    log = Path(tempfile.mkdtemp(prefix="tandem-validate-")) / "serve.log"
    begun = time.monotonic()
    proc, address = launch(args, log, env=env)
    try:
        record("start", "PASS", f"the stack serves in {time.monotonic() - begun:.1f} s")
        reference, _, errors = generate_all(address, prompts, sizes.new_tokens, 0)
        if errors:
            record("target-only", "FAIL", errors[0])
            return
        record("target-only", "PASS", f"{len(prompts)} prompts x {sizes.new_tokens} tokens")
        for concurrency in (1, len(prompts)):
            outputs, used, errors = generate_all(address, prompts, sizes.new_tokens, 4, concurrency)
            same = sum(o == r for o, r in zip(outputs, reference, strict=True))
            ok = not errors and same == len(prompts)
            record(f"EAGLE-3 K=4 at {concurrency}", "PASS" if ok else "FAIL",
                   (errors[0] if errors else f"{same}/{len(prompts)} identical to target-only") + f" (over {used})")
    finally:
        stop(proc, grace=20)
        if log.is_file():
            print(log.read_text(errors="replace")[-6000:], flush=True)
