"""Prometheus metrics of the services (prometheus_client), served on /metrics when --metrics-port is set.

Names follow vLLM's with a `tandem:` prefix, so that dashboards built for vLLM's speculative
decoding read them (counters get prometheus_client's `_total` suffix, as vLLM's do):

coordinator
    tandem:spec_decode_num_drafts_total               verify rounds of speculative requests
    tandem:spec_decode_num_draft_tokens_total         draft tokens proposed
    tandem:spec_decode_num_accepted_tokens_total      draft tokens accepted
    tandem:spec_decode_num_accepted_tokens_per_pos_total{position}
        so mean acceptance length = 1 + accepted / drafts, the number `generate --json` reports
    tandem:time_to_first_token_seconds                histogram, from the request to its first token
    tandem:inter_token_latency_seconds                histogram, one observation per round: its time / its tokens
    tandem:e2e_request_latency_seconds                histogram
    tandem:request_success_total{finished_reason}     stop | length | abort (client left) | error
    tandem:prompt_tokens_total, tandem:generation_tokens_total, tandem:num_requests_running
    tandem:round_seconds                              histogram of a round's wall time in the coordinator
target and draft
    tandem:step_compute_seconds{step}                 the engine's part of a step (prefill, verify, propose)
    tandem:step_queue_seconds{step}                   waiting for the engine behind another session
    tandem:step_codec_seconds{step}                   feature encode (target) / decode (draft)
    tandem:num_sessions                               open sessions
    tandem:kv_cache_usage_perc, tandem:kv_cache_used_tokens
                                                      what the sessions hold of the service's KV budget
every service
    tandem:transport_sent_bytes_total{link, kind, transport}       (tandem/traffic.py: links and kinds)
    tandem:transport_sent_messages_total{link, transport}
    tandem:transport_received_bytes_total{link, kind, transport}
    tandem:transport_received_messages_total{link, transport}

The HTTP front's /metrics also gives the four spec_decode counters under vLLM's own names
(vllm:spec_decode_..., vllm_spec_decode_aliases): `vllm bench serve` reads those to report the
acceptance rate and length of a run against any server.

No torch here.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily

from tandem.timing import StepClock
from tandem.traffic import Traffic

# vLLM's buckets, with finer low ones for ITL: a speculative round on a GPU commits several tokens in
# a few milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# No `_created` series next to every counter and histogram: noise to a scraper (vLLM leaves them out too).
disable_created_metrics()

STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0, 10.0, 30.0)


class TrafficCollector:
    """Exposes a process's Traffic counters at scrape time (no Prometheus call on the hot path)."""

    def __init__(self, traffic: Traffic):
        self.traffic = traffic

    def collect(self):
        families = {}
        for direction in ("sent", "received"):
            families[direction] = (
                CounterMetricFamily(f"tandem:transport_{direction}_bytes", f"Bytes {direction}, by link and kind",
                                    labels=["link", "kind", "transport"]),
                CounterMetricFamily(f"tandem:transport_{direction}_messages", f"Messages {direction}, by link",
                                    labels=["link", "transport"]),
            )
        for (direction, link, transport), count in sorted(self.traffic.snapshot().items()):
            by_bytes, by_messages = families[direction]
            for kind, n in count.bytes.items():
                by_bytes.add_metric([link, kind, transport], n)
            by_messages.add_metric([link, transport], count.messages)
        for pair in families.values():
            yield from pair


def new_registry(traffic: Traffic) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(TrafficCollector(traffic))
    return registry


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> str:
    """Serve /metrics on host:port (0 = any free port) in a daemon thread; returns HOST:PORT."""
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise OSError(f"cannot serve metrics on {host}:{port}: {exc}") from None
    return f"{host}:{server.server_port}"


class StepMetrics:
    """The target's and the draft's: time per step, split as the StepClock splits it."""

    def __init__(self, registry: CollectorRegistry):
        self.compute = Histogram("tandem:step_compute_seconds", "The engine's part of a step", ["step"],
                                 buckets=STEP_BUCKETS, registry=registry)
        self.queue = Histogram("tandem:step_queue_seconds", "Waiting for the engine behind another session",
                               ["step"], buckets=STEP_BUCKETS, registry=registry)
        self.codec = Histogram("tandem:step_codec_seconds", "Feature encode (target) or decode (draft)", ["step"],
                               buckets=STEP_BUCKETS, registry=registry)
        self.sessions = Gauge("tandem:num_sessions", "Open sessions", registry=registry)
        self._registry, self._kv = registry, None

    def count_sessions(self, num_sessions: Callable[[], int]) -> None:
        self.sessions.set_function(num_sessions)

    def count_kv(self, usage: Callable[[], float], tokens: Callable[[], int]) -> None:
        if self._kv is None:
            self._kv = (Gauge("tandem:kv_cache_usage_perc", "Share of the KV budget the sessions hold (0 when "
                              "unbounded)", registry=self._registry),
                        Gauge("tandem:kv_cache_used_tokens", "KV tokens the sessions hold", registry=self._registry))
        self._kv[0].set_function(usage)
        self._kv[1].set_function(tokens)

    def observe(self, step: str, clock: StepClock) -> None:
        self.compute.labels(step).observe(clock.compute_ns * 1e-9)
        self.queue.labels(step).observe(clock.queue_ns * 1e-9)
        if clock.codec_ns:
            self.codec.labels(step).observe(clock.codec_ns * 1e-9)


class CoordinatorMetrics:
    """Request latencies, finish reasons and the speculative-decoding counters, as vLLM names them."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.num_drafts = Counter("tandem:spec_decode_num_drafts", "Verify rounds of speculative requests",
                                  registry=r)
        self.num_draft_tokens = Counter("tandem:spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.num_accepted_tokens = Counter("tandem:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                           registry=r)
        self.accepted_per_pos = Counter("tandem:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by position in the draft (0-based)", ["position"],
                                        registry=r)
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "Time to the first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("tandem:inter_token_latency_seconds", "Per round: its time divided by its tokens",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("tandem:e2e_request_latency_seconds", "Request latency, end to end",
                             buckets=E2E_BUCKETS, registry=r)
        self.round = Histogram("tandem:round_seconds", "A round's wall time in the coordinator", buckets=ITL_BUCKETS,
                               registry=r)
        self.success = Counter("tandem:request_success", "Finished requests by reason", ["finished_reason"],
                               registry=r)
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens of the requests", registry=r)
        self.generation_tokens = Counter("tandem:generation_tokens", "Tokens generated", registry=r)
        self.running = Gauge("tandem:num_requests_running", "Requests in flight", registry=r)
        self.waiting = Gauge("tandem:num_requests_waiting", "Requests in the scheduler's queue", registry=r)
        self.preemptions = Counter("tandem:num_preemptions", "Requests preempted for KV and recomputed",
                                   registry=r)
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(reason)  # present at zero from the start, as vLLM's are
        self._positions = 0

    def draft_positions(self, k: int) -> None:
        """Make the per-position series for positions < k exist (at zero) before the first acceptance."""
        for position in range(self._positions, k):
            self.accepted_per_pos.labels(str(position))
        self._positions = max(self._positions, k)


def vllm_spec_decode_aliases(exposition: bytes) -> bytes:
    """The tandem:spec_decode_* families of a Prometheus text exposition again, named vllm:spec_decode_*."""
    prefix, alias = b"tandem:spec_decode_", b"vllm:spec_decode_"
    lines = []
    for line in exposition.splitlines():
        if line.startswith(prefix):
            lines.append(alias + line[len(prefix):])
        elif line.startswith((b"# HELP " + prefix, b"# TYPE " + prefix)):
            lines.append(line.replace(prefix, alias, 1))
    return b"".join(line + b"\n" for line in lines)
