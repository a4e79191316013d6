"""The Kubernetes manifests (deploy/k8s/): rendered and checked offline, no cluster needed.

Every kustomization (the base and each overlay) is rendered with `kubectl kustomize`, then: the objects
pass schema validation for the Kubernetes releases we claim (kubernetes-validate, strict), the custom
resources it does not know are checked field by field, every container command parses with Tandem's own
CLI parser, every TANDEM_* variable is a setting of the service its container runs (the approach of
tests/test_deploy.py, whose helpers this reuses) and the values load as valid settings, probes and
metrics ports are the services' real ports, the GPUs are pinned one per model container, the feature
transport and /dev/shm fit, the drain fits the termination grace period, and the images are the ones the
compose files build. Also: TandemClient against real gRPC servers through dns:/// and round-robin targets.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from test_deploy import CPU_FILE, GPU_FILE, SETTINGS
from test_deploy import load as load_compose

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))
KUSTOMIZATIONS = ["base", *(f"overlays/{name}" for name in OVERLAYS)]
SERVICES = ("target", "draft", "coordinator")
MODEL_SERVICES = ("target", "draft")

# Schema validation against the oldest release the manifests claim (native gRPC probes are GA since
# 1.27) and the newest kubernetes-validate knows.
MIN_KUBERNETES = "1.27"
# Kinds kubernetes-validate has no schema for (it ships the built-in API only): each is checked by hand
# in the test named here, never skipped silently.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "PodMonitor"): "test_pod_monitor_scrapes_every_services_metrics_port"}
# The only commands besides `tandem`: a preStop pause while the endpoints drop the pod.
OTHER_COMMANDS = {"sleep"}
GPU = "nvidia.com/gpu"
# What a gRPC probe's `service` may name: the server as a whole ("") or the service's own gRPC service.
SERVICE_NAMES = {"target": "tandem.v1.TargetService", "draft": "tandem.v1.DraftService",
                 "coordinator": "tandem.v1.Coordinator"}
UID = 10001  # `useradd --uid 10001` in deploy/Dockerfile

KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed: cannot render the manifests "
                                                           "(kubectl kustomize)")


@functools.cache
def render(path: str) -> tuple[dict, ...]:
    out = subprocess.run([KUBECTL, "kustomize", str(K8S / path)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, f"kubectl kustomize {path}: {out.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


@pytest.fixture(params=KUSTOMIZATIONS)
def objects(request) -> tuple[dict, ...]:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed: cannot render the manifests (kubectl kustomize)")
    return render(request.param)


def of_kind(objects, kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def one(objects, kind: str) -> dict:
    found = of_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def pod_spec(objects) -> dict:
    return one(objects, "Deployment")["spec"]["template"]["spec"]


def containers(objects) -> dict[str, dict]:
    return {c["name"]: c for c in pod_spec(objects)["containers"]}


def all_containers(objects) -> list[dict]:
    spec = pod_spec(objects)
    return [*spec.get("initContainers", []), *spec["containers"]]


def service_of(container: dict) -> str | None:
    """The Tandem service a container runs (`tandem target` -> "target"), else None."""
    argv = [*container.get("command", []), *container.get("args", [])]
    return argv[1] if argv[:1] == ["tandem"] and len(argv) > 1 and argv[1] in SERVICES else None


def env(container: dict, objects) -> dict[str, str]:
    """A container's environment as the kubelet sets it: literal values and ConfigMap keys resolved."""
    maps = {m["metadata"]["name"]: m.get("data", {}) for m in of_kind(objects, "ConfigMap")}
    names = [e["name"] for e in container.get("env", [])]
    assert len(names) == len(set(names)), f"{container['name']}: a variable is set twice: {names}"
    out = {}
    for item in container.get("env", []):
        if "value" in item:
            out[item["name"]] = str(item["value"])
            continue
        ref = item["valueFrom"]["configMapKeyRef"]
        assert ref["name"] in maps, f"{container['name']}: no ConfigMap {ref['name']}"
        assert ref["key"] in maps[ref["name"]], f"{container['name']}: ConfigMap has no key {ref['key']}"
        out[item["name"]] = maps[ref["name"]][ref["key"]]
    return out


def setting(name: str, container: dict, objects, field: str):
    """A setting's value in the container: its TANDEM_<SERVICE>_<FIELD> variable, else the default."""
    value = env(container, objects).get(f"TANDEM_{name.upper()}_{field.upper()}")
    return value if value is not None else SETTINGS[name].model_fields[field].default


def ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def pod_labels(objects) -> dict[str, str]:
    return one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def mebibytes(quantity: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti)?", str(quantity))
    assert m, f"unexpected quantity {quantity!r}"
    return float(m[1]) * {None: 2**-20, "Ki": 2**-10, "Mi": 1, "Gi": 2**10, "Ti": 2**20}[m[2]]


def uses_gpus(objects) -> bool:
    return any(GPU in (c.get("resources", {}).get("limits") or {}) for c in all_containers(objects))


# -- rendering and schemas -----------------------------------------------------------------------------


def test_dev_extra_declares_kubernetes_validate():
    dev = re.search(r"^dev = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    assert re.search(r'"kubernetes-validate\b', dev), dev


def test_there_is_a_gpu_default_and_a_cpu_overlay():
    assert {"gpu", "cpu"} <= set(OVERLAYS), OVERLAYS


@needs_kubectl
def test_every_kustomization_renders_the_pair_and_its_services():
    for path in KUSTOMIZATIONS:
        objects = render(path)
        kinds = sorted(o["kind"] for o in objects)
        for kind in ("Deployment", "PodDisruptionBudget", "ServiceAccount", "ConfigMap"):
            assert kinds.count(kind) == 1, (path, kinds)
        assert kinds.count("Service") == 2, (path, kinds)
        assert set(containers(objects)) == set(SERVICES), path
        names = [(o["kind"], o["metadata"]["name"]) for o in objects]
        assert len(names) == len(set(names)), (path, names)
        if path.startswith("overlays/"):
            assert {o["metadata"].get("namespace") for o in objects} == {"tandem"}, path
    gpu = render("overlays/gpu")
    assert {"HorizontalPodAutoscaler", "PodMonitor", "PersistentVolumeClaim"} <= {o["kind"] for o in gpu}


def test_rendered_objects_pass_schema_validation(objects):
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (pip install -e "
                                                           "'.[dev]'): no offline schema validation")
    versions = [MIN_KUBERNETES, kv.latest_version()]
    for obj in objects:
        where = f"{obj['kind']} {obj['metadata']['name']}"
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_KINDS:
            with pytest.raises(kv.SchemaNotFoundError):  # if it learns the kind, validate it here instead
                kv.validate(obj, versions[-1], strict=True)
            continue
        for version in versions:
            try:
                kv.validate(obj, version, strict=True)
            except kv.ValidationError as exc:
                pytest.fail(f"{where} is invalid for Kubernetes {version}: {exc}")
            except kv.SchemaNotFoundError:
                pytest.fail(f"{where}: no schema in Kubernetes {version}, and not a known custom resource")


@needs_kubectl
def test_pod_monitor_scrapes_every_services_metrics_port():
    """The PodMonitor (a custom resource: no schema offline) field by field, as the Prometheus Operator's
    monitoring.coreos.com/v1 CRD defines them: spec.selector, spec.podMetricsEndpoints[].port/path/interval."""
    objects = render("overlays/gpu")
    monitor = one(objects, "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(monitor["spec"]) <= {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel"}
    assert set(monitor["spec"]["selector"]) == {"matchLabels"}
    assert selects(monitor["spec"]["selector"]["matchLabels"], pod_labels(objects))
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    by_port = {e["port"]: e for e in endpoints}
    assert len(by_port) == len(endpoints)
    scraped = set()
    for name, container in containers(objects).items():
        metrics_port = setting(name, container, objects, "metrics_port")
        assert metrics_port is not None, f"{name}: no TANDEM_{name.upper()}_METRICS_PORT: /metrics is off"
        [port_name] = [p for p, number in ports(container).items() if number == int(metrics_port)]
        assert port_name in by_port, f"{name}'s metrics port {port_name} is not scraped"
        endpoint = by_port[port_name]
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "relabelings", "metricRelabelings"}
        assert endpoint["path"] == "/metrics"
        assert re.fullmatch(r"\d+[smh]", endpoint["interval"])
        scraped.add(port_name)
    assert scraped == set(by_port), "an endpoint names a port no container serves metrics on"


# -- commands and settings -----------------------------------------------------------------------------


def test_every_container_command_parses_with_tandems_cli(objects):
    from tandem_tools.cli import build_parser

    parser = build_parser()
    for container in all_containers(objects):
        argv = [*container.get("command", []), *container.get("args", [])]
        assert argv[:1] == ["tandem"], f"{container['name']}: runs {argv}, not tandem"
        try:
            parser.parse_args(argv[1:])
        except SystemExit as exc:
            pytest.fail(f"{container['name']}: `{' '.join(argv)}` does not parse (exit {exc.code})")
        for hook in container.get("lifecycle", {}).values():
            command = hook["exec"]["command"]
            assert command[0] in OTHER_COMMANDS, (container["name"], command)
    assert sorted(filter(None, map(service_of, pod_spec(objects)["containers"]))) == sorted(SERVICES)


def test_every_tandem_variable_is_a_setting_of_its_containers_service(objects):
    """extra="ignore" in the settings would swallow a misspelt name (the check of tests/test_deploy.py)."""
    for container in all_containers(objects):
        name = service_of(container)
        variables = [k for k in env(container, objects) if k.startswith("TANDEM_")]
        if name is None:
            assert not variables, f"{container['name']} runs no service but sets {variables}"
            continue
        cls = SETTINGS[name]
        prefix = cls.model_config["env_prefix"]
        for key in variables:
            assert key.startswith(prefix), (name, key)
            field = key.removeprefix(prefix).lower()
            assert field in cls.model_fields, f"{name}: {key} is no setting of {cls.__name__}"


def test_the_environment_loads_as_valid_settings(objects, tmp_path, monkeypatch):
    """The containers' variables pass the services' own validation (checkpoint paths rewritten to stand-in
    checkpoint directories here)."""
    from tandem import config
    from tandem.security import make_throwaway_ca

    secrets = tmp_path / "secrets"  # the Secrets' files, as the tls component's comment says to make them
    secrets.mkdir()
    make_throwaway_ca(secrets)
    (secrets / "api-keys").write_text("a-key\n")
    for container in pod_spec(objects)["containers"]:
        name = service_of(container)
        for key in [k for k in os.environ if k.startswith("TANDEM_")]:
            monkeypatch.delenv(key)
        for key, value in env(container, objects).items():
            if value.startswith("/etc/tandem/"):
                value = str(secrets / Path(value).name)
            if value.startswith("/models/"):
                value = str(tmp_path / value.removeprefix("/"))
                Path(value).mkdir(parents=True, exist_ok=True)
                (Path(value) / "config.json").write_text("{}")
            monkeypatch.setenv(key, value)
        assert not config.unknown_variables(SETTINGS[name]), f"{name}: variables that are no setting"
        settings = config.load_settings(SETTINGS[name])
        assert settings.host == "0.0.0.0", f"{name}: the kubelet's probes connect to the pod IP"
        assert settings.metrics_port is not None
        if name == "coordinator":
            target, draft = containers(objects)["target"], containers(objects)["draft"]
            assert settings.target_addr == f"127.0.0.1:{setting('target', target, objects, 'port')}"
            assert settings.draft_addr == f"127.0.0.1:{setting('draft', draft, objects, 'port')}"


# -- probes, ports, drain ------------------------------------------------------------------------------


def test_probes_are_grpc_health_checks_on_each_services_own_port(objects):
    """The coordinator's readiness asks its HTTP front's /health instead (503 while not serving, like
    its gRPC health), so that a pod whose HTTP server does not answer takes no traffic."""
    for name, container in containers(objects).items():
        port = int(setting(name, container, objects, "port"))
        assert port in ports(container).values(), f"{name}: port {port} is not declared"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[kind]
            if name == "coordinator" and kind == "readinessProbe":
                http = int(setting(name, container, objects, "http_port"))
                assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"httpGet"}, probe
                scheme = {"scheme": "HTTPS"} if tls(name, container, objects) else {}
                assert probe["httpGet"] == {"path": "/health", "port": http, **scheme}
                assert http in ports(container).values()
                continue
            if tls(name, container, objects):
                _assert_tls_probe(name, container, objects, probe, port)
                continue
            # the kubelet's native grpc.health.v1 client; the port must be a number (named ports are not
            # supported for gRPC probes)
            assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, (name, kind)
            assert probe["grpc"]["port"] == port, (name, kind, probe)
            assert probe["grpc"].get("service", "") in ("", SERVICE_NAMES[name]), (name, kind)
        # liveness never judges a model still loading: the startup probe holds it off
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, name
    budget = {name: c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
              for name, c in containers(objects).items()}
    coordinator = containers(objects)["coordinator"]
    # the coordinator waits for the target as long as the target may take to load
    assert budget["coordinator"] >= budget["target"]
    assert float(setting("coordinator", coordinator, objects, "connect_timeout")) >= budget["target"]


def tls(name: str, container: dict, objects) -> dict[str, str]:
    """The container's TLS files ({"cert": ..., "key": ..., "ca": ...}); empty without TLS."""
    return {f: v for f in ("cert", "key", "ca") if (v := setting(name, container, objects, f"tls_{f}")) is not None}


def _assert_tls_probe(name: str, container: dict, objects, probe: dict, port: int) -> None:
    """The kubelet's gRPC probes speak plaintext only: over TLS, tandem-healthcheck on the service's own port
    with its CA, and for the target and the draft (mutual TLS) a certificate they accept."""
    assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"exec"}, (name, probe)
    command = probe["exec"]["command"]
    assert command[:2] == ["tandem-healthcheck", f"127.0.0.1:{port}"], (name, command)
    flags = dict(zip(command[2::2], command[3::2], strict=True))
    files = tls(name, container, objects)
    want = {"--ca": files["ca"]} | ({"--cert": files["cert"], "--key": files["key"]} if name in MODEL_SERVICES else {})
    assert flags == want, (name, flags)


def test_network_policy_lets_in_only_the_fronts_ports(objects):
    """From anywhere only the ports the Services route to (the coordinator's gRPC and HTTP); the metrics
    ports from the monitoring namespace only; the target's and the draft's gRPC ports never."""
    policy = one(objects, "NetworkPolicy")
    assert selects(policy["spec"]["podSelector"]["matchLabels"], pod_labels(objects))
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    named = {p: n for c in containers(objects).values() for p, n in ports(c).items()}
    routed = {port["targetPort"] for service in of_kind(objects, "Service") for port in service["spec"]["ports"]}
    metrics = {p for name, c in containers(objects).items() for p, n in ports(c).items()
               if n == int(setting(name, c, objects, "metrics_port"))}
    open_to, scraped = set(), set()
    for rule in policy["spec"]["ingress"]:
        rule_ports = {p["port"] for p in rule["ports"]}
        assert rule_ports <= set(named), f"the policy names a port no container has: {rule_ports}"
        if "from" not in rule:
            open_to |= rule_ports
            continue
        assert all(set(peer) == {"namespaceSelector"} for peer in rule["from"]), rule
        scraped |= rule_ports
    assert open_to == routed == {"grpc", "http"}
    assert scraped == metrics
    for name in MODEL_SERVICES:
        own = int(setting(name, containers(objects)[name], objects, "port"))
        assert not {p for p in open_to | scraped if named[p] == own}, f"{name}'s gRPC port is reachable"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_serve_tls_and_want_keys_from_secrets(overlay):
    """Every overlay: TLS on the fronts and mutual TLS between the services, the files and the API keys from
    Secrets mounted read-only where the settings read them."""
    if KUBECTL is None:
        pytest.skip("kubectl is not installed: cannot render the manifests (kubectl kustomize)")
    objects = render(f"overlays/{overlay}")
    secret_volumes = {v["name"]: v["secret"]["secretName"] for v in pod_spec(objects)["volumes"] if "secret" in v}
    assert set(secret_volumes.values()) == {"tandem-tls", "tandem-api-keys"}
    for name, container in containers(objects).items():
        mounts = {m["mountPath"]: m for m in container["volumeMounts"] if m["name"] in secret_volumes}
        files = tls(name, container, objects)
        assert set(files) == {"cert", "key", "ca"}, name  # the services verify clients by the CA: mutual TLS
        wanted = [*files.values()]
        if name == "coordinator":
            wanted.append(setting(name, container, objects, "api_key_file"))
        for path in wanted:
            [mount] = [m for where, m in mounts.items() if Path(path).parent == Path(where)]
            assert mount["readOnly"], (name, path)
    assert pod_spec(objects)["securityContext"]["fsGroup"] == UID


def test_services_reach_only_the_coordinators_ports(objects):
    labels = pod_labels(objects)
    coordinator = containers(objects)["coordinator"]
    named = {p: n for c in containers(objects).values() for p, n in ports(c).items()}
    assert len(named) == sum(len(ports(c)) for c in containers(objects).values()), "port names must be unique"
    services = {s["metadata"]["name"]: s for s in of_kind(objects, "Service")}
    assert set(services) == {"tandem", "tandem-headless"}
    for service in services.values():
        assert selects(service["spec"]["selector"], labels)
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports(coordinator), f"{service['metadata']['name']} exposes {port}"
    client = {p["name"]: p for p in services["tandem"]["spec"]["ports"]}
    assert named[client["grpc"]["targetPort"]] == int(setting("coordinator", coordinator, objects, "port"))
    if tls("coordinator", coordinator, objects):  # no cleartext HTTP/2 for a gateway to assume
        assert "appProtocol" not in client["grpc"] and client["http"]["appProtocol"] == "https"
    else:
        assert client["grpc"]["appProtocol"] == "kubernetes.io/h2c"
    assert client["http"]["port"] == named[client["http"]["targetPort"]] == 8000
    assert env(coordinator, objects)["TANDEM_COORDINATOR_HTTP_PORT"] == "8000"
    headless = services["tandem-headless"]["spec"]
    assert headless["clusterIP"] == "None" and [p["name"] for p in headless["ports"]] == ["grpc"]
    assert not headless.get("publishNotReadyAddresses"), "clients must see only ready pairs"


def test_sigterm_drain_fits_in_the_termination_grace_period(objects):
    spec = pod_spec(objects)
    for name, container in containers(objects).items():
        pre_stop = container.get("lifecycle", {}).get("preStop")
        pause = int(pre_stop["exec"]["command"][1]) if pre_stop else 0
        grace = float(setting(name, container, objects, "grace_period"))
        # preStop, then SIGTERM: the drain (grace) and the server's 1 s stop, with a margin
        assert pause + grace + 1 + 5 <= spec["terminationGracePeriodSeconds"], (name, pause, grace)


# -- GPUs, feature transport, models -------------------------------------------------------------------


def test_target_and_draft_each_get_one_gpu_of_the_pods_node(objects):
    spec, by_name = pod_spec(objects), containers(objects)
    for container in all_containers(objects):
        assert not {"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"} & set(env(container, objects)), \
            "the device plugin picks the GPUs; a visibility variable would fight it"
    assert GPU not in str(by_name["coordinator"].get("resources")), "the coordinator needs no GPU"
    if not uses_gpus(objects):  # the cpu overlay
        assert GPU not in str(objects) and "tolerations" not in spec
        for name in MODEL_SERVICES:
            assert setting(name, by_name[name], objects, "device") == "cpu"
        return
    for name in MODEL_SERVICES:
        resources = by_name[name]["resources"]
        assert int(resources["limits"][GPU]) == 1, name
        assert int(resources.get("requests", {}).get(GPU, 1)) == 1, name
        # the one GPU the plugin gives the container is its cuda:0
        assert setting(name, by_name[name], objects, "device") in ("cuda", "cuda:0"), name
    assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]


def test_features_go_over_the_pods_shared_memory(objects):
    """Each container sees only its own GPU: no cuda-ipc and no NCCL P2P between them, and `auto` would
    pick cuda-ipc (one host, one IPC namespace) and fall back to grpc. shm crosses containers through one
    memory-backed /dev/shm."""
    spec, by_name = pod_spec(objects), containers(objects)
    volumes = {v["name"]: v for v in spec["volumes"]}
    shm_volumes = set()
    for name in MODEL_SERVICES:
        assert setting(name, by_name[name], objects, "transport") == "shm", name
        [mount] = [m for m in by_name[name]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        shm_volumes.add(mount["name"])
    [shm] = shm_volumes
    assert volumes[shm]["emptyDir"]["medium"] == "Memory"
    from tandem.transports.endpoints import RING_BYTES

    ring = RING_BYTES / (1 << 20)  # MiB: a constant, the same for every target
    assert mebibytes(volumes[shm]["emptyDir"]["sizeLimit"]) >= 2 * ring
    assert mebibytes(by_name["target"]["resources"]["limits"]["memory"]) > ring, "the ring counts against it"


def test_the_coordinator_reaches_the_services_step_sockets_in_one_volume(objects):
    """With a fast path the target and the draft offer the coordinator their steps over a Unix socket in a
    private directory under TMPDIR (tandem/step_socket.py): the three containers set TMPDIR to the mount
    of one emptyDir, so the socket paths the services announce are there for the coordinator too."""
    spec, by_name = pod_spec(objects), containers(objects)
    volumes = {v["name"]: v for v in spec["volumes"]}
    shared = set()
    for name in (*MODEL_SERVICES, "coordinator"):
        tmpdir = env(by_name[name], objects).get("TMPDIR")
        assert tmpdir, f"{name}: no TMPDIR"
        [mount] = [m for m in by_name[name].get("volumeMounts", []) if m["mountPath"] == tmpdir]
        assert not mount.get("readOnly"), name
        shared.add((mount["name"], tmpdir))
    [(volume, _)] = shared
    assert "emptyDir" in volumes[volume]


def test_models_come_from_a_volume_at_the_configmaps_paths(objects):
    spec, by_name = pod_spec(objects), containers(objects)
    volumes = {v["name"]: v for v in spec["volumes"]}
    paths = {name: [v for k, v in env(by_name[name], objects).items() if v.startswith("/models")]
             for name in MODEL_SERVICES}
    for name in MODEL_SERVICES:
        [mount] = [m for m in by_name[name]["volumeMounts"] if m["mountPath"] == "/models"]
        assert mount.get("readOnly") is True, name
        assert len(paths[name]) == 2, (name, paths[name])  # its model and its partner's
    assert sorted(paths["target"]) == sorted(paths["draft"])
    assert "volumeMounts" not in by_name["coordinator"] or \
        all(m["mountPath"] != "/models" for m in by_name["coordinator"]["volumeMounts"])
    models = volumes[mount["name"]]
    if "persistentVolumeClaim" in models:
        claim = models["persistentVolumeClaim"]
        assert claim["readOnly"] is True
        pvc = [p for p in of_kind(objects, "PersistentVolumeClaim") if p["metadata"]["name"] == claim["claimName"]]
        assert pvc and set(pvc[0]["spec"]["accessModes"]) & {"ReadWriteMany", "ReadOnlyMany"}, \
            "pairs on many nodes mount the models at once"
        assert not spec.get("initContainers")
    else:
        assert set(models) == {"name", "emptyDir"}
        assert not of_kind(objects, "PersistentVolumeClaim")
        # the init container writes the pair where the ConfigMap says it is
        [init] = spec["initContainers"]
        argv = init["command"]
        assert argv[:2] == ["tandem", "make-tiny"]
        assert {str(Path(p).parent) for p in paths["target"]} == {argv[2]}
        assert any(m["name"] == mount["name"] and not m.get("readOnly") for m in init["volumeMounts"])


def test_images_are_the_ones_the_compose_files_build(objects):
    """The same Dockerfile targets per role as docker-compose.yml (GPU) and docker-compose.cpu.yml."""
    compose = load_compose(GPU_FILE if uses_gpus(objects) else CPU_FILE)["services"]
    spec = pod_spec(objects)

    def image(container: dict) -> str:  # without the registry an overlay may name (`images: newName`)
        return container["image"].rsplit("/", 1)[-1]

    for container in spec["containers"]:
        assert image(container) == compose[container["name"]]["image"], container["name"]
    for init in spec.get("initContainers", []):
        [(service, built)] = [(n, s["image"]) for n, s in compose.items() if s.get("command") == init["command"]]
        assert image(init) == built, (init["name"], service)


def test_pods_meet_the_restricted_pod_security_standard(objects):
    spec = pod_spec(objects)
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == UID
    assert f"--uid {UID}" in (ROOT / "deploy" / "Dockerfile").read_text()
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec["automountServiceAccountToken"] is False
    for container in all_containers(objects):
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False, container["name"]
        assert context["capabilities"]["drop"] == ["ALL"], container["name"]
        assert "memory" in container["resources"]["limits"], container["name"]
    assert not [v for v in spec["volumes"] if "hostPath" in v]


# -- availability and scaling --------------------------------------------------------------------------


def test_pairs_spread_over_nodes_and_are_disrupted_one_at_a_time(objects):
    labels = pod_labels(objects)
    pdb = one(objects, "PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"]["matchLabels"], labels)
    assert pdb["spec"].get("maxUnavailable") == 1 or pdb["spec"].get("minAvailable")
    [term] = pod_spec(objects)["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert selects(term["podAffinityTerm"]["labelSelector"]["matchLabels"], labels)
    strategy = one(objects, "Deployment")["spec"]["strategy"]
    assert strategy["rollingUpdate"]["maxSurge"] == 0, "a rollout must not need spare GPUs"


def test_autoscaler_scales_on_the_coordinators_requests_in_flight(objects):
    """HPA -> prometheus-adapter rule -> a metric the coordinator really exports (tandem/metrics.py)."""
    deployment = one(objects, "Deployment")
    hpas = of_kind(objects, "HorizontalPodAutoscaler")
    if not hpas:
        assert deployment["spec"]["replicas"] >= 1
        return
    [hpa] = hpas
    assert "replicas" not in deployment["spec"], "the autoscaler owns the replica count"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    assert ":" not in name, "custom metrics API names cannot hold a colon"

    rules = yaml.safe_load((K8S / "extras" / "prometheus-adapter-values.yaml").read_text())["rules"]["custom"]
    [rule] = [r for r in rules if r["name"]["as"] == name]
    series = re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", rule["seriesQuery"]).group(0)
    assert re.fullmatch(rule["name"]["matches"], series)
    assert series in rule["metricsQuery"]
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}

    from prometheus_client import CollectorRegistry

    from tandem.metrics import CoordinatorMetrics

    registry = CollectorRegistry()
    CoordinatorMetrics(registry)
    exported = {family.name: family.type for family in registry.collect()}
    assert exported.get(series) == "gauge", f"the coordinator exports no gauge {series}: {sorted(exported)}"


def test_extras_match_the_base():
    """The model download Job writes where the ConfigMap reads, into the claim the pods mount."""
    job = yaml.safe_load((K8S / "extras" / "download-models-job.yaml").read_text())
    if KUBECTL is None:
        pytest.skip("kubectl is not installed: cannot render the base")
    base = render("base")
    data = one(base, "ConfigMap")["data"]
    script = " ".join(job["spec"]["template"]["spec"]["containers"][0]["args"])
    for key in ("target-model", "draft-model"):
        assert f"--local-dir {data[key]}" in script, key
    [claim] = [v["persistentVolumeClaim"]["claimName"] for v in job["spec"]["template"]["spec"]["volumes"]
               if "persistentVolumeClaim" in v]
    assert claim == one(base, "PersistentVolumeClaim")["metadata"]["name"]
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    for version in (MIN_KUBERNETES, kv.latest_version()):
        kv.validate(job, version, strict=True)


def test_readme_says_how_to_deploy_every_overlay():
    readme = (ROOT / "deploy" / "README.md").read_text()
    assert "## Kubernetes" in readme
    for name in OVERLAYS:
        assert f"kubectl apply -k deploy/k8s/overlays/{name}" in readme, name


# -- the client through a headless Service -------------------------------------------------------------


class _Coordinator:
    """A real gRPC server with the Coordinator service: counts the ServerInfo calls it answers."""

    def __init__(self, host: str = "127.0.0.1"):
        from tandem.v1 import coordinator_pb2, coordinator_pb2_grpc

        outer = self
        self.calls = 0

        class Servicer(coordinator_pb2_grpc.CoordinatorServicer):
            def ServerInfo(self, request, context):
                outer.calls += 1
                return coordinator_pb2.ServerInfoResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port(f"{host}:0")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(None)


def test_client_takes_a_dns_target_with_round_robin():
    from coordinator.client import TandemClient

    server = _Coordinator()
    try:
        with TandemClient(f"dns:///localhost:{server.port}", timeout=10) as client:
            assert client.lb_policy == "round_robin"
            client.server_info()
        assert server.calls == 1
    finally:
        server.stop()
    assert TandemClient("127.0.0.1:1").lb_policy is None, "a plain HOST:PORT keeps gRPC's default"


def test_round_robin_spreads_calls_over_every_address():
    """What a headless Service's DNS name gives the client: several addresses, each call to the next."""
    from coordinator.client import TandemClient

    servers = [_Coordinator(), _Coordinator()]
    target = "ipv4:" + ",".join(f"127.0.0.1:{s.port}" for s in servers)
    try:
        with TandemClient(target, timeout=10, lb_policy="round_robin") as client:
            deadline = time.monotonic() + 10
            while not all(s.calls for s in servers) and time.monotonic() < deadline:
                client.server_info()
        assert all(s.calls for s in servers), [s.calls for s in servers]
    finally:
        for s in servers:
            s.stop()
