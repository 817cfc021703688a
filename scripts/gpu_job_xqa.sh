#!/usr/bin/env bash
# Issue 45, FLASHRL_DECODE_ATTN=xqa inside the engines (TensorRT-LLM's XQA Hopper kernel for FP8 KV decode batches of
# 32+ sequences): its GPU tests, its drift, and the goal rows it is for. After scripts/gpu_install.sh (the default
# model staged: `flashrl verify`), gpu_install_sglang.sh (FA3 library staged) and gpu_install_xqa.sh. On 2 GPUs
# (~15 minutes):
#   GPU 0  SGLang 14B int8 + FP8 KV under xqa, then its BF16 row, then int8 + FP8 KV without xqa (verl's 0.5 share,
#          each its own process: gpu_job_goal.sh)
#   GPU 1  the xqa GPU tests side by side (SGLang sync = fresh, SGLang in flight, vLLM sync = fresh eager and with
#          CUDA graphs), then `flashrl verify drift` int8 + FP8 KV on the default model with and without xqa, then
#          vLLM's 14B int8 + FP8 KV row under xqa
#   setsid nohup bash scripts/gpu_job_xqa.sh RES > /root/job.out 2>&1 < /dev/null &
# -> RES/r0/goal/*, RES/r1/goal/* (rows), RES/tests/{sglang,sglang-inflight,vllm}.log + RES/tests/gpu/*.json,
#    RES/drift_{default,xqa}.{json,log}, RES/SESSIONDONE
set -uo pipefail
RES=${1:?usage: gpu_job_xqa.sh RES}
cd "$(dirname "$0")/.." || exit 1
source scripts/gpu_env.sh
export PYTHONUNBUFFERED=1
unset FLASHRL_DECODE_ATTN FLASHRL_DECODE_GEMM FLASHRL_FUSED_KV_STORE
mkdir -p "$RES"
G=tests/gpu
drift() {  # drift TAG [ENV]: verify drift, int8 + FP8 KV cache, the default model, 64 rollouts of up to 256 tokens
  # shellcheck disable=SC2086  # ENV: assignments
  env ${2:-} CUDA_VISIBLE_DEVICES=1 FLASHRL_KV_CACHE_DTYPE=fp8 timeout 600 python3 -m flashrl_tools verify drift \
    --config int8 -m default -n 64 --max-tokens 256 --json "$RES/drift_$1.json" > "$RES/drift_$1.log" 2>&1
  echo "exit $?" >> "$RES/drift_$1.log"
}
(QUEUES=$'0:sglang:14b:int8+kv:0.5:FLASHRL_DECODE_ATTN=xqa\n0:sglang:14b:bf16:0.5\n0:sglang:14b:int8+kv:0.5' \
  ARGS="--preset colocated --stats" bash scripts/gpu_job_goal.sh "$RES/r0") &
(
  CUDA_VISIBLE_DEVICES=1 GPU_WORK=/root/w/gpu1 TEST_GROUPS="sglang:2:sglang:$G/test_sglang.py::test_sglang_sync_equals_a_fresh_engine[dense-int8+kv@xqa16]
sglang-inflight:1:sglang:$G/test_sglang_inflight.py::test_sglang_inflight_update[in_place-int8+kv@xqa16]
vllm:2:vllm:$G/test_vllm_runtime.py::test_sync_equals_a_fresh_engine[int8+kv@xqa] $G/test_vllm_runtime.py::test_sync_equals_a_fresh_engine[int8+kv@xqa-graphs]" \
    bash scripts/gpu_tests.sh "$RES/tests"
  drift default; drift xqa FLASHRL_DECODE_ATTN=xqa
  QUEUES=$'1:vllm:14b:int8+kv:0.5:FLASHRL_DECODE_ATTN=xqa' ARGS="--preset colocated --stats" \
    bash scripts/gpu_job_goal.sh "$RES/r1"
) &
wait
touch "$RES/SESSIONDONE"
