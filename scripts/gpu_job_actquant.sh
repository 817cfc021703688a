#!/usr/bin/env bash
# Ran 2026-11-27 on commits 1151b1c and f555be4 (benchmarks/RESULTS.md "INT8's activation quantization fused by
# torch.compile"); the switch was reverted in 7ee70bd, so a run now times vLLM's kernel on both sides.
# Issue 45, FLASHRL_FUSE_ACT_QUANT (INT8 activations quantized by torch ops that Inductor fuses into RMSNorm /
# SiLU-and-mul) by band against vLLM's quantization kernel, and the GPU tests under FLASHRL_DECODE_GEMM's default
# (`auto`, 16 rows on Hopper). On a 2-GPU host, after scripts/gpu_install.sh (~18 minutes):
#   GPU 0  tests/test_kernels.py (CUDA: the torch-ops quantization = vLLM's kernel bit for bit, eager);
#          then side by side tests/gpu/test_vllm_decode_gemm.py (its `fused` case), test_vllm_lifecycle.py -k int8,
#          test_vllm_inflight.py's INT8 cases on one GPU (the runtime's default FLASHRL_DECODE_GEMM)
#   GPU 1  int8 + FP8 KV RL-step rows by band, each its own process: 7B fused, 7B vLLM's kernel, 14B fused, 14B kernel
# SHORT=1 (~8 minutes): GPU 0 the 7B row with vLLM's kernel, then test_vllm_decode_gemm.py; GPU 1 the 7B row fused,
#   then tests/test_kernels.py. (The first run, 2026-11-27, had no compile-cache key for the switches: the
#   second row of each shape loaded the first one's graph, ~22 s starts instead of ~88 s; fixed in engine_args.)
#   setsid nohup bash scripts/gpu_job_actquant.sh RES > RES/job.out 2>&1 < /dev/null &
# -> RES/aq/bands_SHAPE_NAME.{json,log}, RES/{kernels,decode_gemm,lifecycle,inflight}.log, RES/gpu/*.json;
#    RES/SESSIONDONE at the end
set -uo pipefail
RES=${1:?usage: gpu_job_actquant.sh RES}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$RES/aq" "$RES/gpu" /root/w/aq-gpu
source scripts/gpu_env.sh
export PYTHONUNBUFFERED=1
row() {  # row SHAPE NAME FUSE [GPU]: one banded int8+kv RL-step row (GPU 1 unless given)
  CUDA_VISIBLE_DEVICES=${4:-1} FLASHRL_FUSE_ACT_QUANT=$3 timeout 900 python3 benchmarks/rl_step.py --shapes "$1" \
    --configs int8+kv --prompts 16 --unseeded --first-max-len 256 --gpu-memory-utilization 0.85 --step-bands \
    --workdir "/root/w/aq-${4:-1}" --json "$RES/aq/bands_$1_$2.json" > "$RES/aq/bands_$1_$2.log" 2>&1
  echo "exit $?" >> "$RES/aq/bands_$1_$2.log"
}
tests() {  # tests NAME JOBS PYTEST-ARGS...: one pytest process on GPU $GPU (0 unless set)
  local name=$1 jobs=$2; shift 2
  CUDA_VISIBLE_DEVICES=${GPU:-0} TORCHINDUCTOR_COMPILE_THREADS=2 VLLM_ENABLE_V1_MULTIPROCESSING=0 FLASHRL_GPU_RESULTS=$RES/gpu \
    FLASHRL_GPU_WORK=/root/w/aq-gpu FLASHRL_GPU_JOBS=$jobs timeout 1200 python3 -m pytest -rA -p no:cacheprovider "$@" \
    > "$RES/$name.log" 2>&1
  echo "tests exit $?" >> "$RES/$name.log"
}
gpu0() {
  tests kernels 1 tests/test_kernels.py
  python3 -c "import sys; sys.path.insert(0, 'tests/gpu'); import gpu_harness as h; from pathlib import Path
for a in ('qwen2', 'qwen3', 'qwen3_moe'): h.model_pair(Path('/root/w/aq-gpu'), a)" > "$RES/models.log" 2>&1
  tests decode_gemm 2 tests/gpu/test_vllm_decode_gemm.py &
  tests lifecycle 3 tests/gpu/test_vllm_lifecycle.py -k "int8 and not sq" &
  tests inflight 3 tests/gpu/test_vllm_inflight.py -k "int8 and not ipc and not nccl and not sq" &
  wait
}
if [ -n "${SHORT:-}" ]; then
  (row 7b kernel 0 0; tests decode_gemm 2 tests/gpu/test_vllm_decode_gemm.py) &
  (row 7b fused 1 1; GPU=1 tests kernels 1 tests/test_kernels.py) &
  wait; touch "$RES/SESSIONDONE"; exit 0
fi
gpu0 &
(row 7b fused 1; row 7b kernel 0; row 14b fused 1; row 14b kernel 0) &
wait
touch "$RES/SESSIONDONE"
