#!/usr/bin/env bash
# Issue 45 on a 2-GPU host (after scripts/gpu_install.sh with the trainers' wheels and Ray -- verl's own code in the
# lifecycle cases -- and gpu_install_sglang.sh with the FA3 library): the GPU tests of the FP8 KV paths under
# today's defaults (FLASHRL_DECODE_ATTN unset: flashrl's decode attention on Hopper; FLASHRL_FUSED_KV_STORE unset:
# on). Each FP8 KV case asserts that its engines took the kernel the default names.
#   GPU 0  vLLM: sleep levels 1 / 2 and verl's bucketed push (test_vllm_lifecycle.py -k kv), the in-flight updates
#          (test_vllm_inflight.py -k kv; the NCCL case's trainer on GPU 1), AsyncLLM (test_vllm_async_kv.py),
#          synced = fresh (test_vllm_runtime.py -k kv)
#   GPU 1  SGLang: the pause modes on fa3 with the fused store (test_sglang_inflight.py, in_place cases)
#   setsid nohup bash scripts/gpu_job_defaults.sh RES > /root/job.out 2>&1 < /dev/null &
# -> RES/v/{gpu/*.json,*.log}, RES/s/{gpu/*.json,*.log}, RES/SESSIONDONE
set -uo pipefail
RES=${1:?usage: gpu_job_defaults.sh RES}
cd "$(dirname "$0")/.." || exit 1
unset FLASHRL_DECODE_ATTN FLASHRL_FUSED_KV_STORE
mkdir -p "$RES/v" "$RES/s"
G=tests/gpu
S=$G/test_sglang_inflight.py
GPU_WORK=/root/w/gpu-v TEST_GROUPS="lifecycle:8:vllm:$G/test_vllm_lifecycle.py -k kv
inflight:4:vllm:$G/test_vllm_inflight.py -k kv
async:2:vllm:$G/test_vllm_async_kv.py
runtime:4:vllm:$G/test_vllm_runtime.py -k kv" bash scripts/gpu_tests.sh "$RES/v" &
CUDA_VISIBLE_DEVICES=1 GPU_WORK=/root/w/gpu-s TEST_GROUPS="sglang:3:sglang:$S::test_sglang_inflight_update[in_place-int8+kv@fa3] \
$S::test_sglang_inflight_update[in_place-int8] $S::test_sglang_inflight_update[in_place-int8+kv] \
$S::test_kept_fp8_entries_are_no_further_from_a_recompute_than_stale_kv_plus_the_fp8_floor[in_place-int8+kv@fa3] \
$S::test_kept_fp8_entries_are_no_further_from_a_recompute_than_stale_kv_plus_the_fp8_floor[in_place-int8+kv]" \
  bash scripts/gpu_tests.sh "$RES/s" &
wait
touch "$RES/SESSIONDONE"
