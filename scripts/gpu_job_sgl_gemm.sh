#!/usr/bin/env bash
# Issue 45, SGLang's 14B row at verl's 0.5 (0.67x against 0.60x): FLASHRL_DECODE_GEMM on SGLang (flashrl's
# few-rows Triton GEMM for its INT8 linears) -- its bit-equality with sgl-kernel's int8_scaled_mm, the A/B rows
# with the step bands (SGLang's scheduler step log, first GPU run) --, a repeat of vLLM's 14B pair, then where a
# decode step's time goes on both engines (step_profile.py --plain, bulk 256 / tail 4). After
# scripts/gpu_install.sh and gpu_install_sglang.sh (FA3 library staged). On 2 GPUs (~16 minutes):
#   GPU 0  the kernel test; SGLang 14B int8 + FP8 KV (defaults: GEMM and decode attention `auto`); vLLM 14B bf16;
#          step_profile vLLM 14B int8 + FP8 KV
#   GPU 1  SGLang 14B int8 + FP8 KV with FLASHRL_DECODE_GEMM=0; vLLM 14B int8 + FP8 KV; step_profile SGLang
#   setsid nohup bash scripts/gpu_job_sgl_gemm.sh RES > /root/job.out 2>&1 < /dev/null &
# -> RES/kernels.log, RES/rN/goal/*.{json,log} (gpu_job_goal.sh), RES/prof_*.{json,log}, RES/SESSIONDONE
set -uo pipefail
RES=${1:?usage: gpu_job_sgl_gemm.sh RES}
cd "$(dirname "$0")/.." || exit 1
source scripts/gpu_env.sh
export PYTHONUNBUFFERED=1
unset FLASHRL_DECODE_ATTN FLASHRL_DECODE_GEMM FLASHRL_FUSED_KV_STORE
mkdir -p "$RES"
SGL="/tmp/site_sgl_tf:/tmp/site_sgl:$PYTHONPATH"
SHARE="--preset colocated --stats"
rows() { QUEUES=$2 ARGS=$SHARE bash scripts/gpu_job_goal.sh "$RES/$1"; }
prof() {  # prof GPU ENGINE: step_profile.py at 14B, int8 + FP8 KV, bulk 256 / tail 4, with the plain timing
  local extra=() path=$PYTHONPATH
  if [ "$2" = sglang ]; then extra=(--engine sglang --attention-backend fa3); path=$SGL; fi
  CUDA_VISIBLE_DEVICES=$1 PYTHONPATH=$path timeout 900 python3 benchmarks/step_profile.py --preset gpu --shapes 14b \
    --configs int8+kv --plain --gpu-memory-utilization 0.5 --workdir "/root/w/prof-$1" "${extra[@]}" \
    --json "$RES/prof_$2.json" > "$RES/prof_$2.log" 2>&1
  echo "exit $?" >> "$RES/prof_$2.log"
}
lane0() {
  CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$SGL timeout 600 python3 -m pytest -rA -p no:cacheprovider tests/test_kernels.py \
    -k "sgl_kernel or few_rows_takes" > "$RES/kernels.log" 2>&1
  echo "exit $?" >> "$RES/kernels.log"
  rows r0 $'0:sglang:14b:int8+kv\n0:vllm:14b:bf16'
  prof 0 vllm
}
lane1() {
  rows r1 $'1:sglang:14b:int8+kv::FLASHRL_DECODE_GEMM=0\n1:vllm:14b:int8+kv'
  prof 1 sglang
}
lane0 & lane1 &
wait
touch "$RES/SESSIONDONE"
