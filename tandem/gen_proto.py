"""Regenerate the Python stubs in tandem/v1/ from proto/tandem/v1/*.proto.

    python -m tandem.gen_proto            # into the source tree
    python -m tandem.gen_proto --out DIR  # elsewhere (the stub test compares the two)

The stubs are committed, so that installing Tandem needs no protoc; grpcio-tools is a dev dependency.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_DIR = PROTO_ROOT / "tandem" / "v1"


def generate(out: Path = ROOT) -> list[Path]:
    """Run protoc on every .proto; returns the files written under `out`."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(PROTO_DIR.glob("*.proto"))
    out.mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {[p.name for p in protos]}")
    package = out / "tandem" / "v1"
    init = package / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated gRPC stubs (python -m tandem.gen_proto); edit proto/tandem/v1/*.proto instead."""\n')
    return sorted(p for p in package.iterdir() if p.suffix in (".py", ".pyi"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.gen_proto", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="root to write tandem/v1/ under (default: the repo)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
