#!/usr/bin/env bash
# TensorRT-LLM's XQA decode modules (FlashInfer 0.6.14's JIT build) for the GPU host, which has no compiler: built
# here (nvcc 13 under CUDA_HOME, no GPU needed) into DEST (default .stage/xqa, git-ignored), with the apache-tvm-ffi
# wheel (Python 3.12) the GPU host needs to load them in DEST/whl. ~20-30 s a module on 2 cores.
#   bash scripts/build_xqa.sh [DEST] [GROUPS]      GROUPS: query heads per KV head[:head dim, default 128]
# (default: Qwen3-8B 4, 14B 5, 7B 7, the GPU tests' models 4:64, SmolLM2-135M 3:64 for `flashrl verify`)
# On the GPU host: pip install --no-index --no-deps --target /tmp/tvm DEST/whl/*.whl, then
#   PYTHONPATH=/tmp/tvm:$PWD python3 benchmarks/decode_attn_xqa.py --modules DEST
set -euo pipefail
DEST=${1:-.stage/xqa}; GRP=${2:-4,5,7,4:64,3:64}
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
"$PY" -m pip install -q --no-deps --target "$SITE" flashinfer-python==0.6.14 apache-tvm-ffi==0.1.10 nvidia-ml-py
mkdir -p "$DEST/whl"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  -d "$DEST/whl" apache-tvm-ffi==0.1.10
FLASHINFER_WORKSPACE_BASE="$SITE/ws" PYTHONPATH="$SITE:$PWD" "$PY" benchmarks/decode_attn_xqa.py --build "$DEST" \
  --groups "$GRP"
