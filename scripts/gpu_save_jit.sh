#!/usr/bin/env bash
# On the lent host, once an SGLang job has built its JIT kernels (its first 4-bit engines build Marlin's GEMM: ~9 of a
# 30-minute lease, 2026-11-30): packs tvm-ffi's cache (~/.cache/tvm-ffi; SGLang loads a content-addressed .so found
# there without building) into $OUT as <= 15 MB parts, one `run` of its own before the lease ends. Here:
# `mkdir -p .stage/sgl/jit && cp FILES_AT/jit.xz.* .stage/sgl/jit/`; the part travels with an sgl carry (-> /root/sgl/jit)
# and scripts/gpu_install_sglang.sh unpacks it.
set -euo pipefail
D=${TVM_FFI_CACHE_DIR:-$HOME/.cache/tvm-ffi}
[ -d "$D" ] && [ -n "$(ls -A "$D")" ] || { echo "gpu_save_jit.sh: no JIT cache at $D (run an SGLang job first)"; exit 1; }
tar -C "$D" -cf - . | xz -T0 -6 | split -b 15M -d - "${OUT:?set by the device run}/jit.xz."
ls -la "$OUT"
