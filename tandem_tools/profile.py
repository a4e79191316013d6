"""`tandem profile`: run a workload with per-request profiling on and write what crossed between the
processes and where the time went.

    tandem profile --server HOST:PORT ...            a running coordinator
    tandem profile --target DIR --draft DIR ...      starts the three processes itself (`tandem serve`),
                                                     so the traffic is real; no --target: the tiny pair

Writes, under --out:
    report.json    links (bytes, messages, by kind), totals, latency by stage, acceptance, transport, the
                   grammar's cost (--grammar), and every request round by round (tandem_tools/report.py)
    trace.json     Chrome trace / Perfetto: each round across the processes on one timeline (tandem_tools/trace.py)
    traffic.png    bytes per generated token per link and kind, time per round by stage (tandem_tools/plot.py)
and prints a summary table. Every request asks the coordinator for its profile (GenerateRequest.profile);
when this command started the services itself it also reads their /metrics before and after, and puts
what each process counted at its own send site beside the coordinator's join (report transport.send_site).
"""

from __future__ import annotations

import argparse
import json
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from coordinator.client import DEFAULT_MAX_MESSAGE_MIB, build_request, key_metadata, stats_from_pb
from tandem import security
from tandem.v1 import coordinator_pb2_grpc
from tandem_tools.report import RequestRecord, build_report, summary
from tandem_tools.serve import launch, metrics_addresses
from tandem_tools.serve import stop as stop_serve

# Prompts of the kind the built-in tiny models were trained on (Python source).
DEFAULT_PROMPTS = [
    "def main(",
    "import os\nimport sys\n\n",
    "class Config:\n    def __init__(self",
    "for i in range(len(items)):\n    ",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "    return self._cache[key]\n\n    def ",
    "if __name__ == '__main__':\n    ",
    "with open(path) as f:\n    for line in f:\n        ",
]


@dataclass
class ProfileConfig:
    out: Path
    server: str | None = None
    target: str | None = None
    draft: str | None = None
    prompts: Path | None = None
    num_requests: int = 16
    concurrency: int = 4
    max_new_tokens: int = 64
    num_draft_tokens: int = 4
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    timeout: float = 600.0
    target_device: str = "cpu"
    draft_device: str = "cpu"
    dtype: str = "float32"
    overlap: bool = True  # a launched stack: the coordinator's --overlap
    transport: str = "auto"  # a launched stack: the feature path target -> draft
    tree: object = None  # TreeParams: every request asks for it (the tree gate may run a chain)
    grammar: object = None  # GrammarSpec: every request is constrained by it


def load_prompts(path: Path | None) -> list[str | list[int]]:
    """One prompt per line; a .jsonl file (or lines that are JSON objects) may give "prompt" or "prompt_ids"."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    prompts: list[str | list[int]] = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        if path.suffix == ".jsonl" or line.lstrip().startswith("{"):
            item = json.loads(line)
            if isinstance(item, str):
                prompts.append(item)
            elif "prompt_ids" in item:
                prompts.append([int(i) for i in item["prompt_ids"]])
            else:
                prompts.append(str(item["prompt"]))
        else:
            prompts.append(line)
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts


# -- the services: a running coordinator, or three processes started here -------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedStack:
    """`tandem serve` as a child process, with /metrics on every service (unless with_metrics is False)."""

    def __init__(self, config: ProfileConfig, log: Path, with_metrics: bool = True):
        args = ["--port", "0", "--target-device", config.target_device,
                "--draft-device", config.draft_device, "--dtype", config.dtype,
                "--overlap", "on" if config.overlap else "off", "--transport", config.transport]
        if config.target is not None:
            args += ["--target", config.target]
        if config.draft is not None:
            args += ["--draft", config.draft]
        if with_metrics:
            args += ["--metrics-port", "0"]  # each service a free port, as serve prints them
        self.log = log
        printed: list[str] = []
        self.proc, self.address = launch(args, log, lines=printed)
        self.metrics = metrics_addresses(printed)

    def stop(self) -> None:
        stop_serve(self.proc)


def scrape_sent_bytes(address: str) -> dict[str, dict[str, int]]:
    """tandem:transport_sent_bytes_total of one service: link -> kind -> bytes."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, dict[str, int]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "tandem:transport_sent_bytes":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                out.setdefault(sample.labels["link"], {})[sample.labels["kind"]] = int(sample.value)
    return out


def _diff(after: dict, before: dict) -> dict[str, dict[str, int]]:
    return {link: {kind: n - before.get(link, {}).get(kind, 0) for kind, n in kinds.items()}
            for link, kinds in after.items()}


# -- the workload -----------------------------------------------------------------------------------


def run_request(stub, index: int, prompt: str | list[int], config: ProfileConfig) -> RequestRecord:
    params = {"max_new_tokens": config.max_new_tokens, "num_draft_tokens": config.num_draft_tokens,
              "temperature": config.temperature, "ignore_eos": config.ignore_eos, "tree": config.tree,
              "grammar": config.grammar}
    if config.seed is not None:
        params["seed"] = config.seed + index
    if isinstance(prompt, str):
        request = build_request(prompt=prompt, **params)
    else:
        request = build_request(prompt_ids=prompt, **params)
    request.profile = True
    record = RequestRecord(index=index, sent_ns=time.monotonic_ns())
    try:
        for msg in stub.GenerateStream(request, timeout=config.timeout, metadata=key_metadata()):
            record.delta_ns.append(time.monotonic_ns())
            record.delta_tokens.append(len(msg.token_ids))
            record.token_ids.extend(msg.token_ids)
            if msg.finish_reason:
                record.finish_reason = msg.finish_reason
                record.stats = stats_from_pb(msg.stats)
                record.stats["num_rounds_without_draft"] = getattr(msg.stats, "num_rounds_without_draft", 0)
                if msg.HasField("profile"):
                    record.profile = msg.profile
    except grpc.RpcError as exc:
        record.error = f"{exc.code().name}: {exc.details()}"
    if record.error is None and record.profile is None:
        record.error = "the coordinator sent no profile"
    return record


def run_workload(address: str, config: ProfileConfig) -> tuple[list[RequestRecord], float]:
    prompts = load_prompts(config.prompts)
    limit = DEFAULT_MAX_MESSAGE_MIB << 20
    options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
    with security.channel(address, options, security.client_tls()) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        start = time.monotonic()
        with ThreadPoolExecutor(config.concurrency) as pool:
            records = list(pool.map(lambda i: run_request(stub, i, prompts[i % len(prompts)], config),
                                    range(config.num_requests)))
        wall = time.monotonic() - start
    return records, wall


# -- the command ------------------------------------------------------------------------------------


def profile(config: ProfileConfig, echo=print) -> dict:
    """Run the workload, write report.json, trace.json and traffic.png under config.out; returns the report."""
    from tandem_tools.plot import plot_report
    from tandem_tools.trace import build_trace

    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    stack = None
    address = config.server
    if address is None:
        echo("starting the target, draft and coordinator services (tandem serve) ...")
        stack = LaunchedStack(config, out / "serve.log")
        address = stack.address
    try:
        before = {name: scrape_sent_bytes(a) for name, a in stack.metrics.items()} if stack else None
        records, wall = run_workload(address, config)
        send_site = None
        if stack is not None:
            send_site = {}
            for name, a in stack.metrics.items():
                for link, kinds in _diff(scrape_sent_bytes(a), before[name]).items():
                    send_site[link] = kinds
    finally:
        if stack is not None:
            stack.stop()
    run_config = {k: (str(v) if isinstance(v, Path) else v.model_dump() if hasattr(v, "model_dump") else v)
                  for k, v in vars(config).items()}
    run_config["server"] = address if config.server else None
    run_config["head"] = _head_kind(config.draft)
    report = build_report(records, wall, run_config, send_site)
    trace = build_trace(records)
    report["transport"]["clock_offsets_ns"] = trace["otherData"]["clock_offsets_ns"]
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "trace.json").write_text(json.dumps(trace))
    plot_report(report, out / "traffic.png")
    echo(summary(report))
    if report["errors"]:
        echo(f"{len(report['errors'])} requests failed, the first: {report['errors'][0]['error']}")
    echo(f"wrote {out / 'report.json'}, {out / 'trace.json'} (open in https://ui.perfetto.dev), "
         f"{out / 'traffic.png'}")
    return report


def _head_kind(draft: str | None) -> str | None:
    """The kind of head of a draft directory given here (None: not known, e.g. behind --server)."""
    if draft is None:
        return None
    from draft_server.checkpoint import head_kind

    try:
        return head_kind(draft)
    except ValueError:
        return None


def cmd_profile(args: argparse.Namespace) -> int:
    """`tandem profile`: the flags as a ProfileConfig; exits 1 when no request completed."""
    if args.num_requests < 1 or args.concurrency < 1:
        raise ValueError("--num-requests and --concurrency must be at least 1")
    config = ProfileConfig(
        out=Path(args.out), server=args.server, target=args.target, draft=args.draft,
        prompts=Path(args.prompts) if args.prompts else None, num_requests=args.num_requests,
        concurrency=args.concurrency, max_new_tokens=args.max_new_tokens, num_draft_tokens=args.num_draft_tokens,
        temperature=args.temperature, seed=args.seed, ignore_eos=args.ignore_eos, timeout=args.timeout,
        target_device=args.target_device, draft_device=args.draft_device, dtype=args.dtype,
        overlap=args.overlap == "on", transport=args.transport, tree=args.tree, grammar=args.grammar,
    )
    report = profile(config)
    return 1 if report["totals"]["completed"] == 0 else 0
