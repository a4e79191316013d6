"""The three services as separate processes the tests can kill, stop, restart and measure."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

from tandem.service import wait_for_serving
from tandem.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tandem_tools.serve import child_env


class Proc:
    """One `tandem <service>` process; restart() brings it back on the same port."""

    def __init__(self, name: str, args: list[str], run: Path, defaults: bool = False, env: dict[str, str] | None = None):
        """`defaults`: without the suite's TANDEM_* settings (tests/conftest.py), as users run it. `env`: more
        variables (settings without a flag, as `tandem serve` sets them for its children)."""
        self.name, self.args, self.run = name, args, run
        self.env = {k: v for k, v in os.environ.items() if not (defaults and k.startswith("TANDEM_"))}
        self.env.update(env or {})
        self.port = 0
        self.starts = 0
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.start()

    @property
    def announce(self) -> Path:
        return self.run / f"{self.name}.addr"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self) -> None:
        self.announce.unlink(missing_ok=True)
        self.starts += 1
        log = (self.run / f"{self.name}.{self.starts}.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem_tools.cli", self.name, *self.args, "--port", str(self.port)],
            stderr=log, env={**self.env, "OMP_NUM_THREADS": "1", **child_env(self.name, announce_file=self.announce)},
        )

    def wait_address(self, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while not self.announce.is_file():
            assert self.proc.poll() is None, f"{self.name} exited {self.proc.returncode}: {self.log()}"
            assert time.monotonic() < deadline, f"{self.name} did not announce its address"
            time.sleep(0.05)
        self.address = self.announce.read_text().strip()
        self.port = int(self.address.rsplit(":", 1)[1])
        return self.address

    def wait_serving(self, timeout: float = 120) -> None:
        wait_for_serving(self.address or self.wait_address(), timeout, alive=lambda: self.proc.poll() is None,
                         what=self.name)

    def log(self) -> str:
        return (self.run / f"{self.name}.{self.starts}.log").read_text()[-4000:]

    def kill(self) -> None:
        """kill -9: no drain, no goodbye."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def restart(self) -> None:
        self.kill()
        self.start()
        self.wait_serving()

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def start_stack(tiny_dir: Path, run: Path, target_args=(), draft_args=(), coordinator_args=(), draft: Path | None = None,
                defaults: bool = False) -> dict[str, Proc]:
    """target and draft (tiny_dir's, or `draft`), then a coordinator on them; all SERVING. `defaults`: every
    setting at its default, as users run it (the suite's own, tests/conftest.py, turn the gate off)."""
    head = draft or tiny_dir / "draft"
    target = Proc("target", ["--model", str(tiny_dir / "target"), "--draft", str(head), *target_args], run, defaults,
                  child_env("target", threads=1))
    draft = Proc("draft", ["--model", str(head), "--target", str(tiny_dir / "target"), *draft_args], run, defaults,
                 child_env("draft", threads=1))
    target.wait_address()
    draft.wait_address()
    coordinator = Proc("coordinator", ["--target-addr", target.address, "--draft-addr", draft.address,
                                       *coordinator_args], run, defaults)
    for proc in (target, draft, coordinator):
        proc.wait_serving()
    return {"target": target, "draft": draft, "coordinator": coordinator}


def stop_stack(procs: dict[str, Proc]) -> None:
    for name in ("coordinator", "target", "draft"):
        if name in procs:
            procs[name].stop()


def open_sessions(target: str, draft: str) -> tuple[int, int]:
    with grpc.insecure_channel(target) as t, grpc.insecure_channel(draft) as d:
        t_info = target_pb2_grpc.TargetServiceStub(t).ModelInfo(target_pb2.TargetInfoRequest(), timeout=10)
        d_info = draft_pb2_grpc.DraftServiceStub(d).ModelInfo(draft_pb2.DraftInfoRequest(), timeout=10)
    return t_info.num_sessions, d_info.num_sessions


def wait_for_no_sessions(target: str, draft: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while (sessions := open_sessions(target, draft)) != (0, 0):
        assert time.monotonic() < deadline, f"sessions still open (target, draft): {sessions}"
        time.sleep(0.05)


def rss_mib(pid: int) -> float:
    """Resident memory of a process, from /proc/PID/status (VmRSS, in kB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def listening_addresses(port: int) -> set[str]:
    """The local IPs that listen on `port`, from /proc/net/tcp{,6}; IPv4-mapped IPv6 shown as IPv4."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            (ip_hex, port_hex), state = fields[1].split(":"), fields[3]
            if state != "0A" or int(port_hex, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(ip_hex)
            # the kernel prints each 32-bit word in host (little-endian) order
            ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
            if ip.version == 6 and ip.ipv4_mapped is not None:
                ip = ip.ipv4_mapped
            found.add(str(ip))
    return found
