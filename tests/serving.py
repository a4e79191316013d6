"""`tandem serve` as the stack of a test module: started with the module's flags and environment, its
addresses read from what it prints."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tandem import security
from tandem_tools.serve import launch, stop


@dataclass
class Served:
    proc: subprocess.Popen
    log: Path
    grpc: str  # the coordinator's HOST:PORT
    url: str  # the HTTP front, http(s)://HOST:PORT
    target: str
    draft: str
    tls: security.ThrowawayCa | None  # with --tls on: the CA and the one certificate of the three services

    def stop(self) -> None:
        stop(self.proc)
        assert self.proc.returncode == 0, self.log.read_text()[-3000:]


def serve(tiny_dir: Path, log: Path, args: list[str], env: dict[str, str] | None = None) -> Served:
    """The tiny pair behind `tandem serve --port 0 --http-port 0 ARGS`, serving."""
    lines: list[str] = []
    proc, address = launch(["--target", str(tiny_dir / "target"), "--draft", str(tiny_dir / "draft"), "--port", "0",
                            "--http-port", "0", *args], log, {**os.environ, **(env or {})}, lines)
    said: dict[str, str] = {}
    for line in lines:
        body = line.removeprefix("tandem serve: ").strip()
        if body.startswith("target "):
            said.update(part.split(" ") for part in body.split(", "))
        elif body.startswith("OpenAI-compatible HTTP on "):
            said["url"] = body.rsplit(" ", 1)[1].removesuffix("/v1")
        elif body.startswith("TLS, the CA's certificate in "):
            said["ca"] = body.split(" in ", 1)[1].split(" ")[0]
    tls = None
    if "ca" in said:
        ca = Path(said["ca"])
        tls = security.ThrowawayCa(ca, ca.with_name("cert.pem"), ca.with_name("key.pem"))
    return Served(proc, log, address, said["url"], said["target"], said["draft"], tls)


# The target's whole KV budget for the modules that count blocks: TANDEM_TARGET_KV_CACHE_GIB at the tiny
# pair's 2 KiB a token (8 layers x 2 KV heads x 16 x K and V x 4 bytes), and a short queue of waiting requests.
KV_TOKENS = 4096
MAX_WAITING = 8
KV_ENV = {"TANDEM_TARGET_KV_CACHE_GIB": repr(KV_TOKENS * 2048 / (1 << 30)),
          "TANDEM_COORDINATOR_MAX_WAITING": str(MAX_WAITING)}
VERIFY_WIDTH = 17  # what a prefill reserves beyond prompt + max_new_tokens: a chain's verify, t + 16


def assert_whole_kv_budget_free(served: Served, api_key: str | None = None) -> None:
    """No session on either service, and a generation reserving the whole budget starts (it would be
    refused behind a single leaked block); the one a token larger is refused as past the budget."""
    import pytest

    from coordinator.client import TandemClient, TandemError
    from tests.processes import wait_for_no_sessions

    wait_for_no_sessions(served.target, served.draft)
    prompt = [3] * 8
    whole = KV_TOKENS - len(prompt) - VERIFY_WIDTH
    with TandemClient(served.grpc, timeout=60, api_key=api_key) as client:
        with pytest.raises(TandemError, match=f"the whole KV budget is {KV_TOKENS}"):
            client.generate(prompt_ids=prompt, max_new_tokens=whole + 1)
        stream = client.generate_stream(prompt_ids=prompt, max_new_tokens=whole, ignore_eos=True)
        assert next(stream).token_ids
        stream.close()
    wait_for_no_sessions(served.target, served.draft)
