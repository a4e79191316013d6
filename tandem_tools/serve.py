"""`tandem serve`: the target, draft and coordinator services as three child processes.

    target  (its own process and device) --+
                                           +-- coordinator (HOST:PORT, what clients call)
    draft   (its own process and device) --+

The internal services bind 127.0.0.1 on ports the OS picks (each writes its address to an
announce file); the coordinator binds --host:--port. SIGTERM/SIGINT drains the coordinator first
(in-flight generations finish), then the target and the draft.

What is serve's own business goes to each child as a variable of its settings that has no flag, set for that
child only: the announce file, on a CPU host the CPUs and torch threads (`split_cpus`, `cpu_threads`), and
on one GPU for both that they share it (`shared_gpu`: the draft takes its part of it, the target the rest).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tandem import security
from tandem.config import ServeSettings, format_cpus, load_settings
from tandem.defaults import STARTUP_TIMEOUT
from tandem.memory import shares_gpu
from tandem.service import PARENT_PID_ENV, metrics_announce_file, setup_logging, wait_for_serving

log = logging.getLogger("tandem.serve")


def child_env(name: str, **settings: object) -> dict[str, str]:
    """TANDEM_<NAME>_<SETTING> for each setting given (None: left out): the child's own variables."""
    return {f"TANDEM_{name.upper()}_{key.upper()}": str(value) for key, value in settings.items() if value is not None}


class Child:
    def __init__(self, name: str, args: list[str], announce: Path, env: dict[str, str] | None = None):
        self.name = name
        self.announce = announce
        # -m tandem_tools.cli: the same interpreter and code as this process, whatever is on PATH.
        # A session of its own: a Ctrl-C in the terminal reaches only `serve`, which then stops the
        # children in order; TANDEM_PARENT_PID makes a child drain if `serve` dies without doing so.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem_tools.cli", name, *args],
            env={**os.environ, **(env or {}), **child_env(name, announce_file=announce),
                 PARENT_PID_ENV: str(os.getpid())},
            start_new_session=True,
        )

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def address(self, deadline: float) -> str:
        """Wait for the child to bind and announce its HOST:PORT."""
        while not self.announce.is_file():
            if not self.alive:
                raise RuntimeError(f"the {self.name} service exited with status {self.proc.returncode} while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {self.name} service did not start listening in time")
            time.sleep(0.05)
        return self.announce.read_text().strip()

    def terminate(self) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the %s service did not stop in %.0fs; killing it", self.name, timeout)
            self.proc.kill()
            return self.proc.wait()


def cmd_serve(args: argparse.Namespace) -> int:
    """`tandem serve`: the flags over TANDEM_SERVE_* variables; --demo is the demo pair (built on first use)."""
    if args.demo:
        if args.target or args.draft:
            raise ValueError("--demo is a target and a draft: give it or --target/--draft, not both")
        from tandem_tools.demos import ensure_named_demo

        demo = ensure_named_demo(args.demo)
        args.target, args.draft = str(demo / "target"), str(demo / "draft")
    return serve(load_settings(ServeSettings, **vars(args)))


def serve(settings: ServeSettings) -> int:
    setup_logging()
    target, draft = settings.target, settings.draft
    if target is None:
        from tandem_tools.tiny import ensure_tiny

        tiny = ensure_tiny()
        target, draft = tiny / "target", draft or tiny / "draft"
    stop = threading.Event()

    def handle(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)

    children: list[Child] = []
    with tempfile.TemporaryDirectory(prefix="tandem-serve-") as tmp:
        run = Path(tmp)
        common = ["--host", "127.0.0.1", "--port", "0", "--grace-period", str(settings.grace_period)]
        draft_device = settings.draft_device if draft is not None else None
        cpus = split_cpus(settings.target_device)
        threads = cpu_threads(settings.target_device, draft_device, cpus)
        pinned = {name: format_cpus(cpus[name]) if cpus else None for name in ("target", "draft")}
        shared = shared_gpu(settings.target_device, draft_device)
        env = {"target": child_env("target", threads=threads["target"], cpus=pinned["target"], shared_gpu=shared,
                                   burst_cpus=format_cpus(cpus["target"] + cpus["draft"]) if cpus else None),
               "draft": child_env("draft", threads=threads["draft"], cpus=pinned["draft"], shared_gpu=shared),
               "coordinator": child_env("coordinator", cpus=pinned["draft"])}
        metrics = {name: _metrics(settings.metrics_port, i) for i, name in enumerate(("coordinator", "target", "draft"))}
        if cpus:
            log.info("CPUs: the target on %s, the draft and the coordinator on %s", format_cpus(cpus["target"]),
                     format_cpus(cpus["draft"]))
        ca = security.make_throwaway_ca(run, [settings.host]) if settings.tls else None
        tls_args = ["--tls-cert", str(ca.cert), "--tls-key", str(ca.key), "--tls-ca", str(ca.ca)] if ca else []
        common += tls_args
        try:
            target_args = ["--model", str(target), "--device", settings.target_device, "--dtype", settings.dtype,
                           "--transport", settings.transport]
            convention = []  # the target and the draft must read the head's layer ids alike
            if settings.aux_layer_convention:
                convention = ["--aux-layer-convention", settings.aux_layer_convention]
            if draft is not None:
                target_args += ["--draft", str(draft), *convention]
            target_args += metrics["target"]
            children.append(Child("target", [*target_args, *common], run / "target.addr", env["target"]))
            if draft is not None:
                draft_args = ["--model", str(draft), "--target", str(target), "--device", settings.draft_device,
                              "--dtype", settings.dtype, "--transport", settings.transport, *convention]
                draft_args += metrics["draft"]
                children.append(Child("draft", [*draft_args, *common], run / "draft.addr", env["draft"]))
            deadline = time.monotonic() + STARTUP_TIMEOUT
            addresses = {child.name: child.address(deadline) for child in children}
            coordinator_args = ["--target-addr", addresses["target"], "--host", settings.host,
                                "--port", str(settings.port), "--grace-period", str(settings.grace_period)]
            if "draft" in addresses:
                coordinator_args += ["--draft-addr", addresses["draft"]]
            coordinator_args += metrics["coordinator"] + tls_args + _keys(settings, run)
            if settings.spec_token_budget is not None:
                coordinator_args += ["--spec-token-budget", str(settings.spec_token_budget)]
            coordinator_args += ["--overlap", "on" if settings.overlap else "off"]
            if settings.tree is not None:
                coordinator_args += ["--tree", settings.tree]
            if settings.http_port is not None:
                coordinator_args += ["--http-port", str(settings.http_port)]
            if settings.served_model_name is not None:
                coordinator_args += ["--served-model-name", settings.served_model_name]
            if settings.chat_template is not None:
                coordinator_args += ["--chat-template", settings.chat_template]
            coordinator = Child("coordinator", coordinator_args, run / "coordinator.addr", env["coordinator"])
            children.insert(0, coordinator)  # stopped first: it drains while the services still answer
            address = coordinator.address(deadline)
            wait_for_serving(address, max(1.0, deadline - time.monotonic()), alive=lambda: _all_alive(children),
                             what="coordinator", tls=security.ChannelTls(ca=ca.ca) if ca else None)
        except (RuntimeError, TimeoutError) as exc:
            if not stop.is_set():
                log.error("tandem serve: %s", exc)
            _shutdown(children, settings.grace_period)
            return 1
        print(f"tandem serve: {', '.join(f'{k} {v}' for k, v in addresses.items())}", flush=True)
        http = coordinator.announce.with_name(coordinator.announce.name + ".http")  # coordinator/http/server.py
        if settings.http_port is not None and http.is_file():
            print(f"tandem serve: OpenAI-compatible HTTP on {http.read_text().strip()}/v1", flush=True)
        if settings.metrics_port is not None:
            scraped = [(c.name, metrics_announce_file(c.announce)) for c in children]
            print("tandem serve: metrics " + ", ".join(f"{name} http://{path.read_text().strip()}/metrics"
                                                      for name, path in scraped if path.is_file()), flush=True)
        if ca is not None:
            print(f"tandem serve: TLS, the CA's certificate in {ca.ca} (TANDEM_TLS_CA)", flush=True)
        print(f"tandem serve: listening on {address}", flush=True)
        while not stop.wait(0.5):
            dead = [c for c in children if not c.alive]
            if dead:
                log.error("the %s service exited with status %s; stopping", dead[0].name, dead[0].proc.returncode)
                _shutdown(children, settings.grace_period)
                return 1
        log.info("stopping: draining the coordinator, then the target and the draft")
        return _shutdown(children, settings.grace_period)


def shared_gpu(target_device: str, draft_device: str | None) -> int | None:
    """The children's `shared_gpu`: 1 when the target and the draft run on one GPU, so that each sizes itself
    within its part of it (tandem/memory.py) rather than from what is free when it loads; else None (unset)."""
    return 1 if draft_device is not None and shares_gpu(target_device, draft_device) else None


def split_cpus(target_device: str) -> dict[str, list[int]] | None:
    """With the target on the CPU, the CPUs this process may use in two halves: the first (the larger)
    for the target, the rest for the draft and the coordinator, as two devices would hold them. On a
    2-core machine at 16 requests, sharing every core cost the demo pair throughput: a round's steps queued
    behind the other processes' threads. None where there is nothing to split (one CPU, or
    the target on a GPU)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if target_device != "cpu" or len(cpus) < 2:
        return None
    half = (len(cpus) + 1) // 2
    return {"target": cpus[:half], "draft": cpus[half:]}


def cpu_threads(target_device: str, draft_device: str | None,
                cpus: dict[str, list[int]] | None = None) -> dict[str, int | None]:
    """The torch threads of the model processes on the CPU (None: not on the CPU): a thread per CPU of its
    own when the CPUs are split, else the cores shared out, so that two torch thread pools do not
    oversubscribe the machine (spinning workers slow a round many times over)."""
    on_cpu = [name for name, device in (("target", target_device), ("draft", draft_device)) if device == "cpu"]
    share = max(1, (os.cpu_count() or 1) // max(1, len(on_cpu)))
    return {name: (len(cpus[name]) if cpus else share) if name in on_cpu else None for name in ("target", "draft")}


def _keys(settings: ServeSettings, run: Path) -> list[str]:
    """The coordinator's API keys, in a file of this run's directory: no key on a command line (ps shows it)."""
    keys = [*settings.api_key, *(settings.api_key_file.read_text().splitlines() if settings.api_key_file else [])]
    if not keys:
        return []
    path = run / "api-keys"
    path.touch(mode=0o600)
    path.write_text("\n".join(keys) + "\n")
    return ["--api-key-file", str(path)]


def _metrics(port: int | None, offset: int) -> list[str]:
    """The --metrics-port of the child `offset` ports above serve's (0: a free port each); none given
    leaves it to the child's TANDEM_<SERVICE>_METRICS_PORT."""
    return ["--metrics-port", str(port + offset if port else 0)] if port is not None else []


def _all_alive(children: list[Child]) -> bool:
    return all(c.alive for c in children)


def _shutdown(children: list[Child], grace: float) -> int:
    """The coordinator first (its in-flight generations still need the services), then the rest."""
    status = 0
    coordinator = [c for c in children if c.name == "coordinator"]
    services = [c for c in children if c.name != "coordinator"]
    for group in (coordinator, services):
        for child in group:
            child.terminate()
        for child in group:
            status |= child.wait(grace + 10) != 0
    return int(status)


def launch(args: list[str], log: Path | None = None, env: dict[str, str] | None = None,
           lines: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """`tandem serve ARGS` as a child process (bench, profile, load): the process and the coordinator's
    address once it listens. Its stdout stays drained from then on (a full pipe would stall it); its
    stderr goes to `log`; what it printed until then goes to `lines` (the HTTP front's URL, ...)."""
    stderr = log.open("w") if log is not None else None
    proc = subprocess.Popen([sys.executable, "-m", "tandem_tools.cli", "serve", *args], stdout=subprocess.PIPE,
                            stderr=stderr, text=True, env=env)
    for line in proc.stdout:
        if lines is not None:
            lines.append(line)
        if "listening on" in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, line.rsplit(" ", 1)[1].strip()
    status = proc.wait()
    detail = log.read_text()[-3000:] if log is not None else ""
    raise RuntimeError(f"tandem serve exited with status {status} before listening\n{detail}".rstrip())


def metrics_addresses(lines: list[str]) -> dict[str, str]:
    """Each child's /metrics HOST:PORT, from what a launched `tandem serve --metrics-port` printed."""
    for line in lines:
        if line.startswith("tandem serve: metrics "):
            pairs = (part.split(" ") for part in line.removeprefix("tandem serve: metrics ").strip().split(", "))
            return {name: url.removeprefix("http://").removesuffix("/metrics") for name, url in pairs}
    return {}


def stop(proc: subprocess.Popen, grace: float = 60.0) -> None:
    """Stop a launched `tandem serve`: SIGTERM (it drains), then SIGKILL after `grace` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
