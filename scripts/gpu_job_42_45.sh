#!/usr/bin/env bash
# Four GPUs, each its own queue (2026-11-27): issue 42's last SGLang checks and issue 45's few-rows INT8 GEMM.
#   GPU 0  the in-place FP8 KV tests + the kept tokens' bound, triton      (gpu_job_sglang42.sh PART=inflight-triton)
#   GPU 1  the same with fa3                                               (PART=inflight-fa3)
#   GPU 2  test_sglang.py's sync cases (PART=sync), then the 7B RL-step rows bf16 + int8 + FP8 KV (CUTLASS)
#   GPU 3  gpu_job_decode_gemm.sh: kernel tests, small_m_gemm, the engine test, the 7B int8 + FP8 KV rows with
#          FLASHRL_DECODE_GEMM and with CUTLASS (the same GPU: the A/B)
#   setsid nohup bash scripts/gpu_job_42_45.sh RES > RES/job.out 2>&1 < /dev/null &
# -> RES/j01 (issue 42), RES/dg (issue 45); RES/SESSIONDONE when all finished
set -uo pipefail
RES=${1:?usage: gpu_job_42_45.sh RES}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$RES/j01" "$RES/dg"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1
(CUDA_VISIBLE_DEVICES=0 NO_STREAM=1 NO_TRITON=1 PART=inflight-triton bash scripts/gpu_job_sglang42.sh "$RES/j01") &
(CUDA_VISIBLE_DEVICES=1 NO_STREAM=1 NO_TRITON=1 PART=inflight-fa3 bash scripts/gpu_job_sglang42.sh "$RES/j01") &
(export CUDA_VISIBLE_DEVICES=2
 NO_STREAM=1 NO_TRITON=1 PART=sync bash scripts/gpu_job_sglang42.sh "$RES/j01"
 source scripts/gpu_env.sh
 timeout 1200 python3 benchmarks/rl_step.py --shapes 7b --configs bf16,int8+kv --prompts 16 --unseeded \
   --first-max-len 256 --gpu-memory-utilization 0.85 --workdir /root/w/base-rl --json "$RES/dg/rl_step_7b_base.json" \
   > "$RES/dg/rl_step_7b_base.log" 2>&1) &
(CUDA_VISIBLE_DEVICES=3 RL_AB=1 bash scripts/gpu_job_decode_gemm.sh "$RES/dg") &
wait
touch "$RES/SESSIONDONE"
