"""GPU validation in one 10-minute call on one H200: every stage under its own time cap, one JSON line per
item written as it lands, the log and the table rewritten after each stage, all under --out ($OUT there).

    python3 bench/gpu_validate.py --out $OUT            # the GPU of this machine (~8 minutes of work)
    python bench/gpu_validate.py --dry-run --out DIR    # the same stages, tiny, on the CPU (CI, under 2 minutes)

The stages, in order (each a child process killed at its cap, so a hung compile costs only its own stage):

  versions    imports of the three services and the versions of Python, torch, CUDA, Triton, transformers
  pytest      `pytest -m gpu` (the CUDA tests of tests/)
  forward     a random target of Llama-3.1-8B's shape built in bfloat16 in memory: eager, compiled and the
              compiled forward replayed as a CUDA graph at 1, 6, 16 and 96 tokens (a decode, a K=5 verify,
              16 decodes, 16 verifies) beside the weight-read floor, with kernels and host syncs per forward
  rollout     the EAGLE-3 head of that shape: the K=5 rollout eager and as the draft's own graph, batch 1 and 16
  transports  shm and cuda-ipc between two processes, many sessions, every row checked (bench/gpu_links.py)
  services    the three services on the demo pair in float32: EAGLE-3 identical to target-only

Files under --out: validate.jsonl (the items), validate.log (every stage's output), table.md.
bench/gpu_bundle.sh prepares what the GPU machine lacks (wheels, the demo pair) before the call.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
for path in (str(ROOT), str(BENCH)):
    if path not in sys.path:
        sys.path.insert(0, path)

# the test files with CUDA tests (-m gpu picks them out; other files import what the GPU image may lack)
GPU_TESTS = ("tests/test_gpu_paths.py", "tests/test_transports.py", "tests/test_host_syncs.py", "tests/test_static_inputs.py")
# (stage, cap in seconds): 470 s of work together, inside a call's 8 minutes of work
STAGES = (("versions", 30), ("pytest", 80), ("forward", 190), ("rollout", 50), ("transports", 45),
          ("services", 75))


@dataclass(frozen=True)
class Sizes:
    """The shapes and counts of a run: Llama-3.1-8B's on a GPU, tiny ones for the CPU's dry run."""

    dry: bool
    device: str
    shape: dict
    draft_vocab: int
    widths: tuple[int, ...]  # tokens of a forward: a decode, a K=5 verify, 16 decodes, 16 verifies
    compiled_widths: tuple[int, ...]  # those also compiled (a dry run compiles with dynamo alone)
    past: int  # each sequence's committed tokens before the timed forwards
    reps: int
    batches: tuple[int, ...]  # the head's rollout batches
    k: int
    sessions: int  # transports
    steps: int
    width: int
    max_rows: int
    ring_mib: int
    prompts: int  # services
    new_tokens: int
    pytest_args: tuple[str, ...]

    @classmethod
    def make(cls, dry: bool) -> Sizes:
        if dry:
            return cls(True, "cpu", {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
                                     "max_position_embeddings": 2048},
                       draft_vocab=256, widths=(1, 6, 16, 96), compiled_widths=(1,), past=16, reps=3,
                       batches=(1, 16), k=5, sessions=4, steps=8, width=192, max_rows=32, ring_mib=1, prompts=2,
                       new_tokens=12, pytest_args=GPU_TESTS)
        return cls(False, "cuda:0", {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                                     "max_position_embeddings": 8192},
                   draft_vocab=32000, widths=(1, 6, 16, 96), compiled_widths=(1, 16, 6, 96), past=512, reps=20,
                   batches=(1, 16), k=5, sessions=16, steps=30, width=3 * 4096, max_rows=512, ring_mib=64,
                   prompts=8, new_tokens=64, pytest_args=GPU_TESTS)


class Recorder:
    """One JSON line per item, flushed at once: a stage killed at its cap keeps what it wrote."""

    def __init__(self, out: Path, stage: str, deadline: float):
        self.path, self.stage, self.deadline = out / "validate.jsonl", stage, deadline
        self.started = time.monotonic()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def __call__(self, item: str, result: str, detail: str = "", **numbers) -> None:
        line = {"stage": self.stage, "item": item, "result": result, "detail": detail,
                "s": round(time.monotonic() - self.started, 2), **numbers}
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
        print(f"[{time.strftime('%H:%M:%S')}] {self.stage} | {item} | {result} | {detail}", flush=True)


def versions(sizes: Sizes, record: Recorder, pair: Path | None) -> None:
    import platform

    import torch

    record("python", "INFO", platform.python_version())
    found = {"torch": torch.__version__, "cuda": str(torch.version.cuda), "gpus": torch.cuda.device_count()}
    if torch.cuda.is_available():
        found["device"] = torch.cuda.get_device_name(0)
    for name in ("triton", "transformers", "grpc", "pydantic", "safetensors", "numpy"):
        try:
            found[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001 - the table says what is missing
            found[name] = f"missing ({type(exc).__name__})"
    record("versions", "INFO", ", ".join(f"{k} {v}" for k, v in found.items()), **{k: str(v) for k, v in found.items()})
    for module in ("target_server.runners", "target_server.service", "draft_server.service", "coordinator.server",
                   "tandem.transports.endpoints", "tandem_tools.serve"):
        try:
            __import__(module)
            record(f"import {module}", "PASS")
        except Exception as exc:  # noqa: BLE001
            record(f"import {module}", "FAIL", f"{type(exc).__name__}: {str(exc)[:300]}")
    if not sizes.dry and torch.cuda.is_available() is False:
        record("cuda", "FAIL", "torch sees no CUDA device")


def pytest_gpu(sizes: Sizes, record: Recorder, pair: Path | None) -> None:
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
               *sizes.pytest_args]
    try:
        done = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=max(record.left() - 3, 5))
    except subprocess.TimeoutExpired as exc:
        print((exc.stdout or b"")[-4000:] if isinstance(exc.stdout, str) else "", flush=True)
        record("pytest -m gpu", "FAIL", "past its cap")
        return
    print(done.stdout[-8000:], done.stderr[-4000:], flush=True)
    summary = next((line for line in reversed(done.stdout.splitlines()) if line.strip()), "")
    # 5: nothing collected (no test selected), which a CPU can meet
    result = "PASS" if done.returncode in (0, 5) else "FAIL"
    record("pytest -m gpu", result, summary[:300], returncode=done.returncode)


def run_stage(name: str, sizes: Sizes, out: Path, cap: float, pair: Path | None) -> None:
    """Inside the stage's child process."""
    record = Recorder(out, name, time.monotonic() + cap)
    if name in ("versions", "pytest"):
        stage = versions if name == "versions" else pytest_gpu
    elif name in ("forward", "rollout"):
        import gpu_stages

        stage = getattr(gpu_stages, name)
    else:
        import gpu_links

        stage = getattr(gpu_links, name)
    try:
        stage(sizes, record, pair)
    except Exception as exc:  # noqa: BLE001 - the table says what broke
        import traceback

        traceback.print_exc()
        record("(stage)", "FAIL", f"{type(exc).__name__}: {str(exc)[:300]}")


def render(out: Path) -> tuple[str, bool]:
    """The table of every item so far (markdown) and whether one failed."""
    rows = [json.loads(line) for line in (out / "validate.jsonl").read_text().splitlines() if line.strip()] \
        if (out / "validate.jsonl").is_file() else []
    lines = ["| stage | item | result | detail |", "|---|---|---|---|"]
    lines += [f"| {r['stage']} | {r['item']} | {r['result']} | {r['detail']} |" for r in rows]
    return "\n".join(lines) + "\n", any(r["result"] == "FAIL" for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: checks the script itself")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-validate")),
                   help="where validate.jsonl, validate.log and table.md go (default $OUT)")
    p.add_argument("--pair", type=Path, help="target/ and draft/ for the services (default: .gpu/demo, else the "
                                             "demo pair; the tiny pair with --dry-run)")
    p.add_argument("--only", default="", help="comma-separated stages to run (default: all)")
    p.add_argument("--budget-s", type=float, default=480, help="no stage starts past this many seconds")
    p.add_argument("--stage", help=argparse.SUPPRESS)  # a child process's one stage
    args = p.parse_args(argv)
    sizes = Sizes.make(args.dry_run)
    args.out.mkdir(parents=True, exist_ok=True)
    caps = dict(STAGES)
    if args.stage:
        run_stage(args.stage, sizes, args.out, caps[args.stage], args.pair)
        return 0
    wanted = set(filter(None, args.only.split(","))) or set(caps)
    started = time.monotonic()
    (args.out / "validate.jsonl").unlink(missing_ok=True)
    log = (args.out / "validate.log").open("w")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), str(BENCH), os.environ.get("PYTHONPATH")]))}
    if args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU's run, also where a GPU is
    print(json.dumps({"sizes": asdict(sizes)}), file=log, flush=True)
    for name, cap in STAGES:
        if name not in wanted:
            continue
        left = args.budget_s - (time.monotonic() - started)
        if left < 5:
            Recorder(args.out, name, 0)("(stage)", "SKIP", "the run's budget is spent")
            continue
        cap = min(cap, left)
        command = [sys.executable, str(Path(__file__).resolve()), "--stage", name, "--out", str(args.out)]
        command += ["--dry-run"] if args.dry_run else []
        command += ["--pair", str(args.pair)] if args.pair else []
        print(f"== {name} (cap {cap:.0f} s)", file=log, flush=True)
        begun = time.monotonic()
        child = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            child.wait(cap + 5)  # the child's own deadline is cap; the kill is the backstop
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, 9)
            child.wait()
            Recorder(args.out, name, 0)("(stage)", "FAIL", f"killed at its cap of {cap:.0f} s")
        if child.returncode not in (0, -9):
            Recorder(args.out, name, 0)("(stage)", "FAIL", f"the stage's process exited {child.returncode}")
        print(f"== {name} took {time.monotonic() - begun:.1f} s", file=log, flush=True)
        table, _ = render(args.out)
        (args.out / "table.md").write_text(table)
    table, failed = render(args.out)
    where = "CPU (dry run)" if args.dry_run else sizes.device
    table += f"\n{where}: {time.monotonic() - started:.0f} s in all\n"
    (args.out / "table.md").write_text(table)
    print(table)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
