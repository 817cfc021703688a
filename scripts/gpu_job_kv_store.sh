#!/usr/bin/env bash
# Issue 45 on a 4-GPU host (after scripts/gpu_install.sh with the trainers' wheels for uvicorn, and
# gpu_install_sglang.sh with the FA3 library): SGLang's FP8 KV store in one kernel (runtime/sglang/kv_store.py).
#   GPU 0  rl_step, SGLang Qwen3-8B int8 + FP8 KV, FLASHRL_FUSED_KV_STORE=1      GPU 1  the same, 0 (SGLang's store)
#   GPU 2  tests: the fused store's values vs SGLang's (test_sglang_kv_store.py), an engine with it = a fresh one
#          (test_sglang.py -k fa3), the switch on                                 GPU 3  rl_step, SGLang Qwen3-8B bf16
# The workload: --preset colocated (0.5 of the GPU, 256 sequences) with outputs up to 4,096 tokens.
#   setsid nohup bash scripts/gpu_job_kv_store.sh RES > /root/job.out 2>&1 < /dev/null &
# -> RES/goal/*.{json,log}, RES/t/{gpu/*.json,*.log}, RES/SESSIONDONE
set -uo pipefail
RES=${1:?usage: gpu_job_kv_store.sh RES}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$RES/t" "$RES/g" "$RES/off"
ARGS="--preset colocated --max-len 4096"
export ARGS
FLASHRL_FUSED_KV_STORE=1 QUEUES=$'0:sglang:qwen3-8b:int8+kv\n3:sglang:qwen3-8b:bf16' bash scripts/gpu_job_goal.sh "$RES/g" &
FLASHRL_FUSED_KV_STORE=0 QUEUES=$'1:sglang:qwen3-8b:int8+kv' bash scripts/gpu_job_goal.sh "$RES/off" &
G=tests/gpu
CUDA_VISIBLE_DEVICES=2 FLASHRL_FUSED_KV_STORE=1 TEST_GROUPS="kv-store:1:sglang:$G/test_sglang_kv_store.py
sglang:2:sglang:$G/test_sglang.py -k fa3" \
  bash scripts/gpu_tests.sh "$RES/t" &
wait
touch "$RES/SESSIONDONE"
