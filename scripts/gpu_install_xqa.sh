#!/usr/bin/env bash
# On the GPU host (no nvcc), after the vLLM bundle (its FlashInfer 0.6.14 serves vLLM and SGLang): put the XQA
# modules scripts/build_xqa.sh built (DIR/*.so, carried in) where FlashInfer's AOT lookup finds them
# (<flashinfer>/data/aot/<name>/<name>.so), so FLASHRL_DECODE_ATTN=xqa loads them without a compiler, and install
# DIR/whl's apache-tvm-ffi for benchmarks/decode_attn_xqa.py (--target /tmp/tvm) where FlashInfer's own is absent.
#   bash scripts/gpu_install_xqa.sh DIR
set -euo pipefail
DIR=${1:?usage: gpu_install_xqa.sh DIR}
FI=$(python3 -c "import flashinfer, os; print(os.path.dirname(flashinfer.__file__))")
for so in "$DIR"/xqa_*.so; do
  name=$(basename "$so" .so)
  mkdir -p "$FI/data/aot/$name" && cp "$so" "$FI/data/aot/$name/$name.so"
done
python3 -c "import tvm_ffi" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/tvm "$DIR"/whl/*.whl
echo "XQA modules in $FI/data/aot: $(ls "$DIR"/xqa_*.so | wc -l)"
