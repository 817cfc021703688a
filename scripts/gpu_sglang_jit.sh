#!/usr/bin/env bash
# On the lent host, after scripts/gpu_install_sglang.sh: builds the kernels SGLang 0.5.17 JIT-compiles at its first
# 4-bit engine (Marlin's W4A16 GEMM and its repack: ~6 min on 16 cores, 2026-12-01) into tvm-ffi's cache, on the CPU
# alone, so that it can run in the background beside a GPU job (a vLLM row) and the SGLang job after it starts at once:
#   (bash scripts/gpu_sglang_jit.sh > /root/res/jit.log 2>&1 &)   # from the repository root, gpu_env.sh sourced
set -euo pipefail
PYTHONPATH=/tmp/site_sgl_tf:/tmp/site_sgl:${PYTHONPATH:-} python3 - <<'PY'
import time

import torch
from sglang.kernels.ops.quantization.gptq_marlin import _jit_gptq_marlin_module
from sglang.kernels.ops.quantization.gptq_marlin_repack import _jit_gptq_marlin_repack_module

t = time.time()
_jit_gptq_marlin_repack_module()
_jit_gptq_marlin_module(torch.bfloat16)
print(f"SGLang's Marlin JIT kernels built in {time.time() - t:.0f} s")
PY
