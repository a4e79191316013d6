"""Typed configuration of the services, from flags and TANDEM_* environment variables.

Each command has its own prefix: TANDEM_TARGET_*, TANDEM_DRAFT_*, TANDEM_COORDINATOR_*, TANDEM_SERVE_*
(e.g. TANDEM_TARGET_MODEL, TANDEM_DRAFT_DEVICE, TANDEM_COORDINATOR_PORT). A flag overrides the
variable; both are validated at start-up, and the error names the flag, the variable and the value.
No torch here: the coordinator reads its config too.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, BeforeValidator, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from tandem import defaults
from tandem.aux_layers import CONVENTION_HELP
from tandem.dtypes import DTYPE_NAMES
from tandem.params import parse_tree

Dtype = Literal[DTYPE_NAMES]  # the table's names, in its order (tandem/dtypes.py)
# The feature path target -> draft (tandem/transports/). grpc, the default, works anywhere; auto
# takes the fastest both ends support; the coordinator's handshake settles what each end asked for.
Transport = Literal["auto", "grpc", "shm", "cuda-ipc", "nccl"]
TRANSPORT_HELP = "feature path to the draft: auto | grpc | shm | cuda-ipc | nccl (default auto)"
# How a head's eagle_aux_hidden_state_layer_ids count (tandem/aux_layers.py); None: from the head's layout.
AuxLayerConvention = Literal["hidden-states", "outputs"]

_DEVICE = re.compile(r"^(cpu|mps|(cuda|xpu)(:\d+)?)$")
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):\d{1,5}$")

DEFAULT_COORDINATOR_PORT = 50050
DEFAULT_TARGET_PORT = 50051
DEFAULT_DRAFT_PORT = 50052




class ConfigError(ValueError):
    """Invalid configuration; the message names every bad setting."""


def _check_device(v: str) -> str:
    if not _DEVICE.match(v):
        raise ValueError(f"device must look like cpu, cuda, cuda:1 or mps, got {v!r}")
    return v


def with_device_index(device: str) -> str:
    """"cuda" -> "cuda:<this process's current GPU>". The compose files say "cuda" (each container sees
    one GPU), but torch.cuda.set_device and the transports need an index. torch is imported only then:
    only the target and the draft name a CUDA device."""
    if device != "cuda":
        return device
    import torch

    return f"cuda:{torch.cuda.current_device() if torch.cuda.is_available() else 0}"


def _checkpoint(what: str) -> AfterValidator:
    def check(v: Path) -> Path:
        if not (v / "config.json").is_file():
            raise ValueError(f"{what} {str(v)!r} is not a checkpoint directory (no config.json)")
        return v

    return AfterValidator(check)


# Field types that validate themselves: each check is written once, whichever settings use it.
Device = Annotated[str, AfterValidator(_check_device)]
TargetCheckpoint = Annotated[Path, _checkpoint("target model")]
DraftCheckpoint = Annotated[Path, _checkpoint("draft model")]


def _check_tree(v: str) -> str:
    try:
        parse_tree(v)
    except ValidationError as exc:
        raise ValueError("; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())) from None
    return v


TreeSpec = Annotated[str, AfterValidator(_check_tree)]  # NODES[,DEPTH[,TOP_K]]


def parse_cpus(text: str, available: bool = True) -> frozenset[int]:
    """A CPU list as taskset and cpuset write it ("0", "2-3,6") -> the CPU numbers; with `available`, each
    must be one this process may run on now."""
    cpus: set[int] = set()
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if match is None or (match[2] is not None and int(match[2]) < int(match[1])):
            raise ValueError(f"a CPU list looks like 0 or 2-3,6, got {text!r}")
        cpus.update(range(int(match[1]), int(match[2] or match[1]) + 1))
    if not hasattr(os, "sched_getaffinity"):
        raise ValueError("a CPU list needs Linux (sched_setaffinity)")
    missing = cpus - os.sched_getaffinity(0) if available else set()
    if missing:
        raise ValueError(f"CPUs {sorted(missing)} are not available here (this process may use "
                         f"{format_cpus(os.sched_getaffinity(0))})")
    return frozenset(cpus)


def format_cpus(cpus) -> str:
    """The inverse of parse_cpus: {0, 2, 3, 6} -> "0,2-3,6"."""
    out, ordered = [], sorted(cpus)
    start = prev = ordered[0]
    for cpu in [*ordered[1:], None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = cpu
    return ",".join(out)


def check_address(v: str) -> str:
    if not _ADDRESS.match(v) or not 0 < int(v.rsplit(":", 1)[1]) < 65536:
        raise ValueError(f"address must be HOST:PORT, got {v!r}")
    return v




class ServiceSettings(BaseSettings):
    """What every gRPC service shares."""

    host: str = Field("127.0.0.1", description="interface to bind; internal services stay on loopback by default")
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    # Each open generation holds a server thread for its stream; past this limit new ones get
    # RESOURCE_EXHAUSTED at once instead of queueing behind a full thread pool.
    max_sessions: int = Field(64, ge=1, le=4096)
    # SIGTERM: health goes NOT_SERVING, new requests get UNAVAILABLE, in-flight ones get this long.
    grace_period: float = Field(30.0, ge=0)
    max_message_mib: ClassVar[int] = defaults.MESSAGE_MIB  # the gRPC limit of this service's port
    announce_file: Path | None = Field(None, description="write HOST:PORT here once listening (used by serve)")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    # Prometheus /metrics over HTTP on the same interface as the service; off unless a port is given.
    metrics_port: int | None = Field(None, ge=0, le=65535, description=defaults.METRICS_PORT_HELP)
    cpus: str | None = Field(None, description=defaults.CPUS_HELP)  # no flag: `serve` sets it for its children
    # TLS on this service's port (tandem/security.py); without it only loopback is safe to bind.
    tls_cert: Path | None = Field(None, description=defaults.TLS_CERT_HELP)
    tls_key: Path | None = Field(None, description=defaults.TLS_KEY_HELP)
    tls_ca: Path | None = Field(None, description=defaults.TLS_CA_HELP)
    verifies_clients: ClassVar[bool] = False  # the target and the draft: tls_ca is the CA of their clients

    model_config = SettingsConfigDict(extra="ignore")

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, v: str | None) -> str | None:
        return format_cpus(parse_cpus(v)) if v is not None else None

    @field_validator("tls_cert", "tls_key", "tls_ca")
    @classmethod
    def _pem(cls, v: Path | None) -> Path | None:
        if v is not None and not v.is_file():
            raise ValueError(f"{str(v)!r} is not a file")
        return v

    @model_validator(mode="after")
    def _cert_and_key(self) -> ServiceSettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        return self


class EngineSettings(ServiceSettings):
    """What the target and draft services share: a model on a device, batched, with a feature path."""

    verifies_clients: ClassVar[bool] = True
    max_message_mib: ClassVar[int] = defaults.BATCH_MESSAGE_MIB

    device: Device = "cpu"
    dtype: Dtype = "float32"
    threads: int | None = Field(None, ge=1, description=defaults.THREADS_HELP)  # no flag, as cpus
    transport: Transport = Field("auto", description=TRANSPORT_HELP)
    # The target and the draft on one GPU: each sizes its KV from its own part of it (tandem/memory.py), not
    # from what happens to be free when it starts. `tandem serve` sets it for both when their devices are one.
    shared_gpu: bool = Field(False, description=defaults.SHARED_GPU_HELP)  # no flag, as cpus

    @field_validator("device")
    @classmethod
    def _indexed(cls, v: str) -> str:
        return with_device_index(v)


class TargetSettings(EngineSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_TARGET_", extra="ignore")

    port: int = Field(DEFAULT_TARGET_PORT, ge=0, le=65535)
    model: TargetCheckpoint
    # Only the draft's config.json is read, for eagle_aux_hidden_state_layer_ids: the target must
    # capture the layers the head was trained on.
    draft: DraftCheckpoint | None = None
    aux_layer_convention: AuxLayerConvention | None = Field(None, description=CONVENTION_HELP)
    # The largest batch a forward is sized for (the GPU's KV budget counts one forward of it).
    max_batch_size: int = Field(32, ge=1, le=1024)
    max_batch_tokens: int = Field(4096, ge=1)
    # The KV cache of all sessions together (unset: on a GPU what is free after loading less a margin, the
    # feature ring, a forward of the largest batch and the gather (target_server/engine.py), or half
    # the host's available memory on a CPU). A prefill reserves its generation's
    # share (prompt + max_new_tokens); while the budget is taken it is refused, and the coordinator's
    # scheduler keeps the request waiting.
    kv_cache_gib: float | None = Field(None, gt=0)
    burst_cpus: str | None = Field(None, description=defaults.BURST_CPUS_HELP)  # no flag, as cpus

    @field_validator("burst_cpus")
    @classmethod
    def _burst_cpus(cls, v: str | None) -> str | None:  # checked where they are used (the process is pinned by then)
        return format_cpus(parse_cpus(v, available=False)) if v is not None else None

class DraftSettings(EngineSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_DRAFT_", extra="ignore")

    port: int = Field(DEFAULT_DRAFT_PORT, ge=0, le=65535)
    model: DraftCheckpoint
    target: TargetCheckpoint  # the draft reads the target's embed_tokens (that one tensor)
    aux_layer_convention: AuxLayerConvention | None = Field(None, description=CONVENTION_HELP)
    # The KV of all sessions' committed pairs (unset: on a GPU what is free after loading, or its part of a GPU
    # it shares with the target, less a margin and a measured propose; half the host's available memory on a
    # CPU). A propose past it is refused, and that request goes on target-only (draft_server/budget.py).
    kv_cache_gib: float | None = Field(None, gt=0)




def _keys(v) -> tuple[str, ...]:
    """Keys from a flag given several times, a comma-separated variable, or both."""
    parts = [v] if isinstance(v, str) else list(v or ())
    return tuple(k.strip() for part in parts for k in str(part).split(",") if k.strip())


ApiKeys = Annotated[tuple[str, ...], NoDecode, BeforeValidator(_keys)]
# The coordinator's fronts admit this many requests of one key at once (429 / RESOURCE_EXHAUSTED past it):
# one client cannot take every session of the pair (max_sessions) from the others.
MAX_REQUESTS_PER_KEY = 32


class CoordinatorSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_COORDINATOR_", extra="ignore")

    port: int = Field(DEFAULT_COORDINATOR_PORT, ge=0, le=65535)
    target_addr: str
    draft_addr: str | None = None  # none: target-only decoding
    # No flag: `tandem serve` waits as long; an orchestrator whose start-up probes allow longer sets it (deploy/k8s).
    connect_timeout: float = Field(defaults.STARTUP_TIMEOUT, gt=0, description=defaults.CONNECT_TIMEOUT_HELP)
    # A draft step that takes longer counts as a hung draft: the generation goes on target-only.
    # Far above a real step (ms), even a long prompt's first extend under full load.
    draft_timeout: float = Field(10.0, gt=0)
    # Adaptive K: the draft tokens of all running generations together, per round. With n running,
    # each gets K = min(its K, budget // n - 1), down to 0 (target-only) under heavy load, where
    # verifying drafts costs the batch more than their accepted tokens win; the acceptance gate
    # (defaults.SPEC_DRAFT_COST) sheds what the drafts accepted do not pay for. 0 turns both off.
    spec_token_budget: int = Field(defaults.SPEC_TOKEN_BUDGET, ge=0, description=defaults.SPEC_TOKEN_BUDGET_HELP)
    # Overlapped drafting (on/off): see defaults.OVERLAP_BRANCHES.
    overlap: bool = Field(True, description=defaults.OVERLAP_HELP)
    # Requests beyond max_sessions wait for a place (FCFS); past this many waiting, RESOURCE_EXHAUSTED.
    max_waiting: int = Field(1024, ge=0, le=65536, description=defaults.MAX_WAITING_HELP)
    # EAGLE-2 draft trees: the tree of requests that name none, NODES[,DEPTH[,TOP_K]] (none: chains); the
    # tree gate (tandem/gates.py) chooses tree or chain each round by their measured speed.
    tree: TreeSpec | None = Field(None, description=defaults.TREE_HELP)
    # The OpenAI-compatible HTTP front (coordinator/http/) on this port of the same --host; off unless given.
    http_port: int | None = Field(None, ge=0, le=65535, description=defaults.HTTP_PORT_HELP)
    served_model_name: str | None = Field(None, min_length=1, description=defaults.SERVED_MODEL_NAME_HELP)
    # For a checkpoint without one (a base model) or to replace it, as vLLM's --chat-template.
    chat_template: str | None = Field(None, min_length=1, description=defaults.CHAT_TEMPLATE_HELP)
    # API keys (tandem/auth.py): none, the fronts are open; any, every route and method but the health checks
    # (and /metrics with open_metrics) wants one of them.
    api_key: ApiKeys = Field((), description=defaults.API_KEY_HELP)
    api_key_file: Path | None = Field(None, description=defaults.API_KEY_FILE_HELP)
    open_metrics: bool = False  # the HTTP front's /metrics without a key (a scraper inside the network)
    max_requests_per_key: int = Field(MAX_REQUESTS_PER_KEY, ge=1)
    # Mutual TLS to the services with a certificate other than the front's, and the name their certificates
    # carry where the address is not it (127.0.0.1 in a pod).
    tls_client_cert: Path | None = None
    tls_client_key: Path | None = None
    tls_server_name: str | None = None

    @property
    def api_keys(self) -> tuple[str, ...]:
        from_file = _keys(self.api_key_file.read_text().splitlines()) if self.api_key_file is not None else ()
        return (*self.api_key, *from_file)

    @field_validator("api_key_file")
    @classmethod
    def _key_file(cls, v: Path | None) -> Path | None:
        if v is not None and not (v.is_file() and _keys(v.read_text().splitlines())):
            raise ValueError(f"{str(v)!r} is not a file of API keys")
        return v

    @field_validator("chat_template")
    @classmethod
    def _template(cls, v: str | None) -> str | None:
        """A file's text; anything with no newline and no jinja2 markup must be an existing file."""
        if v is None or "{" in v or "\n" in v:
            return v
        path = Path(v)
        if not path.is_file():
            raise ValueError(f"chat_template {v!r} is neither a file nor a jinja2 template")
        return path.read_text()

    @field_validator("target_addr", "draft_addr")
    @classmethod
    def _addr(cls, v: str | None) -> str | None:
        return v if v is None else check_address(v)


class ServeSettings(BaseSettings):
    """`tandem serve`: the three services as child processes."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_SERVE_", extra="ignore")

    target: TargetCheckpoint | None = None  # none: the built-in tiny pair
    draft: DraftCheckpoint | None = None
    aux_layer_convention: AuxLayerConvention | None = Field(None, description=CONVENTION_HELP)
    target_device: Device = "cpu"
    draft_device: Device = "cpu"
    dtype: Dtype = "float32"
    transport: Transport = Field("auto", description=TRANSPORT_HELP)
    host: str = "127.0.0.1"
    port: int = Field(DEFAULT_COORDINATOR_PORT, ge=0, le=65535)
    grace_period: float = Field(30.0, ge=0)
    spec_token_budget: int | None = Field(None, ge=0, description=defaults.SPEC_TOKEN_BUDGET_HELP)  # none: the coordinator's
    overlap: bool = Field(True, description=defaults.OVERLAP_HELP)
    tree: TreeSpec | None = Field(None, description=defaults.TREE_HELP)
    # Prometheus /metrics of the children: the coordinator on this port, the target on the next, the draft on
    # the one after (0: each a free port; none: off, or each child's own TANDEM_<SERVICE>_METRICS_PORT).
    metrics_port: int | None = Field(None, ge=0, le=65533, description=defaults.SERVE_METRICS_PORT_HELP)
    http_port: int | None = Field(None, ge=0, le=65535, description=defaults.HTTP_PORT_HELP)  # the coordinator's
    served_model_name: str | None = Field(None, min_length=1, description=defaults.SERVED_MODEL_NAME_HELP)
    chat_template: str | None = Field(None, min_length=1, description=defaults.CHAT_TEMPLATE_HELP)  # passed on as given
    api_key: ApiKeys = Field((), description=defaults.API_KEY_HELP)  # the coordinator's
    api_key_file: Path | None = Field(None, description=defaults.API_KEY_FILE_HELP)
    # A CA made for this host (tandem/security.py): TLS on both fronts, mutual TLS between the services.
    tls: bool = Field(False, description="on: TLS on the fronts and mutual TLS between the services, from a CA "
                                         "made for this run (default off)")


# Settings with no flag, read from their TANDEM_* variable only: what `tandem serve` hands its children (the
# announce file, CPUs, threads, a shared GPU), and what deployments set beside a front
# (tests/test_services_config.py keeps this true).
NO_FLAG = frozenset({"announce_file", "cpus", "threads", "burst_cpus", "shared_gpu", "connect_timeout",
                     "open_metrics", "max_requests_per_key", "tls_client_cert", "tls_client_key", "tls_server_name"})


def load_settings(cls: type[BaseSettings], **flags) -> BaseSettings:
    """Settings from flags (None = not given) over TANDEM_* variables, or ConfigError naming what is wrong. A
    variable of the service's prefix that names no setting (a typo, or a setting since made a constant) is
    logged as ignored."""
    for name in unknown_variables(cls):
        logging.getLogger("tandem").warning("%s is not a setting of this service: ignored", name)
    given = {k: v for k, v in flags.items() if v is not None and k in cls.model_fields}
    try:
        return cls(**given)
    except ValidationError as exc:
        raise ConfigError(describe_errors(exc, cls)) from None


def unknown_variables(cls: type[BaseSettings]) -> list[str]:
    """The environment's variables of `cls`'s prefix (TANDEM_TARGET_, ...) that name none of its settings."""
    prefix = cls.model_config.get("env_prefix") or ""
    if not prefix:
        return []
    return sorted(k for k in os.environ if k.upper().startswith(prefix) and k[len(prefix):].lower() not in cls.model_fields)


def describe_errors(exc: ValidationError, cls: type[BaseSettings] | None = None) -> str:
    """One line per error: the flag, the variable and the bad value."""
    prefix = (cls.model_config.get("env_prefix") or "") if cls is not None else ""
    lines = []
    for err in exc.errors():
        field = ".".join(str(part) for part in err["loc"])
        where = f"--{field.replace('_', '-')} / {prefix}{field.upper()}" if field and cls is not None else field
        if field in NO_FLAG and cls is not None:
            where = f"{prefix}{field.upper()}"
        msg = err["msg"].removeprefix("Value error, ")
        value = err.get("input")
        if err["type"] == "missing":
            lines.append(f"{where}: required")
        elif isinstance(value, dict) or not field or repr(value) in msg:
            lines.append(f"{where + ': ' if where else ''}{msg}")
        else:
            lines.append(f"{where}: {msg} (got {value!r})")
    return "invalid configuration: " + "; ".join(lines)
