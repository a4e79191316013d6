"""Graceful drain: on SIGTERM every service turns NOT_SERVING, refuses new work with UNAVAILABLE,
lets the in-flight generation finish, then exits 0. Its own three processes (they get stopped)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from coordinator.client import TandemClient, TandemError
from tandem.service import health_status, wait_for_serving
from tandem.v1 import target_pb2, target_pb2_grpc
from tandem_tools.serve import child_env


def spawn(name: str, args: list[str], run: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tandem_tools.cli", name, *args, "--port", "0", "--grace-period", "60"],
        stderr=(run / f"{name}.log").open("w"),
        env={**os.environ, "OMP_NUM_THREADS": "1", **child_env(name, announce_file=run / f"{name}.addr")},
    )


def announced(name: str, proc: subprocess.Popen, run: Path) -> str:
    deadline = time.monotonic() + 120
    while not (run / f"{name}.addr").is_file():
        assert proc.poll() is None, (run / f"{name}.log").read_text()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return (run / f"{name}.addr").read_text().strip()


@pytest.fixture
def services(tiny_dir, tmp_path):
    target = spawn("target", ["--model", str(tiny_dir / "target"), "--draft", str(tiny_dir / "draft")], tmp_path)
    draft = spawn("draft", ["--model", str(tiny_dir / "draft"), "--target", str(tiny_dir / "target")], tmp_path)
    target_addr, draft_addr = announced("target", target, tmp_path), announced("draft", draft, tmp_path)
    coordinator = spawn("coordinator", ["--target-addr", target_addr, "--draft-addr", draft_addr], tmp_path)
    procs = {
        "coordinator": (coordinator, announced("coordinator", coordinator, tmp_path)),
        "target": (target, target_addr),
        "draft": (draft, draft_addr),
    }
    for proc, addr in procs.values():
        wait_for_serving(addr, 120, alive=lambda p=proc: p.poll() is None)
    yield procs
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_drains_every_service_and_lets_the_in_flight_generation_finish(services):
    address = services["coordinator"][1]
    with TandemClient(address, timeout=120) as client:
        stream = client.generate_stream(prompt_ids=[5, 6, 7], max_new_tokens=600, ignore_eos=True)
        # the prefill's token, then a verify's: the draft session opens with the first propose, so only
        # now does the generation hold a session on every service
        deltas = [next(stream), next(stream)]
        for proc, _ in services.values():
            proc.send_signal(signal.SIGTERM)

        for name, (_, addr) in services.items():
            deadline = time.monotonic() + 10
            while health_status(addr) != "NOT_SERVING":
                assert time.monotonic() < deadline, f"the {name} service still reports {health_status(addr)}"
                time.sleep(0.02)

        with pytest.raises(TandemError) as info:  # new work is refused while the old one runs
            client.generate(prompt_ids=[5, 6, 7], max_new_tokens=4)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(services["target"][1]) as channel:
            session = target_pb2_grpc.TargetServiceStub(channel).Step(iter([target_pb2.TargetBatch()]), timeout=10)
            with pytest.raises(grpc.RpcError) as rpc:
                list(session)
            assert rpc.value.code() == grpc.StatusCode.UNAVAILABLE

        deltas += list(stream)
    assert sum(len(d.token_ids) for d in deltas) == 600
    assert deltas[-1].finish_reason == "length"
    for name, (proc, _) in services.items():
        assert proc.wait(60) == 0, f"the {name} service exited with {proc.returncode}"
