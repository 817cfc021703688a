#!/usr/bin/env bash
# Issue 45, after the bands job (2026-11-27: every running-request band of the 8-bit step is 0.75-0.88x BF16's; the
# few-sequence bands, 2-16 running, hold ~40 % of the step): FLASHRL_DECODE_GEMM=16 against CUTLASS and vLLM's Triton
# attention backend for the FP8 KV cache against FA3, by band (`rl_step.py --step-bands`), each row its own process.
# Ran 2026-11-27 on commit 6db53eb, whose Triton GEMM quantized the BF16 activations itself (exact, 2.3x slower per
# layer: reverted, benchmarks/RESULTS.md "A step's time by running requests"); run now, FLASHRL_DECODE_GEMM=16 is the
# Triton GEMM after vLLM's own quantization kernel (and unset: 16 rows on Hopper, so the CUTLASS rows set 0).
# On a 4-GPU host, after scripts/gpu_install.sh:
#   GPU 0  tests/test_kernels.py; small_m_gemm.py 7b,14b; 7B int8+kv FLASHRL_DECODE_GEMM=16;
#          tests/gpu/test_vllm_decode_gemm.py (a synced engine with the switch on = a fresh one on CUTLASS)
#   GPU 1  14B int8+kv FLASHRL_DECODE_GEMM=16        GPU 3  14B int8+kv (CUTLASS, FA3: the same lease's baseline)
#   GPU 2  7B int8+kv --attention-backend TRITON_ATTN, then 7B int8+kv (the same lease's baseline)
#   GEMM_ONLY=1: only the A/B, 7B / 14B with FLASHRL_DECODE_GEMM=16 on GPUs 0 / 2, with CUTLASS on GPUs 1 / 3 (~6 min)
#   setsid nohup bash scripts/gpu_job_fused.sh RES > RES/job.out 2>&1 < /dev/null &
# -> RES/dg/bands_SHAPE_NAME_gGPU.{json,log}, RES/{kernels,small_m_gemm,decode_gemm_tests}.log, RES/gpu/*.json;
#    RES/SESSIONDONE at the end (~10 minutes)
set -uo pipefail
RES=${1:?usage: gpu_job_fused.sh RES}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$RES/dg" /root/w
source scripts/gpu_env.sh
export PYTHONUNBUFFERED=1
row() {  # row GPU SHAPE NAME [ARGS...]: one banded int8+kv RL-step row (env from the caller)
  local gpu=$1 shape=$2 name=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpu timeout 900 python3 benchmarks/rl_step.py --shapes "$shape" --configs int8+kv \
    --prompts 16 --unseeded --first-max-len 256 --gpu-memory-utilization 0.85 --step-bands "$@" \
    --workdir "/root/w/fused-$gpu" --json "$RES/dg/bands_${shape}_${name}_g$gpu.json" \
    > "$RES/dg/bands_${shape}_${name}_g$gpu.log" 2>&1
  echo "exit $?" >> "$RES/dg/bands_${shape}_${name}_g$gpu.log"
}
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  timeout 600 python3 -m pytest -rA -p no:cacheprovider tests/test_kernels.py > "$RES/kernels.log" 2>&1
  echo "tests exit $?" >> "$RES/kernels.log"
  timeout 600 python3 benchmarks/small_m_gemm.py --shapes 7b,14b --rows 1,4,16 --json "$RES/small_m_gemm.json" \
    > "$RES/small_m_gemm.log" 2>&1
  echo "exit $?" >> "$RES/small_m_gemm.log"
  FLASHRL_DECODE_GEMM=16 row 0 7b fused16
  FLASHRL_GPU_RESULTS=$RES/gpu FLASHRL_GPU_WORK=/root/w/dg-test FLASHRL_GPU_JOBS=2 FLASHRL_LOGGING_LEVEL=INFO \
    timeout 900 python3 -m pytest -rA -p no:cacheprovider tests/gpu/test_vllm_decode_gemm.py > "$RES/decode_gemm_tests.log" 2>&1
  echo "tests exit $?" >> "$RES/decode_gemm_tests.log"
}
if [ -n "${GEMM_ONLY:-}" ]; then
  FLASHRL_DECODE_GEMM=16 row 0 7b triton16 & FLASHRL_DECODE_GEMM=0 row 1 7b cutlass & FLASHRL_DECODE_GEMM=16 row 2 14b triton16 & FLASHRL_DECODE_GEMM=0 row 3 14b cutlass &
  wait; touch "$RES/SESSIONDONE"; exit 0
fi
gpu0 &
FLASHRL_DECODE_GEMM=16 row 1 14b fused16 &
(FLASHRL_DECODE_GEMM=0 row 2 7b triton_attn --attention-backend TRITON_ATTN; FLASHRL_DECODE_GEMM=0 row 2 7b cutlass) &
FLASHRL_DECODE_GEMM=0 row 3 14b cutlass &
wait
touch "$RES/SESSIONDONE"
