"""Prometheus /metrics on every service of a running `tandem serve`: scrapeable while requests run,
counters that agree with `generate --json` stats, bytes per link that agree between sender and
receiver; `tandem profile --server` against the same stack; metrics off unless a port is given."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.client import TandemClient
from tandem.config import ConfigError, TargetSettings, load_settings
from tandem_tools.serve import metrics_addresses

SERVICES = ("coordinator", "target", "draft")


def free_ports(count: int) -> int:
    """A port N with N .. N + count - 1 free now."""
    import socket

    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports")


@dataclass
class Stack:
    address: str
    metrics: dict[str, str]
    proc: subprocess.Popen


@pytest.fixture(scope="module")
def stack(tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("metrics") / "serve.log"
    base = free_ports(3)  # serve's --metrics-port N: the coordinator on N, the target on N + 1, the draft on N + 2
    metrics = {name: f"127.0.0.1:{base + i}" for i, name in enumerate(SERVICES)}
    args = [sys.executable, "-m", "tandem_tools.cli", "serve", "--target", str(tiny_dir / "target"),
            "--draft", str(tiny_dir / "draft"), "--port", "0", "--transport", "grpc",  # features relayed: counted per link
            "--metrics-port", str(base)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    printed = []
    for line in proc.stdout:
        printed.append(line)
        if "listening on" in line:
            break
    else:
        raise RuntimeError(log.read_text()[-3000:])
    assert metrics_addresses(printed) == metrics, printed
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    yield Stack(line.rsplit(" ", 1)[1].strip(), metrics, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, log.read_text()[-3000:]


def scrape(address: str) -> dict[tuple, float]:
    """Every sample: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_idle(stack: Stack, timeout: float = 20.0) -> None:
    """No request running, no session open, and every byte counter settled on all three services
    (a finished request's last control message can still be in flight when the coordinator is done)."""
    deadline = time.monotonic() + timeout

    def snapshot() -> tuple:
        samples = [scrape(stack.metrics[name]) for name in SERVICES]
        busy = (value(samples[0], "tandem:num_requests_running"), value(samples[1], "tandem:num_sessions"),
                value(samples[2], "tandem:num_sessions"))
        counters = tuple(sorted((key, v) for s in samples for key, v in s.items() if "transport_" in key[0]))
        return busy, counters

    previous = None
    while True:
        current = snapshot()
        if current[0] == (0, 0, 0) and current == previous:
            return
        assert time.monotonic() < deadline, f"services still busy: {current[0]}"
        previous = current
        time.sleep(0.2)


def test_every_service_serves_metrics_while_a_generation_runs(stack):
    with TandemClient(stack.address, timeout=120) as client:
        stream = client.generate_stream(prompt_ids=[5, 6, 7], max_new_tokens=2000, ignore_eos=True)
        next(stream)
        next(stream)
        coordinator, target, draft = (scrape(stack.metrics[name]) for name in SERVICES)
        stream.close()
    assert value(coordinator, "tandem:num_requests_running") >= 1
    assert value(coordinator, "tandem:num_requests_waiting") == 0 and value(coordinator, "tandem:num_preemptions_total") == 0
    assert value(coordinator, "tandem:time_to_first_token_seconds_count") >= 1
    assert value(target, "tandem:num_sessions") >= 1 and value(draft, "tandem:num_sessions") >= 1
    assert 3 <= value(target, "tandem:kv_cache_used_tokens") < 100  # what it has used, not its max_new_tokens
    assert 3 <= value(draft, "tandem:kv_cache_used_tokens") < 100  # the draft's committed pairs, of its own budget
    assert 0 < value(draft, "tandem:kv_cache_usage_perc") < 1
    assert value(target, "tandem:step_compute_seconds_count", step="verify") >= 1
    assert value(draft, "tandem:step_compute_seconds_count", step="propose") >= 1
    for samples in (coordinator, target, draft):
        assert any(name == "tandem:transport_sent_bytes_total" for name, _ in samples)
    wait_idle(stack)
    after = scrape(stack.metrics["coordinator"])
    assert value(after, "tandem:request_success_total", finished_reason="abort") >= 1


def test_counters_agree_with_generate_json_stats(stack):
    wait_idle(stack)
    before = scrape(stack.metrics["coordinator"])
    runs = [("def main(", 24, 3), ("import os\n", 17, 5), ("class Foo:\n", 30, 1)]
    results = []
    for prompt, max_new, k in runs:
        out = subprocess.run(
            [sys.executable, "-m", "tandem_tools.cli", "generate", "--server", stack.address, "--prompt", prompt,
             "--max-new-tokens", str(max_new), "-k", str(k), "--ignore-eos", "--json"],
            capture_output=True, text=True, timeout=120, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert out.returncode == 0, out.stderr
        results.append(json.loads(out.stdout))
    after = scrape(stack.metrics["coordinator"])

    def delta(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    stats = [r["stats"] for r in results]
    assert delta("tandem:spec_decode_num_drafts_total") == sum(s["num_rounds"] for s in stats)
    assert delta("tandem:spec_decode_num_draft_tokens_total") == sum(s["num_draft_tokens"] for s in stats)
    assert delta("tandem:spec_decode_num_accepted_tokens_total") == sum(s["num_accepted_tokens"] for s in stats)
    for position in range(5):
        accepted = sum(s["accepted_per_position"][position] for s in stats if position < len(s["accepted_per_position"]))
        assert delta("tandem:spec_decode_num_accepted_tokens_per_pos_total", position=str(position)) == accepted
    assert delta("tandem:generation_tokens_total") == sum(len(r["token_ids"]) for r in results)
    assert delta("tandem:request_success_total", finished_reason="length") == len(runs)
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"tandem:{histogram}_count") == len(runs)
    # ITL: one observation per round after the first token (every round here commits a token)
    assert delta("tandem:inter_token_latency_seconds_count") == sum(s["num_rounds"] for s in stats)
    # vLLM's dashboards compute the mean acceptance length from these counters: the same number
    drafts = delta("tandem:spec_decode_num_drafts_total")
    mean = 1 + delta("tandem:spec_decode_num_accepted_tokens_total") / drafts
    assert mean == pytest.approx(1 + sum(s["num_accepted_tokens"] for s in stats) / sum(s["num_rounds"] for s in stats))


def test_bytes_per_link_agree_between_the_sender_and_the_receiver(stack):
    # (a cancelled stream's last messages can be sent and never read: compare one finished generation)
    wait_idle(stack)
    before = [scrape(stack.metrics[name]) for name in SERVICES]
    with TandemClient(stack.address, timeout=120) as client:
        client.generate(prompt="def main(", max_new_tokens=16)
    wait_idle(stack)
    after = [scrape(stack.metrics[name]) for name in SERVICES]

    def delta(service: str, direction: str, link: str, kind: str) -> float:
        i = SERVICES.index(service)
        labels = {"link": link, "kind": kind, "transport": "grpc"}
        name = f"tandem:transport_{direction}_bytes_total"
        return value(after[i], name, **labels) - value(before[i], name, **labels)

    for kind in ("features", "token_ids", "control"):
        for sender, receiver, link in (("target", "coordinator", "target->coordinator"),
                                       ("coordinator", "target", "coordinator->target"),
                                       ("coordinator", "draft", "coordinator->draft"),
                                       ("draft", "coordinator", "draft->coordinator")):
            sent, received = delta(sender, "sent", link, kind), delta(receiver, "received", link, kind)
            assert sent == received, (link, kind)
            assert sent > 0 or (kind == "features" and link in ("coordinator->target", "draft->coordinator"))
    assert delta("target", "sent", "target->coordinator", "features") % (3 * 64 * 4) == 0


def test_profile_against_a_running_server(stack, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tandem_tools.cli", "profile", "--server", stack.address, "-n", "3", "-c", "3",
         "--max-new-tokens", "12", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=180, check=False,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["totals"]["completed"] == 3
    assert report["links"]["target->coordinator"]["by_kind"]["features"] > 0
    assert (tmp_path / "trace.json").is_file() and (tmp_path / "traffic.png").is_file()


def test_metrics_are_off_unless_a_port_is_given(tiny_dir, monkeypatch):
    assert load_settings(TargetSettings, model=str(tiny_dir / "target")).metrics_port is None
    monkeypatch.setenv("TANDEM_TARGET_METRICS_PORT", "9400")
    assert load_settings(TargetSettings, model=str(tiny_dir / "target")).metrics_port == 9400
    assert load_settings(TargetSettings, model=str(tiny_dir / "target"), metrics_port=9500).metrics_port == 9500
    monkeypatch.setenv("TANDEM_TARGET_METRICS_PORT", "99999")
    with pytest.raises(ConfigError, match="METRICS_PORT"):
        load_settings(TargetSettings, model=str(tiny_dir / "target"))
