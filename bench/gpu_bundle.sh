#!/usr/bin/env bash
# Bundle what bench/gpu_validate.py needs on a GPU machine whose image has its own PyTorch and no package
# registry (the device machines here: torch 2.11.0+cu130, Python 3.12, no pydantic or starlette, transformers
# 5.17): Tandem's other requirements as wheels in .whl/, the demo pair in .gpu/demo (both git-ignored through
# .git/info/exclude, ~46 MB together). Then, there, from the checkout:
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
#   python3 bench/gpu_validate.py --pair .gpu/demo --work /tmp/gv --budget-min 8 --dtypes float32 --transports grpc,cuda-ipc
#
# Run that way on one H100 in three calls of a 15-minute lease, 2026-11-27 (docs/gpu-validation.md).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
for path in /.whl/ /.gpu/; do
    grep -qx "$path" .git/info/exclude 2>/dev/null || echo "$path" >> .git/info/exclude
done
version() { "$python" -c "import importlib.metadata as m; print(m.version('$1'))"; }
wheels=()
for name in grpcio grpcio-health-checking grpcio-reflection protobuf pydantic pydantic_core pydantic-settings \
            typing-inspection annotated-types python-dotenv starlette uvicorn transformers typing_extensions; do
    wheels+=("$name==$(version "$name")")
done
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "${wheels[@]}"
demo=$("$python" -c "from tandem_tools.demo import ensure_demo; print(ensure_demo())")
mkdir -p .gpu && rm -rf .gpu/demo && cp -r "$demo" .gpu/demo
du -sh .whl .gpu
