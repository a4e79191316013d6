#!/usr/bin/env bash
# Bundle what bench/gpu_validate.py needs on the GPU machine, whose image has its own PyTorch (2.11, CUDA 13,
# Python 3.12, transformers, grpcio, protobuf, numpy, safetensors, pytest and pytest-xdist among its packages)
# and no package registry: the rest of Tandem's requirements as wheels for Python 3.12 in .whl/, the demo pair
# in .gpu/demo (both ignored through .git/info/exclude, so they travel only when `carry` names them).
# Then one device call, from the checkout:
#
#   carry: [".whl", ".gpu"]
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; \
#   python3 bench/gpu_validate.py --out $OUT      # under 8 minutes; timeout_s 600
#
# Carried: what the image lacks, and what Tandem needs newer than it may have (the committed gRPC stubs check
# grpcio and protobuf at import). Never torch or numpy: the image's CUDA build is the one to run.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
for path in /.whl/ /.gpu/; do
    grep -qx "$path" .git/info/exclude 2>/dev/null || echo "$path" >> .git/info/exclude
done
version() { "$python" -c "import importlib.metadata as m; print(m.version('$1'))"; }
wheels=()
for name in grpcio grpcio-health-checking grpcio-reflection protobuf transformers typing_extensions pydantic pydantic_core pydantic-settings typing-inspection \
            annotated-types python-dotenv starlette uvicorn; do
    wheels+=("$name==$(version "$name")")
done
rm -rf .whl && mkdir -p .whl
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "${wheels[@]}"
demo=$("$python" -c "from tandem_tools.demo import ensure_demo; print(ensure_demo())")
mkdir -p .gpu && rm -rf .gpu/demo && cp -r "$demo" .gpu/demo
du -sh .whl .gpu
