"""API keys and TLS on a running `tandem serve --tls on --api-key ...` (tandem/auth.py, tandem/security.py,
coordinator/http/auth.py): every HTTP route and gRPC method refused without a key, enumerated from the
app's routes and the services' descriptors; no spelling of a path past the door; generation through the
TLS fronts and mutual TLS between the services, greedy output the target's own; the services refusing a
client without a certificate of their CA; a key's requests in flight bounded.

One stack for the module."""

from __future__ import annotations

import socket
import ssl
import threading
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from coordinator.client import TandemClient, TandemError
from coordinator.http.app import Front
from coordinator.http.auth import OPEN_ROUTES
from tandem import security
from tandem.auth import KeyRing, bearer
from tandem.v1 import coordinator_pb2, target_pb2, target_pb2_grpc
from tests.serving import Served, serve

KEYS = ("key-one", "key-two")
PER_KEY = 2  # TANDEM_COORDINATOR_MAX_REQUESTS_PER_KEY of the stack
PROMPT_IDS = [5, 17, 42, 99, 3]


@pytest.fixture(scope="module")
def stack(tiny_dir, tmp_path_factory):
    served = serve(tiny_dir, tmp_path_factory.mktemp("serve") / "serve.log", ["--tls", "on", "--api-key", ",".join(KEYS)],
                   {"TANDEM_COORDINATOR_MAX_REQUESTS_PER_KEY": str(PER_KEY)})
    yield served
    served.stop()


def _http(stack: Served, key: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=stack.url, verify=ssl.create_default_context(cafile=stack.tls.ca), headers=headers,
                        timeout=60)


def _raw(stack: Served, method: str, target: str, headers: str = "") -> int:
    """The status of one request sent byte for byte as written (httpx would normalise the path)."""
    host, port = stack.url.removeprefix("https://").rsplit(":", 1)
    context = ssl.create_default_context(cafile=stack.tls.ca)
    with socket.create_connection((host, int(port)), timeout=30) as sock, \
            context.wrap_socket(sock, server_hostname=host) as tls:
        tls.sendall(f"{method} {target} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n"
                    f"{headers}\r\n".encode())
        head = tls.recv(65536)
    return int(head.split(b" ", 2)[1])


def _routes() -> list[tuple[str, str]]:
    """(method, path) of every route of the HTTP front, from the app itself."""
    return [(method, route.path) for route in Front(None).app().routes for method in sorted(route.methods - {"HEAD"})]


def _grpc_methods() -> list[str]:
    """Every method the coordinator serves, from the descriptors of its services."""
    services = [coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"],
                health_pb2.DESCRIPTOR.services_by_name["Health"],
                reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]]
    return [f"/{s.full_name}/{m.name}" for s in services for m in s.methods]


def _client_tls(stack: Served) -> security.ChannelTls:
    return security.ChannelTls(ca=stack.tls.ca)


def _target_sessions(stack: Served) -> int:
    mutual = security.ChannelTls(ca=stack.tls.ca, cert=stack.tls.cert, key=stack.tls.key)
    with security.channel(stack.target, tls=mutual) as channel:
        return target_pb2_grpc.TargetServiceStub(channel).ModelInfo(target_pb2.TargetInfoRequest(),
                                                                    timeout=10).num_sessions


# -- keys, the pieces -------------------------------------------------------------------------------


def test_bearer_takes_the_key_of_a_bearer_header_only():
    assert bearer("Bearer abc") == "abc" and bearer("bearer  abc ") == "abc"
    assert bearer("Basic abc") is None and bearer("Bearer") is None and bearer(None) is None


def test_a_ring_matches_only_its_keys_and_bounds_each_keys_requests():
    ring = KeyRing(KEYS, per_key=1)
    assert ring.match("key-two") == "key-two"
    assert ring.match("key-tw") is None and ring.match("") is None and ring.match(None) is None
    assert ring.acquire("key-one") and not ring.acquire("key-one") and ring.acquire("key-two")
    ring.release("key-one")
    assert ring.acquire("key-one")


def test_api_keys_come_from_flags_commas_a_file_and_the_environment(tmp_path, monkeypatch):
    from tandem.config import CoordinatorSettings, load_settings

    (tmp_path / "keys").write_text("from-file\n\n  spaced  \n")
    monkeypatch.setenv("TANDEM_COORDINATOR_API_KEY", "env-a,env-b")
    from_env = load_settings(CoordinatorSettings, target_addr="127.0.0.1:1")
    assert from_env.api_keys == ("env-a", "env-b")
    flags = load_settings(CoordinatorSettings, target_addr="127.0.0.1:1", api_key=["a,b", "c"],
                          api_key_file=str(tmp_path / "keys"))
    assert flags.api_keys == ("a", "b", "c", "from-file", "spaced")


# -- every door closed without a key ----------------------------------------------------------------


def test_every_http_route_but_the_open_ones_refuses_a_request_without_a_key(stack):
    routes = _routes()
    assert {path for _, path in routes} >= {"/v1/models", "/v1/completions", "/v1/chat/completions", "/metrics"}
    with _http(stack) as none, _http(stack, "wrong") as wrong, _http(stack, KEYS[1]) as good:
        for method, path in routes:
            refused = [none.request(method, path).status_code, wrong.request(method, path).status_code]
            if path in OPEN_ROUTES:
                assert refused == [200, 200], (method, path)
            else:
                assert refused == [401, 401], (method, path)
                assert good.request(method, path, json={}).status_code != 401, (method, path)


def test_a_refusal_is_an_openai_error_that_names_the_scheme(stack):
    with _http(stack) as none:
        response = none.get("/v1/models")
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"]["type"] == "AuthenticationError"


@pytest.mark.parametrize("target", [
    "//v1/models", "/v1/../v1/models", "/v1%2Fmodels", "/v1/models/", "/./v1/models", "/V1/MODELS",
    "/health/../v1/models", "/health/", "//health", "/health%2F..%2Fv1%2Fmodels", "/nothing-here", "*",
    "https://evil.example/v1/models",
])
def test_no_spelling_of_a_path_reaches_a_closed_route_without_a_key(stack, target):
    assert _raw(stack, "GET", target) in (400, 401)


def test_methods_other_than_the_routes_own_are_closed_too(stack):
    assert _raw(stack, "POST", "/health") == 401
    assert _raw(stack, "GET", "/health") == 200
    assert _raw(stack, "GET", "/health", f"Authorization: Bearer {KEYS[0]}\r\n") == 200


def test_every_grpc_method_but_the_health_checks_refuses_a_call_without_a_key(stack):
    methods = _grpc_methods()
    with security.channel(stack.grpc, tls=_client_tls(stack)) as channel:
        # reflection lists what the server serves: a service added later must be in the enumeration
        listing = reflection_pb2.ServerReflectionRequest(list_services="")
        answer = next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([listing]), metadata=(("authorization", f"Bearer {KEYS[0]}"),), timeout=10))
        served = {s.name for s in answer.list_services_response.service}
        assert served == {m.split("/")[1] for m in methods}
        for method in methods:
            for metadata in [(), (("authorization", "Bearer wrong"),), (("authorization", KEYS[0]),)]:
                call = channel.stream_stream(method)  # raw bytes: an empty message of any type
                try:
                    for _ in call(iter([b""]), metadata=metadata, timeout=10):
                        break
                    code = grpc.StatusCode.OK
                except grpc.RpcError as exc:
                    code = exc.code()
                if method.startswith("/grpc.health.v1."):
                    assert code != grpc.StatusCode.UNAUTHENTICATED, method
                else:
                    assert code == grpc.StatusCode.UNAUTHENTICATED, (method, metadata)


# -- TLS ----------------------------------------------------------------------------------------------


def test_greedy_through_the_tls_fronts_is_the_targets_own(stack, hf_target):
    with torch.inference_mode():
        expected = hf_target.generate(torch.tensor([PROMPT_IDS]), max_new_tokens=12, min_new_tokens=12,
                                      do_sample=False)[0, len(PROMPT_IDS):].tolist()
    with TandemClient(stack.grpc, timeout=60, api_key=KEYS[0], tls_ca=stack.tls.ca) as client:
        whole = client.generate(prompt_ids=PROMPT_IDS, max_new_tokens=12, ignore_eos=True)
        assert whole.token_ids == expected
        streamed = [t for d in client.generate_stream(prompt_ids=PROMPT_IDS, max_new_tokens=12, ignore_eos=True)
                    for t in d.token_ids]
        assert streamed == expected
    with _http(stack, KEYS[1]) as http:
        body = http.post("/v1/completions", json={"model": "target", "prompt": PROMPT_IDS, "max_tokens": 12,
                                                   "temperature": 0, "ignore_eos": True}).json()
    assert body["usage"]["completion_tokens"] == 12 and body["choices"][0]["text"] == whole.text
    assert _target_sessions(stack) == 0


def test_plain_clients_cannot_talk_to_the_tls_fronts(stack):
    with TandemClient(stack.grpc, timeout=10, api_key=KEYS[0]) as plain, pytest.raises(TandemError) as exc:
        plain.generate(prompt_ids=PROMPT_IDS, max_new_tokens=2)
    assert exc.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(httpx.HTTPError):
        httpx.get(stack.url.replace("https://", "http://") + "/health", timeout=10)


def test_the_services_refuse_a_client_without_a_certificate_of_their_ca(stack, tmp_path):
    other = security.make_throwaway_ca(tmp_path)  # a certificate as good, from another CA
    attempts = {
        "plain": None,
        "tls without a certificate": security.ChannelTls(ca=stack.tls.ca),
        "another CA's certificate": security.ChannelTls(ca=stack.tls.ca, cert=other.cert, key=other.key),
    }
    for address in (stack.target, stack.draft):
        for what, tls in attempts.items():
            with security.channel(address, tls=tls) as channel, pytest.raises(grpc.RpcError) as exc:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, (address, what)
        mutual = security.ChannelTls(ca=stack.tls.ca, cert=stack.tls.cert, key=stack.tls.key)
        with security.channel(address, tls=mutual) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING


# -- a key's share --------------------------------------------------------------------------------


def test_a_key_past_its_requests_in_flight_is_refused_and_other_keys_are_not(stack):
    with TandemClient(stack.grpc, timeout=120, api_key=KEYS[0], tls_ca=stack.tls.ca) as client:
        held = [client.generate_stream(prompt_ids=PROMPT_IDS, max_new_tokens=4000, ignore_eos=True)
                for _ in range(PER_KEY)]
        for stream in held:
            next(stream)  # running: each holds its key until it ends
        with pytest.raises(TandemError) as exc:
            client.generate(prompt_ids=PROMPT_IDS, max_new_tokens=2)
        assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        with _http(stack, KEYS[0]) as http:
            refused = http.get("/v1/models")
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        with TandemClient(stack.grpc, timeout=60, api_key=KEYS[1], tls_ca=stack.tls.ca) as other:
            assert len(other.generate(prompt_ids=PROMPT_IDS, max_new_tokens=3, ignore_eos=True).token_ids) == 3
        for stream in held:
            stream.close()  # cancels: the key's share comes back
        done = threading.Event()
        for _ in range(200):
            try:
                client.generate(prompt_ids=PROMPT_IDS, max_new_tokens=2)
                done.set()
                break
            except TandemError as exc:
                assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                threading.Event().wait(0.05)
        assert done.is_set()


def test_the_container_healthcheck_probes_over_tls_and_mutual_tls(stack):
    """deploy/healthcheck.py, as the compose files and the Kubernetes overlays run it."""
    import runpy

    probe = runpy.run_path(str(Path(__file__).resolve().parents[1] / "deploy" / "healthcheck.py"))["probe"]
    files = {"cert": str(stack.tls.cert), "key": str(stack.tls.key)}
    assert probe(stack.grpc, ca=str(stack.tls.ca)) == "SERVING"
    assert probe(stack.target, ca=str(stack.tls.ca), **files) == "SERVING"
    assert probe(stack.target, ca=str(stack.tls.ca)).startswith("UNREACHABLE")
    assert probe(stack.draft).startswith("UNREACHABLE")


def test_a_coordinator_without_a_client_certificate_cannot_start_on_the_services(stack, tmp_path):
    """A real coordinator that trusts the CA but presents no certificate (then one of another CA): the
    services refuse its connections, so it never reaches them and exits 1 (a StartupError)."""
    import os
    import subprocess
    import sys

    other = security.make_throwaway_ca(tmp_path)
    env = {**os.environ, "TANDEM_COORDINATOR_CONNECT_TIMEOUT": "3"}  # a variable without a flag (deploy/k8s sets it)
    for extra in ([], ["--tls-cert", str(other.cert), "--tls-key", str(other.key)]):
        out = subprocess.run(
            [sys.executable, "-m", "tandem_tools.cli", "coordinator", "--target-addr", stack.target, "--draft-addr",
             stack.draft, "--port", "0", "--tls-ca", str(stack.tls.ca), *extra],
            capture_output=True, text=True, timeout=120, check=False, env=env)
        assert out.returncode == 1, out.stderr[-2000:]
        assert "was not SERVING within 3s" in out.stderr, out.stderr[-2000:]


def test_metrics_open_only_by_the_setting():
    """The door on a toy app with the front's open route and /metrics: open_metrics opens /metrics alone."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from coordinator.http.auth import Door

    async def ok(request):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route(path, ok) for path in ("/health", "/metrics", "/v1/models")])
    for open_metrics, want in ((False, 401), (True, 200)):
        with TestClient(Door(app, KeyRing(KEYS, 1), open_metrics)) as client:
            assert client.get("/metrics").status_code == want
            assert client.get("/health").status_code == 200
            assert client.get("/v1/models").status_code == 401
            assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEYS[0]}"}).status_code == 200
