"""`tandem bench --openai URL --model NAME`: drive any OpenAI-compatible server (Tandem's front, vLLM,
SGLang) with streamed chat completions, c requests in flight (vLLM's `bench serve --max-concurrency`),
and report tokens/s, TTFT, ITL and latency percentiles; with `--grpc HOST:PORT`, the same prompts and
token counts through a Tandem coordinator's gRPC GenerateStream too, the cases taking turns block by
block, so that the two paths are measured side by side in one run.

Prompts: a JSONL file of chat conversations (`--prompts`), one per line, as `vllm bench serve
--dataset-name custom` reads them ({"prompt": "..."}: one user turn), or with the whole conversation
({"messages": [{"role", "content"}, ...]}, or ShareGPT's {"conversations": [{"from", "value"}, ...]});
trailing assistant turns are dropped. Every request sends ignore_eos and max_tokens, so that every
server generates the same number of tokens (the usage the server reports is checked).

Times (client side, as vLLM's benchmark measures them): TTFT from sending to the first content; ITL
the gaps between content chunks (a speculative round's chunk brings several tokens: TPOT is the
per-token figure); TPOT (latency - TTFT) / (tokens - 1); latency to the end of the stream.
"""

from __future__ import annotations

import json
import os
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tandem.stats import percentile

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}

BUILTIN_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "def parse_args(argv):\n    \"\"\"Parse the command line.\"\"\"\n",
    "Explain what a context manager is in Python, with an example.",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "Write a function that merges two sorted lists.",
    "How do I read a JSON file in Python?",
    "for i in range(10):\n",
]


def load_conversations(path: Path) -> list[list[dict]]:
    """One chat conversation per JSONL line (see the module docstring)."""
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if "prompt" in item:
            messages = [{"role": "user", "content": item["prompt"]}]
        else:
            turns = item.get("messages") or item.get("conversations")
            if not turns:
                raise ValueError(f"{path}:{number}: no prompt, messages or conversations")
            messages = [{"role": ROLES[t.get("role") or t.get("from")], "content": t.get("content", t.get("value"))}
                        for t in turns]
        while messages and messages[-1]["role"] == "assistant":
            messages.pop()
        if not messages:
            raise ValueError(f"{path}:{number}: the conversation has no user turn")
        out.append(messages)
    return out


@dataclass
class Timing:
    """One streamed request, as its client saw it."""

    tokens: int
    ttft: float
    latency: float
    gaps: list[float] = field(default_factory=list)  # between content chunks

    @property
    def tpot(self) -> float:
        return (self.latency - self.ttft) / (self.tokens - 1) if self.tokens > 1 else 0.0


class OpenAIChat:
    """Streamed chat completions over HTTP (httpx, one connection pool for all clients)."""

    label = "openai-http"

    def __init__(self, url: str, model: str, timeout: float = 600.0):
        import httpx

        self.url = url.rstrip("/").removesuffix("/v1") + "/v1/chat/completions"
        self.model = model
        from coordinator.client import key_metadata
        from tandem.security import CA_ENV

        # the front's API key and CA as the gRPC client takes them: $TANDEM_API_KEY, $TANDEM_TLS_CA
        headers = dict(key_metadata() or ())  # authorization: Bearer <key>
        verify = ssl.create_default_context(cafile=os.environ[CA_ENV]) if os.environ.get(CA_ENV) else True
        self.http = httpx.Client(timeout=timeout, limits=httpx.Limits(max_connections=1024,
                                                                      max_keepalive_connections=1024),
                                 headers=headers, verify=verify)

    def run(self, messages: list[dict], max_tokens: int, temperature: float, seed: int) -> Timing:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                "seed": seed, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        first = last = None
        gaps, tokens = [], 0
        with self.http.stream("POST", self.url, json=body) as response:
            if response.status_code != 200:
                response.read()
                raise RuntimeError(f"{response.status_code}: {response.text}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        if first is None:
                            first = now
                        else:
                            gaps.append(now - last)
                        last = now
        end = time.perf_counter()
        if first is None:
            raise RuntimeError("no content came back")
        return Timing(tokens or max_tokens, first - start, end - start, gaps)

    def close(self) -> None:
        self.http.close()


class GrpcChat:
    """The same conversations through a Tandem coordinator's GenerateStream: the prompt rendered with the
    target's chat template in this process (what the HTTP front renders), streamed over gRPC."""

    label = "grpc"

    def __init__(self, address: str, render: Callable[[list[dict]], list[int]], timeout: float = 600.0):
        from coordinator.client import TandemClient

        self.client = TandemClient(address, timeout=timeout)
        self.render = render
        self._ids: dict[int, list[int]] = {}
        self._lock = threading.Lock()

    def run(self, messages: list[dict], max_tokens: int, temperature: float, seed: int) -> Timing:
        key = id(messages)
        with self._lock:
            ids = self._ids.get(key)
            if ids is None:
                ids = self._ids[key] = self.render(messages)
        start = time.perf_counter()
        first = last = None
        gaps, tokens = [], 0
        for delta in self.client.generate_stream(prompt_ids=ids, max_new_tokens=max_tokens, temperature=temperature,
                                                 seed=seed, ignore_eos=True):
            tokens += len(delta.token_ids)
            if delta.text:
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
        end = time.perf_counter()
        return Timing(tokens, first - start, end - start, gaps)

    def close(self) -> None:
        self.client.close()


def run_openai_bench(runners: list, conversations: list[list[dict]], concurrency: list[int], num_requests: int,
                     max_tokens: int, temperature: float, seed: int = 0,
                     echo: Callable[[str], None] = print, cpu: Callable[[], float] | None = None) -> list[dict]:
    """Each runner at each concurrency: `num_requests` requests (at least 4 per client), in blocks of 4c
    that take turns between the runners; one result dict per (runner, concurrency). `cpu()`: CPU seconds
    the server's processes have used so far, to report their CPU time per generated token of each runner."""
    results = []
    for runner in runners:  # warm up: first-call set-up is not measured
        runner.run(conversations[0], 4, temperature, seed)
    for c in concurrency:
        n = max(num_requests, 4 * c)
        timings: dict[str, list[Timing]] = {r.label: [] for r in runners}
        seconds = dict.fromkeys(timings, 0.0)
        cpu_seconds = dict.fromkeys(timings, 0.0)
        block = 4 * c
        for first in range(0, n, block):
            size = min(block, n - first)
            turn = (first // block) % len(runners)
            for runner in runners[turn:] + runners[:turn]:  # rotated: neither always goes first

                def one(i: int, runner=runner, first=first) -> Timing:
                    return runner.run(conversations[(first + i) % len(conversations)], max_tokens, temperature,
                                      seed + first + i)

                started, used = time.perf_counter(), cpu() if cpu is not None else 0.0
                with ThreadPoolExecutor(c) as pool:
                    timings[runner.label] += pool.map(one, range(size))
                seconds[runner.label] += time.perf_counter() - started
                cpu_seconds[runner.label] += cpu() - used if cpu is not None else 0.0
            echo(f"bench: concurrency {c}: {min(first + block, n)}/{n} requests")
        for runner in runners:
            result = summarize(runner.label, c, timings[runner.label], seconds[runner.label])
            if cpu is not None:
                result["server_cpu_ms_per_token"] = 1e3 * cpu_seconds[runner.label] / result["generated_tokens"]
            results.append(result)
    return results


def summarize(label: str, concurrency: int, timings: list[Timing], seconds: float) -> dict:
    tokens = sum(t.tokens for t in timings)
    ttft = [t.ttft for t in timings]
    itl = [g for t in timings for g in t.gaps]
    latency = [t.latency for t in timings]
    tpot = [t.tpot for t in timings if t.tokens > 1]
    return {
        "path": label, "concurrency": concurrency, "requests": len(timings), "generated_tokens": tokens,
        "seconds": round(seconds, 3), "tokens_per_s": tokens / seconds if seconds else 0.0,
        "ttft_mean_ms": 1e3 * sum(ttft) / len(ttft), "ttft_p50_ms": 1e3 * percentile(ttft, 50),
        "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "tpot_mean_ms": 1e3 * sum(tpot) / len(tpot) if tpot else 0.0,
        "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99),
        "latency_p50_s": percentile(latency, 50), "latency_p99_s": percentile(latency, 99),
    }


def openai_table(results: list[dict]) -> str:
    lines = [("| path | concurrency | requests | tokens/s | TTFT mean / p50 / p99 (ms) | TPOT mean (ms) "
             "| ITL p50 / p99 (ms) | latency p50 / p99 (s) |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(
            f"| {r['path']} | {r['concurrency']} | {r['requests']} | {r['tokens_per_s']:.1f} "
            f"| {r['ttft_mean_ms']:.1f} / {r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} | {r['tpot_mean_ms']:.2f} "
            f"| {r['itl_p50_ms']:.2f} / {r['itl_p99_ms']:.2f} | {r['latency_p50_s']:.2f} / {r['latency_p99_s']:.2f} |")
    return "\n".join(lines)
