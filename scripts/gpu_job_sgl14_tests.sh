#!/usr/bin/env bash
# Issue 45 on a 4-GPU host (2026-11-27, after scripts/gpu_install.sh with the trainers' wheels and Ray, and
# gpu_install_sglang.sh with the FA3 library): SGLang's 14B goal rows on GPUs 0-2 (one config per GPU, each its own
# process; gpu_job_goal.sh) beside the vLLM INT8 GPU tests under FLASHRL_DECODE_GEMM's default on GPU 3 (lifecycle
# with verl 0.9.1's own bucketed push; runtime, MoE, AsyncLLM + FP8 KV).
#   setsid nohup bash scripts/gpu_job_sgl14_tests.sh RES > /root/job.out 2>&1 < /dev/null &
# -> RES/g/goal/*.{json,log} (gpu_job_goal.sh), RES/t/{gpu/*.json,*.log} (gpu_tests.sh), RES/SESSIONDONE
set -uo pipefail
RES=${1:?usage: gpu_job_sgl14_tests.sh RES}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$RES/t" "$RES/g"
G=tests/gpu
QUEUES=$'0:sglang:14b:bf16\n1:sglang:14b:int8+kv\n2:sglang:14b:int8' bash scripts/gpu_job_goal.sh "$RES/g" &
CUDA_VISIBLE_DEVICES=3 TEST_GROUPS="lifecycle:6:vllm:$G/test_vllm_lifecycle.py -k int8
vllm:4:vllm:$G/test_vllm_runtime.py $G/test_vllm_moe.py $G/test_vllm_async_kv.py -k int8" \
  bash scripts/gpu_tests.sh "$RES/t" &
wait
touch "$RES/SESSIONDONE"
