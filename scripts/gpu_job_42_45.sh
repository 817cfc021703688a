#!/usr/bin/env bash
# Four GPUs, each its own queue: issue 42's in-place FP8 KV tests and issue 45's few-rows INT8 GEMM step A/B.
#   GPU 0  the in-place FP8 KV tests + the kept tokens' bound, triton      (gpu_job_sglang42.sh PART=inflight-triton)
#   GPU 1  the same with fa3                                               (PART=inflight-fa3)
#   GPU 2  gpu_job_decode_gemm.sh at 7B: kernel tests, small_m_gemm, the engine test, RL-step rows int8 + FP8 KV with
#          FLASHRL_DECODE_GEMM and with CUTLASS, then BF16
#   GPU 3  the same at 14B: no kernel or engine test, ROWS=16 from the 2026-11-27 sweep; both shapes repeat the A/B
#   setsid nohup bash scripts/gpu_job_42_45.sh RES > RES/job.out 2>&1 < /dev/null &
# -> RES/j01 (issue 42), RES/dg (issue 45); RES/SESSIONDONE when all finished
# (2026-11-27: GPU 2 ran test_sglang.py's sync cases -- PART=sync, all passed -- then the 7B base rows.)
set -uo pipefail
RES=${1:?usage: gpu_job_42_45.sh RES}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$RES/j01" "$RES/dg"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1
(CUDA_VISIBLE_DEVICES=0 TESTS_TIMEOUT=600 NO_STREAM=1 NO_TRITON=1 PART=inflight-triton bash scripts/gpu_job_sglang42.sh "$RES/j01") &
(CUDA_VISIBLE_DEVICES=1 TESTS_TIMEOUT=600 NO_STREAM=1 NO_TRITON=1 PART=inflight-fa3 bash scripts/gpu_job_sglang42.sh "$RES/j01") &
(CUDA_VISIBLE_DEVICES=2 SHAPE=7b REPEAT=1 bash scripts/gpu_job_decode_gemm.sh "$RES/dg") &
(CUDA_VISIBLE_DEVICES=3 SHAPE=14b ROWS=16 NO_KERNEL_TESTS=1 NO_ENGINE_TEST=1 REPEAT=1 bash scripts/gpu_job_decode_gemm.sh "$RES/dg") &
wait
touch "$RES/SESSIONDONE"
