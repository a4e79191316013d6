"""The committed stubs in tandem/v1/ are what proto/tandem/v1/*.proto generate, and they import."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import subprocess
import sys

import grpc
import pytest
from google.protobuf import __version__ as protobuf_version

from tandem import gen_proto

pytest.importorskip("grpc_tools")

STUBS = sorted(p for p in (gen_proto.ROOT / "tandem" / "v1").iterdir() if p.suffix in (".py", ".pyi"))


def essential(text: str) -> list[str]:
    """What the .proto decides: the serialized descriptor and the method table, not the tool's version stamps."""
    return [line for line in text.splitlines() if "AddSerializedFile" in line or line.strip().startswith("'/tandem")]


def test_committed_stubs_match_the_proto_files(tmp_path):
    generated = gen_proto.generate(tmp_path)
    assert sorted(p.name for p in generated) == [p.name for p in STUBS]
    same_tools = importlib.metadata.version("grpcio-tools") == _generated_grpc_version()
    for path in STUBS:
        fresh, committed = (tmp_path / "tandem" / "v1" / path.name).read_text(), path.read_text()
        if not same_tools:  # another grpcio-tools stamps other versions into otherwise equal stubs
            fresh, committed = essential(fresh), essential(committed)
        assert fresh == committed, f"tandem/v1/{path.name} is stale: run `python -m tandem.gen_proto`"


def _generated_grpc_version() -> str:
    text = (gen_proto.ROOT / "tandem" / "v1" / "coordinator_pb2_grpc.py").read_text()
    return re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", text).group(1)


@pytest.mark.parametrize("module", ["common_pb2", "target_pb2_grpc", "draft_pb2_grpc", "coordinator_pb2_grpc"])
def test_stubs_import_with_the_installed_runtime(module):
    importlib.import_module(f"tandem.v1.{module}")


def test_the_package_is_tandem_v1():
    from tandem.v1 import coordinator_pb2, draft_pb2, target_pb2

    assert coordinator_pb2.DESCRIPTOR.package == "tandem.v1"
    assert set(coordinator_pb2.DESCRIPTOR.services_by_name) == {"Coordinator"}
    assert set(target_pb2.DESCRIPTOR.services_by_name) == {"TargetService"}
    assert set(draft_pb2.DESCRIPTOR.services_by_name) == {"DraftService"}
    assert grpc.__version__ and protobuf_version


def test_gen_proto_runs_as_a_module(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tandem.gen_proto", "--out", str(tmp_path)],
                         capture_output=True, text=True, check=False, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "tandem" / "v1" / "coordinator_pb2_grpc.py").is_file()
