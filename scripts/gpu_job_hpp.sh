#!/usr/bin/env bash
# Issue 45, flashrl's FP8 decode kernel with two KV heads a program (quant/kernels/fp8_decode_attn.py), on a 2-GPU
# host after scripts/gpu_install.sh (vLLM alone: T1=/nonexistent T2=/nonexistent):
#   1. TRL's 0.3 share, Qwen3-8B, side by side: bf16 on GPU 0, int8 + FP8 KV on GPU 1 (scripts/gpu_job_goal.sh)
#   2. the engine tests the kernel serves: test_vllm_runtime.py -k kv on GPU 0 (synced = fresh, the kernel taken in
#      both), test_vllm_async_kv.py on GPU 1 (AsyncLLM, engine core in its own process)
#   setsid nohup bash scripts/gpu_job_hpp.sh RES > /root/job.out 2>&1 < /dev/null &
# -> RES/rows/goal/*.{json,log}, RES/v/..., RES/a/..., RES/SESSIONDONE
set -uo pipefail
RES=${1:?usage: gpu_job_hpp.sh RES}
cd "$(dirname "$0")/.." || exit 1
unset FLASHRL_DECODE_ATTN FLASHRL_FUSED_KV_STORE
mkdir -p "$RES/rows" "$RES/v" "$RES/a"
QUEUES=$'0:vllm:qwen3-8b:bf16\n1:vllm:qwen3-8b:int8+kv' ARGS="--preset colocated --stats --gpu-memory-utilization 0.3" \
  bash scripts/gpu_job_goal.sh "$RES/rows"
G=tests/gpu
CUDA_VISIBLE_DEVICES=0 GPU_WORK=/root/w/gpu-v TEST_GROUPS="runtime:4:vllm:$G/test_vllm_runtime.py -k kv" \
  bash scripts/gpu_tests.sh "$RES/v" &
CUDA_VISIBLE_DEVICES=1 GPU_WORK=/root/w/gpu-a TEST_GROUPS="async:2:vllm:$G/test_vllm_async_kv.py" \
  bash scripts/gpu_tests.sh "$RES/a" &
wait
touch "$RES/SESSIONDONE"
