"""The docker-compose deployment (deploy/): what the compose files promise, checked without Docker.

The files are parsed with PyYAML and interpolated the way Compose does (`${VAR:-default}`), then:
GPU pinning, health checks, start-up order, published ports, bind addresses and settings names are
asserted; a real Compose implementation validates them when one is installed; and the CPU stack is
run as plain subprocesses from the compose file's own commands and environment (paths and ports
rewritten for this machine) and serves a generation through the coordinator.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tandem import config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
GPU_FILE = DEPLOY / "docker-compose.yml"
CPU_FILE = DEPLOY / "docker-compose.cpu.yml"
COMPOSE_FILES = [GPU_FILE, CPU_FILE]
MODEL_SERVICES = ("target", "draft")
LONG_RUNNING = ("target", "draft", "coordinator")
STEPS_DIR = "/run/tandem"  # TMPDIR of the three, one volume: the step sockets
SETTINGS = {"target": config.TargetSettings, "draft": config.DraftSettings,
            "coordinator": config.CoordinatorSettings}
# Variables the compose files set that no settings class reads yet: the feature transport is chosen
# per deployment before the fast paths exist, so that turning one on is a change of environment only.
RESERVED = {"TANDEM_TRANSPORT"}


# -- Compose, the parts these tests need --------------------------------------------------------------

_VAR = re.compile(r"\$(?:\$|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
                  r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value, env: dict[str, str]):
    """Compose's variable substitution on every string of a parsed file: $$, $VAR, ${VAR},
    ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error}."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group("braced") or m.group("bare")
        op, arg = m.group("op"), m.group("arg")
        unset = name not in env or (op is not None and op.startswith(":") and env[name] == "")
        if op in (":-", "-"):
            return arg if unset else env[name]
        if op in (":?", "?"):
            if unset:
                raise ValueError(f"required variable {name} is unset: {arg}")
            return env[name]
        return env.get(name, "")

    return _VAR.sub(sub, value)


def load(path: Path, env: dict[str, str] | None = None) -> dict:
    """A compose file as Compose sees it: YAML (with anchors and << merges), then interpolation."""
    return interpolate(yaml.safe_load(path.read_text()), env or {})


def environment(service: dict) -> dict[str, str | None]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # the list form: NAME=value, or a bare NAME (passed through)
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return {k: (None if v is None else str(v)) for k, v in env.items()}


def depends_on(service: dict) -> dict[str, str]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return {name: "service_started" for name in deps}
    return {name: (spec or {}).get("condition", "service_started") for name, spec in deps.items()}


def container_port(name: str, service: dict) -> int | None:
    port = environment(service).get(f"TANDEM_{name.upper()}_PORT")
    return None if port is None else int(port)


def health_command(service: dict) -> list[str]:
    test = service["healthcheck"]["test"]
    assert isinstance(test, list) and test[0] == "CMD", f"healthcheck must be an exec-form CMD: {test}"
    return test[1:]


def start_order(services: dict) -> list[str]:
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...] = ()) -> None:
        assert name not in path, f"dependency cycle: {path + (name,)}"
        if name not in order:
            for dep in depends_on(services[name]):
                visit(dep, path + (name,))
            order.append(name)

    for name in services:
        visit(name)
    return order


@pytest.fixture(params=COMPOSE_FILES, ids=lambda p: p.name)
def compose(request) -> dict:
    return load(request.param)


def test_yaml_is_a_declared_dev_dependency():
    """These tests import yaml; it must not be there only by luck (transformers pulls it in)."""
    dev = re.search(r"^dev = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    assert re.search(r'"pyyaml\b', dev, re.IGNORECASE), dev


# -- what the files promise ---------------------------------------------------------------------------


def test_target_is_pinned_to_gpu_0_and_draft_to_gpu_1():
    services = load(GPU_FILE)["services"]
    for name, gpu in (("target", "0"), ("draft", "1")):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "device_ids": [gpu], "capabilities": ["gpu"]}], name
        # the reservation makes that GPU the container's only one: its cuda:0
        assert environment(services[name])[f"TANDEM_{name.upper()}_DEVICE"] in ("cuda", "cuda:0")
    assert "deploy" not in services["coordinator"]


def test_cpu_variant_runs_the_same_services_without_gpus():
    gpu, cpu = load(GPU_FILE)["services"], load(CPU_FILE)["services"]
    assert set(LONG_RUNNING) <= set(cpu)
    assert not any("deploy" in service for service in cpu.values())
    for name in LONG_RUNNING:
        assert cpu[name]["command"] == gpu[name]["command"], name
        # same settings, other values: the CPU file only adds thread counts
        extra = set(environment(cpu[name])) - set(environment(gpu[name]))
        assert extra <= {f"TANDEM_{name.upper()}_THREADS", "GLOO_SOCKET_IFNAME"}, extra
    for name in MODEL_SERVICES:
        assert environment(cpu[name])[f"TANDEM_{name.upper()}_DEVICE"] == "cpu"
        assert depends_on(cpu[name]) == {"tiny": "service_completed_successfully"}
    assert cpu["tiny"]["command"][:2] == ["tandem", "make-tiny"]


def test_every_service_has_a_grpc_health_check_on_its_own_port(compose):
    for name in LONG_RUNNING:
        service = compose["services"][name]
        command = health_command(service)
        assert command[0] == "tandem-healthcheck", command
        assert command[1] == f"127.0.0.1:{container_port(name, service)}", (name, command)
        assert service["healthcheck"]["start_period"], "a model loads for minutes: give it a start period"


def test_services_start_only_after_what_they_need_is_healthy(compose):
    services = compose["services"]
    assert depends_on(services["coordinator"]) == {"target": "service_healthy", "draft": "service_healthy"}
    for name, service in services.items():
        for dep, condition in depends_on(service).items():
            if dep in LONG_RUNNING:  # a long-running service is ready when healthy, not when started
                assert condition == "service_healthy", (name, dep, condition)
            else:
                assert condition == "service_completed_successfully", (name, dep, condition)
    assert start_order(services)[-1] == "coordinator"


def test_only_the_coordinator_publishes_a_port(compose):
    services = compose["services"]
    published = {name for name, service in services.items() if service.get("ports")}
    assert published == {"coordinator"}
    [mapping] = services["coordinator"]["ports"]
    host_ip, host_port, inner = str(mapping).split(":")
    assert (host_ip, host_port) == ("127.0.0.1", "50050"), "publish on host loopback by default"
    assert int(inner) == container_port("coordinator", services["coordinator"])
    for name in MODEL_SERVICES:
        assert [int(p) for p in services[name]["expose"]] == [container_port(name, services[name])]
    # and a deployment can open it on purpose
    opened = load(GPU_FILE, {"TANDEM_PUBLISH_HOST": "0.0.0.0", "TANDEM_PORT": "8080"})
    assert opened["services"]["coordinator"]["ports"] == ["0.0.0.0:8080:50050"]


def test_services_bind_all_interfaces_inside_compose_but_loopback_by_default(compose):
    for name in LONG_RUNNING:
        assert environment(compose["services"][name])[f"TANDEM_{name.upper()}_HOST"] == "0.0.0.0"
        assert SETTINGS[name].model_fields["host"].default == "127.0.0.1"
    coordinator = environment(compose["services"]["coordinator"])
    for name in MODEL_SERVICES:  # reached by service name on the compose network
        port = container_port(name, compose["services"][name])
        assert coordinator[f"TANDEM_COORDINATOR_{name.upper()}_ADDR"] == f"{name}:{port}"


def test_transport_and_nccl_settings_come_from_the_environment(compose):
    for name in LONG_RUNNING:
        env = environment(compose["services"][name])
        assert env["TANDEM_TRANSPORT"] == "grpc", name
        # NCCL_* are passed through from the shell only when set there (a bare name in compose)
        assert all(env[k] is None for k in env if k.startswith("NCCL_")), name
        assert "NCCL_DEBUG" in env
    gpu = load(GPU_FILE)["services"]
    assert {"NCCL_P2P_DISABLE", "NCCL_DEBUG"} <= set(environment(gpu["target"]))
    for name in MODEL_SERVICES:
        # CUDA IPC and NCCL's shared-memory transport need one IPC namespace across the containers
        assert gpu[name]["ipc"] == "host"
    overridden = load(GPU_FILE, {"TANDEM_TRANSPORT": "nccl"})["services"]
    assert {environment(s)["TANDEM_TRANSPORT"] for s in overridden.values()} == {"nccl"}


def test_checkpoints_come_from_the_models_volume_and_the_environment():
    gpu = load(GPU_FILE)["services"]
    for name in MODEL_SERVICES:
        assert any(str(v).endswith(":/models:ro") for v in gpu[name]["volumes"]), gpu[name]["volumes"]
    env = {"TANDEM_TARGET_MODEL": "/models/t", "TANDEM_DRAFT_MODEL": "/models/d",
           "TANDEM_MODELS_DIR": "/srv/m"}
    services = load(GPU_FILE, env)["services"]
    assert environment(services["target"])["TANDEM_TARGET_MODEL"] == "/models/t"
    assert environment(services["target"])["TANDEM_TARGET_DRAFT"] == "/models/d"
    assert environment(services["draft"])["TANDEM_DRAFT_MODEL"] == "/models/d"
    assert environment(services["draft"])["TANDEM_DRAFT_TARGET"] == "/models/t"
    assert [v for v in services["target"]["volumes"] if "/models" in v] == ["/srv/m:/models:ro"]
    cpu = load(CPU_FILE)
    assert "models" in cpu["volumes"]
    assert all("models:/models" in s["volumes"] for n, s in cpu["services"].items() if n != "coordinator")
    assert not any("/models" in str(v) for v in cpu["services"]["coordinator"].get("volumes", [])), \
        "the coordinator needs no weights"


def test_the_coordinator_reaches_the_services_step_sockets_in_one_volume(compose):
    """With a fast path the target and the draft offer the coordinator their steps over a Unix socket in a
    private directory under TMPDIR (tandem/step_socket.py): the three services set TMPDIR to where they
    mount one named volume, so the paths the services announce are there for the coordinator too."""
    shared = set()
    for name in LONG_RUNNING:
        service = compose["services"][name]
        tmpdir = environment(service).get("TMPDIR")
        assert tmpdir, f"{name}: no TMPDIR"
        [volume] = [str(v).split(":")[0] for v in service.get("volumes", []) if str(v).split(":")[1:2] == [tmpdir]]
        shared.add(volume)
    [volume] = shared
    assert volume in compose["volumes"], "a named volume of the file"


def test_every_variable_is_a_setting_the_service_reads(compose):
    """extra="ignore" in the settings would swallow a misspelt TANDEM_* name: catch it here."""
    for name in LONG_RUNNING:
        cls = SETTINGS[name]
        prefix = cls.model_config["env_prefix"]
        for key in environment(compose["services"][name]):
            if key.startswith("TANDEM_") and key not in RESERVED:
                assert key.startswith(prefix), (name, key)
                assert key.removeprefix(prefix).lower() in cls.model_fields, (name, key)


def test_gpu_file_environment_loads_as_valid_settings(tiny_dir, monkeypatch, tmp_path):
    """The GPU file's variables, pointed at a real (tiny) pair and at secrets made by `tandem make-certs`,
    pass the services' own validation."""
    env = {"TANDEM_TARGET_MODEL": str(tiny_dir / "target"), "TANDEM_DRAFT_MODEL": str(tiny_dir / "draft")}
    spec = load(GPU_FILE, env)
    secrets = _made_secrets(spec, tmp_path)
    services = spec["services"]
    for name in LONG_RUNNING:
        for key in list(os.environ):
            if key.startswith("TANDEM_"):
                monkeypatch.delenv(key)
        for key, value in environment(services[name]).items():
            if value is not None:
                monkeypatch.setenv(key, secrets.get(value, value))
        settings = config.load_settings(SETTINGS[name])
        assert (settings.host, settings.port) == ("0.0.0.0", container_port(name, services[name]))
        if name != "coordinator":
            # "cuda" in the file: the settings name the container's GPU (its current one, 0 without CUDA here)
            assert settings.device.startswith("cuda:") and settings.dtype == "bfloat16"
    assert str(settings.target_addr) == "target:50051" and settings.draft_addr == "draft:50052"


def _made_secrets(spec: dict, directory: Path) -> dict[str, str]:
    """/run/secrets/NAME -> a file made here as the compose file's comment says to make it."""
    from tandem.security import make_throwaway_ca

    make_throwaway_ca(directory, ["target", "draft", "coordinator"])
    (directory / "api-keys").write_text("a-key\n")
    return {f"/run/secrets/{name}": str(directory / Path(secret["file"]).name)
            for name, secret in spec.get("secrets", {}).items()}


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_tls_and_api_keys_come_from_secrets(path):
    """The target and the draft serve mutual TLS, the coordinator TLS with API keys and presents the same
    certificate to them; every file they name is a secret the service mounts, made from TANDEM_SECRETS_DIR;
    the health checks present what the services ask for."""
    spec = load(path, {"TANDEM_SECRETS_DIR": "/srv/tandem-secrets"})
    declared = spec["secrets"]
    assert {Path(s["file"]).parent for s in declared.values()} == {Path("/srv/tandem-secrets")}
    for name in LONG_RUNNING:
        service, prefix = spec["services"][name], f"TANDEM_{name.upper()}_"
        env = environment(service)
        assert {env[prefix + f] for f in ("TLS_CERT", "TLS_KEY", "TLS_CA")} == \
               {"/run/secrets/tandem-cert", "/run/secrets/tandem-key", "/run/secrets/tandem-ca"}, name
        named = [v for v in [*env.values(), *health_command(service)] if v and v.startswith("/run/secrets/")]
        assert {v.removeprefix("/run/secrets/") for v in named} <= set(service["secrets"]) <= set(declared), name
        check = health_command(service)
        assert check[check.index("--ca") + 1] == "/run/secrets/tandem-ca", name
        assert ("--cert" in check) == (name in MODEL_SERVICES), name  # mutual TLS: the services ask for one
    assert environment(spec["services"]["coordinator"])["TANDEM_COORDINATOR_API_KEY_FILE"] == \
        "/run/secrets/tandem-api-keys"


def _commands(path: Path) -> Iterator[tuple[str, list[str]]]:
    for name, service in load(path)["services"].items():
        yield name, service["command"]
        if "healthcheck" in service:
            yield f"{name} healthcheck", health_command(service)


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_every_command_is_a_real_subcommand_whose_help_works(path):
    for name, command in _commands(path):
        assert isinstance(command, list), f"{name}: use the exec form (a list), not a shell string"
        if command[0] == "tandem":
            argv = [sys.executable, "-m", "tandem_tools.cli", command[1], "--help"]
        else:
            assert command[0] == "tandem-healthcheck", (name, command)
            argv = [sys.executable, str(DEPLOY / "healthcheck.py"), "--help"]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 0, (name, command, out.stderr)
        assert "usage:" in out.stdout


def _dockerfile_stages() -> dict[str, str]:
    text = (DEPLOY / "Dockerfile").read_text()
    stages = re.finditer(r"^FROM\s+(\S+)\s+AS\s+(\S+)\s*$", text, re.MULTILINE | re.IGNORECASE)
    return {m.group(2): m.group(1) for m in stages}


def test_compose_builds_the_images_the_dockerfile_defines(compose):
    stages = _dockerfile_stages()
    assert {"coordinator", "cpu", "gpu"} <= set(stages)
    for name, service in compose["services"].items():
        build = service["build"]
        assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile", name
        assert build["target"] in stages, name
        assert service["image"] == f"tandem:{build['target']}", name
    assert compose["services"]["coordinator"]["build"]["target"] == "coordinator"
    gpu, cpu = load(GPU_FILE)["services"], load(CPU_FILE)["services"]
    for name in MODEL_SERVICES:
        assert (gpu[name]["build"]["target"], cpu[name]["build"]["target"]) == ("gpu", "cpu"), name


def test_dockerfile_copies_only_paths_that_exist():
    text = (DEPLOY / "Dockerfile").read_text()
    for m in re.finditer(r"^COPY\s+(?!--from)(.+)$", text, re.MULTILINE):
        *sources, _dest = m.group(1).split()
        for src in sources:
            assert (ROOT / src).exists(), src
    assert _dockerfile_stages()["gpu"] == "${CUDA_BASE}"
    assert re.search(r"ARG CUDA_BASE=pytorch/pytorch:\S+-cuda\S+-runtime", text)
    assert re.search(r"^USER tandem$", text, re.MULTILINE)


def test_model_images_pin_transformers_to_the_version_the_tests_ran_with():
    """The target engine subclasses transformers' near-private cache classes (DynamicLayer; its API moved
    in 5.x): the cpu and gpu images install the version these tests ran with, not whatever is newest."""
    from importlib.metadata import version

    text = (DEPLOY / "Dockerfile").read_text()
    pinned = re.search(r"^ARG TRANSFORMERS_VERSION=(\S+)$", text, re.MULTILINE)
    assert pinned and pinned.group(1) == version("transformers"), (pinned and pinned.group(1), version("transformers"))
    # and pip installs that version wherever the package goes (a fresh venv would take the newest release)
    requirement = re.search(r'^\s*"transformers==(\S+)",$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert requirement and requirement.group(1) == pinned.group(1), requirement and requirement.group(1)
    for stage in ("cpu", "gpu"):
        body = re.search(rf"^FROM \S+ AS {stage}$(.*?)(?=^FROM |\Z)", text, re.MULTILINE | re.DOTALL).group(1)
        assert re.search(r"^ARG TRANSFORMERS_VERSION$", body, re.MULTILINE), stage
        assert '"transformers==${TRANSFORMERS_VERSION}"' in body, stage


def _coordinator_requirements() -> list[str]:
    """What the coordinator image installs besides tandem (--no-deps), computed as its Dockerfile does."""
    pytest.importorskip("tomllib")  # Python 3.11+, as in the images
    script = runpy.run_path(str(DEPLOY / "coordinator_requirements.py"))
    return script["coordinator_requirements"](ROOT / "pyproject.toml")


def test_coordinator_image_gets_the_light_dependencies_only():
    names = {re.split(r"[\s<>=!~;\[(]", spec, maxsplit=1)[0].lower() for spec in _coordinator_requirements()}
    assert {"grpcio", "grpcio-health-checking", "pydantic", "pydantic-settings", "tokenizers"} <= names
    assert {"starlette", "uvicorn", "jinja2"} <= names  # the OpenAI-compatible HTTP front
    assert not names & {"torch", "transformers", "safetensors"}, names


def _source_stage(dest: Path) -> Path:
    """The files the Dockerfile's `source` stage copies (what pip builds the images from), under dest."""
    text = (DEPLOY / "Dockerfile").read_text()
    stage = re.search(r"^FROM scratch AS source$(.*?)^FROM ", text, re.MULTILINE | re.DOTALL).group(1)
    for line in re.findall(r"^COPY\s+(.+)$", stage, re.MULTILINE):
        *sources, target = line.split()
        for src in sources:
            to = dest / target.lstrip("/")
            to = to / Path(src).name if target.endswith("/") else to
            to.parent.mkdir(parents=True, exist_ok=True)
            if (ROOT / src).is_dir():
                shutil.copytree(ROOT / src, to, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(ROOT / src, to)
    return dest / "src"


@pytest.fixture(scope="session")
def coordinator_image_env(request, tmp_path_factory) -> Path | str:
    """The coordinator image's Python (or why it could not be built here), made by the Dockerfile's
    recipe outside Docker: a fresh venv, pyproject's dependencies minus the model-only ones, then
    tandem with --no-deps from the source stage's files. The venv with the dependencies is cached
    between runs (keyed by their list)."""
    requirements = _coordinator_requirements()
    digest = hashlib.sha256("\n".join(requirements).encode()).hexdigest()[:12]
    cache = getattr(request.config, "cache", None)  # absent with -p no:cacheprovider
    venv = cache.mkdir(f"deploy-coordinator-venv-{digest}") if cache else tmp_path_factory.mktemp("venv")
    venv = Path(venv)
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]

    def run(argv: list[str]) -> str | None:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
        if out.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            return f"cannot build the coordinator image's environment here ({' '.join(argv[1:6])} ...): " \
                   f"{out.stderr[-1500:]}"
        return None

    if not (venv / "requirements-installed").is_file():
        shutil.rmtree(venv, ignore_errors=True)
        error = run([sys.executable, "-m", "venv", str(venv)]) or run([*pip, *requirements])
        if error:
            return error
        (venv / "requirements-installed").touch()
    src = _source_stage(tmp_path_factory.mktemp("coordinator-image"))
    return run([*pip, "--no-deps", "--force-reinstall", str(src)]) or python


@pytest.fixture(scope="session")
def coordinator_python(coordinator_image_env) -> Path:
    if isinstance(coordinator_image_env, str):
        pytest.skip(coordinator_image_env)
    return coordinator_image_env


@pytest.mark.slow
def test_coordinator_image_recipe_runs_the_coordinator_without_torch(coordinator_python):
    """The coordinator image installs tandem with --no-deps plus the light dependencies: that must be
    enough for `tandem coordinator`, `tandem generate --server` and the health probe."""
    code = (
        "import sys, coordinator.server, coordinator.client, coordinator.scheduler\n"
        "import coordinator.http.app, coordinator.http.server\n"  # the OpenAI front: starlette, uvicorn, jinja2
        "import tandem_tools.cli, tandem.config\n"
        "heavy = [m for m in ('torch', 'transformers', 'numpy', 'safetensors') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "import importlib.util\n"
        "assert importlib.util.find_spec('torch') is None, 'torch is installed: the image is not light'\n"
    )
    runs = [["-c", code], ["-m", "tandem_tools.cli", "coordinator", "--help"],
            ["-m", "tandem_tools.cli", "generate", "--help"],
            [str(DEPLOY / "healthcheck.py"), "--help"]]
    for args in runs:
        out = subprocess.run([str(coordinator_python), *args], capture_output=True, text=True, timeout=120,
                             check=False, cwd=coordinator_python.parent)
        assert out.returncode == 0, (args, out.stderr[-2000:])


def test_healthcheck_fails_when_nothing_answers():
    out = subprocess.run([sys.executable, str(DEPLOY / "healthcheck.py"), f"127.0.0.1:{_free_port()}",
                          "--timeout", "2"], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 1 and "UNREACHABLE" in out.stdout, (out.stdout, out.stderr)


def _compose_implementations() -> list[list[str]]:
    found = []
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
        if probe.returncode == 0:
            found.append(["docker", "compose"])
    if shutil.which("docker-compose"):
        found.append(["docker-compose"])
    return found


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_a_real_compose_implementation_accepts_the_file(path):
    tools = _compose_implementations()
    if not tools:
        pytest.skip("no Compose implementation here (neither `docker compose` nor `docker-compose`)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "COMPOSE_"))}
    for tool in tools:
        out = subprocess.run([*tool, "-f", str(path), "config"], capture_output=True, text=True,
                             timeout=120, check=False, env=env, cwd=ROOT)
        assert out.returncode == 0, (tool, out.stderr)
        resolved = yaml.safe_load(out.stdout)["services"]
        ours = load(path)["services"]
        assert set(resolved) == set(ours), tool
        for name, service in ours.items():  # Compose resolved the anchors and variables as we do
            assert resolved[name]["command"] == service["command"], (tool, name)
            assert {k: v for k, v in environment(resolved[name]).items() if v is not None} == \
                   {k: v for k, v in environment(service).items() if v is not None}, (tool, name)


# -- the CPU stack, run from the compose file outside Docker -----------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Stack:
    """The compose file's services as local processes: what `docker compose up` would do, minus Docker."""

    services: dict
    models: Path
    logs: Path
    pythons: dict[str, Path] = field(default_factory=dict)  # image -> the interpreter standing in for it
    ports: dict[tuple[str, int], int] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict)  # /run/secrets/NAME -> the file made for it
    steps: str | None = None  # what STEPS_DIR stands for here

    def __post_init__(self) -> None:
        for name, service in self.services.items():
            port = container_port(name, service)
            if port is not None:
                self.ports[(name, port)] = _free_port()

    def rewrite(self, value: str, own: str) -> str:
        """Paths under /models -> the tmp models dir, a secret's /run/secrets/NAME -> its file; service:port
        and the service's own 127.0.0.1:port -> 127.0.0.1:free port; 0.0.0.0 -> 127.0.0.1 (stay off this
        host's network)."""
        if value == "0.0.0.0":
            return "127.0.0.1"
        if value in self.secrets:
            return self.secrets[value]
        if value == "/models" or value.startswith("/models/"):
            return str(self.models) + value.removeprefix("/models")
        if value == STEPS_DIR:  # the step sockets' volume: a directory the three share, short enough for AF_UNIX
            if self.steps is None:
                self.steps = tempfile.mkdtemp(prefix="steps-", dir="/tmp")
            return self.steps
        m = re.fullmatch(r"(.+):(\d+)", value)
        if m and (m.group(1), int(m.group(2))) in self.ports:
            return f"127.0.0.1:{self.ports[(m.group(1), int(m.group(2)))]}"
        if m and m.group(1) in ("127.0.0.1", "localhost") and (own, int(m.group(2))) in self.ports:
            return f"127.0.0.1:{self.ports[(own, int(m.group(2)))]}"
        port = container_port(own, self.services[own])
        if value.isdigit() and port is not None and int(value) == port:
            return str(self.ports[(own, port)])
        return value

    def python(self, own: str) -> str:
        return str(self.pythons.get(self.services[own].get("image"), sys.executable))

    def argv(self, command: list[str], own: str) -> list[str]:
        exe = {"tandem": [self.python(own), "-m", "tandem_tools.cli"],
               "tandem-healthcheck": [self.python(own), str(DEPLOY / "healthcheck.py")]}[command[0]]
        return [*exe, *(self.rewrite(arg, own) for arg in command[1:])]

    def env(self, name: str) -> dict[str, str]:
        from tandem.service import PARENT_PID_ENV

        env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
        for key, value in environment(self.services[name]).items():
            if value is None:  # passed through from the shell: unset here unless set in ours
                continue
            env[key] = self.rewrite(value, name) if key.endswith(("_PORT", "_HOST", "_ADDR")) or \
                value.startswith(("/models", "/run/secrets/", STEPS_DIR)) else value
        # one torch thread per process on this small machine; a service drains if the test dies
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env[PARENT_PID_ENV] = str(os.getpid())
        return env

    def start(self, name: str) -> None:
        service = self.services[name]
        for dep, condition in depends_on(service).items():
            if condition == "service_completed_successfully":
                code = self.procs[dep].wait(300)
                assert code == 0, f"{dep} exited with {code}: {self.log(dep)}"
            elif condition == "service_healthy":
                self.wait_healthy(dep)
        with (self.logs / f"{name}.log").open("w") as log:
            self.procs[name] = subprocess.Popen(self.argv(service["command"], name), env=self.env(name),
                                                cwd=self.logs, stdout=log, stderr=subprocess.STDOUT)

    def wait_healthy(self, name: str, timeout: float = 300.0) -> None:
        argv = self.argv(health_command(self.services[name]), name)
        deadline = time.monotonic() + timeout
        while True:
            if subprocess.run(argv, capture_output=True, timeout=60, check=False).returncode == 0:
                return
            code = self.procs[name].poll()
            assert code is None, f"{name} exited with {code}: {self.log(name)}"
            assert time.monotonic() < deadline, f"{name} not healthy within {timeout:.0f}s: {self.log(name)}"
            time.sleep(0.3)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()[-3000:]

    def stop(self, name: str, timeout: float = 60.0) -> int:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()


@contextmanager
def compose_up(path: Path, tmp_path: Path, pythons: dict[str, Path], env: dict[str, str] | None = None
               ) -> Iterator[Stack]:
    spec = load(path, env)
    logs = tmp_path / "logs"
    logs.mkdir()
    stack = Stack(spec["services"], tmp_path / "models", logs, pythons)
    stack.models.mkdir()
    (tmp_path / "secrets").mkdir()
    stack.secrets = _made_secrets(spec, tmp_path / "secrets")
    order = start_order(stack.services)
    try:
        for name in order:
            stack.start(name)
        for name in order:
            if name in LONG_RUNNING:
                stack.wait_healthy(name)
        yield stack
    finally:
        # `docker compose down`: dependents first, so the coordinator drains while the services answer
        for name in reversed(order):
            if name in stack.procs:
                stack.stop(name)
        if stack.steps is not None:
            shutil.rmtree(stack.steps, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_cpu_compose_stack_serves_a_generation_through_the_coordinator(tmp_path, coordinator_image_env, transport):
    """`docker compose -f deploy/docker-compose.cpu.yml up` without Docker: the init service writes the
    tiny pair, target and draft start once it has, the coordinator (in the light image's environment)
    once both are healthy; a client generates through the coordinator; then all drain on SIGTERM. With
    TANDEM_TRANSPORT=shm the coordinator steps both services over their sockets in the shared volume."""
    from tandem.params import GenerationRequest
    from tandem_tools.inprocess import InProcessGenerator

    # Where the light environment cannot be built (no package index), the coordinator runs in ours.
    coordinator_python = coordinator_image_env
    if isinstance(coordinator_python, str):
        coordinator_python = Path(sys.executable)
    started = time.monotonic()
    with compose_up(CPU_FILE, tmp_path, {"tandem:coordinator": coordinator_python},
                    {"TANDEM_TRANSPORT": transport}) as stack:
        up = time.monotonic() - started
        coordinator = stack.services["coordinator"]
        address = f"127.0.0.1:{stack.ports[('coordinator', container_port('coordinator', coordinator))]}"
        # the client from the coordinator image, as `docker compose exec coordinator tandem generate` runs it
        out = subprocess.run(
            [str(coordinator_python), "-m", "tandem_tools.cli", "generate", "--server", address,
             "--prompt", "def main(", "--max-new-tokens", "24", "--json", "--timeout", "120",
             "--api-key", "a-key", "--tls-ca", stack.secrets["/run/secrets/tandem-ca"]],
            capture_output=True, text=True, timeout=180, check=False, cwd=stack.logs,
        )
        assert out.returncode == 0, (out.stderr, stack.log("coordinator"))
        got = json.loads(out.stdout)
        # the models the init service wrote, where the compose file says they are
        target = Path(stack.rewrite(environment(stack.services["target"])["TANDEM_TARGET_MODEL"], "target"))
        draft = Path(stack.rewrite(environment(stack.services["target"])["TANDEM_TARGET_DRAFT"], "target"))
        assert target.parent == stack.models / "tiny" and (target / "config.json").is_file()
        reference = InProcessGenerator(target, draft, draft_cost=0)  # as the services: gate off
        ids = reference.tokenizer("def main(")["input_ids"]
        want = reference.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=24), detokenize=True)
        # the output is the reference's; the stats differ where the coordinator's acceptance gate (on, as
        # deployed) stops drafting for the tiny pair's random head after 16 rounds
        want = json.loads(json.dumps(want.model_dump()))
        assert {k: v for k, v in got.items() if k != "stats"} == {k: v for k, v in want.items() if k != "stats"}
        assert got["stats"]["num_rounds"] > 0 and got["stats"]["num_draft_tokens"] > 0
        by_socket = [line for line in stack.log("coordinator").splitlines() if "over its step socket" in line]
        assert len(by_socket) == (2 if transport != "grpc" else 0), stack.log("coordinator")
        assert all(f"{stack.steps}/" in line for line in by_socket), by_socket
        procs = dict(stack.procs)
    # every long-running service drained and exited cleanly on SIGTERM; the init service had finished
    assert {name: procs[name].returncode for name in procs} == {name: 0 for name in procs}
    print(f"compose CPU stack up in {up:.1f}s, total {time.monotonic() - started:.1f}s")
