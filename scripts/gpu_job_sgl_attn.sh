#!/usr/bin/env bash
# Issue 45: SGLang's fa3 decode through flashrl's FP8 decode kernel (runtime/sglang/decode_attn.py,
# FLASHRL_DECODE_ATTN=1) -- its GPU tests, then its rows -- and vLLM's 14B row under two KV heads a program. After
# scripts/gpu_install.sh (T1 for uvicorn) and gpu_install_sglang.sh (FA3 library staged). On 4 GPUs (~13 minutes):
#   GPU 0  test_sglang_inflight.py in_place-int8, in_place-int8+kv@fa3, in_place-int8+kv@fa3attn; then SGLang
#          int8 + FP8 KV with FLASHRL_DECODE_ATTN=1: Qwen3-8B at TRL's 0.3, 14B at verl's 0.5
#   GPU 1  test_sglang.py -k fa3; then SGLang bf16: Qwen3-8B at 0.3, 14B at 0.5
#   GPU 2  vLLM 14B bf16 at 0.5; then SGLang Qwen3-8B int8 + FP8 KV at 0.3, its own fa3 decode (the A/B)
#   GPU 3  vLLM 14B int8 + FP8 KV at 0.5; then SGLang 14B int8 + FP8 KV at 0.5, its own fa3 decode
# On 2 GPUs: the tests, the Qwen3-8B SGLang pair (attention through flashrl / bf16), then vLLM's 14B pair.
#   setsid nohup bash scripts/gpu_job_sgl_attn.sh RES > /root/job.out 2>&1 < /dev/null &
# -> RES/t0, RES/t1 (gpu_tests.sh), RES/rN/goal/*.{json,log} (gpu_job_goal.sh), RES/SESSIONDONE
set -uo pipefail
RES=${1:?usage: gpu_job_sgl_attn.sh RES}
cd "$(dirname "$0")/.." || exit 1
unset FLASHRL_DECODE_ATTN FLASHRL_FUSED_KV_STORE
G=tests/gpu
IF=$G/test_sglang_inflight.py
INFLIGHT="$IF::test_sglang_inflight_update[in_place-int8] $IF::test_sglang_inflight_update[in_place-int8+kv@fa3]
$IF::test_sglang_inflight_update[in_place-int8+kv@fa3attn]"
for c in fa3 fa3attn; do INFLIGHT+=" $IF::test_kept_fp8_entries_are_no_further_from_a_recompute_than_stale_kv_plus_the_fp8_floor[in_place-int8+kv@$c]"; done
INFLIGHT=${INFLIGHT//$'\n'/ }
ATTN=FLASHRL_DECODE_ATTN=1 SHARE="--preset colocated --stats"
rows() { QUEUES=$2 ARGS=$SHARE bash scripts/gpu_job_goal.sh "$RES/$1"; }
N=$(nvidia-smi -L | wc -l)
lane0() {
  CUDA_VISIBLE_DEVICES=0 GPU_WORK=/root/w/gpu-0 TEST_GROUPS="inflight:3:sglang:$INFLIGHT" bash scripts/gpu_tests.sh "$RES/t0"
  if [ "$N" -ge 4 ]; then rows r0 "0:sglang:qwen3-8b:int8+kv:0.3:$ATTN"$'\n'"0:sglang:14b:int8+kv::$ATTN"
  else rows r0 "0:sglang:qwen3-8b:int8+kv:0.3:$ATTN"$'\n0:vllm:14b:bf16'; fi
}
lane1() {
  CUDA_VISIBLE_DEVICES=1 GPU_WORK=/root/w/gpu-1 TEST_GROUPS="fa3:2:sglang:$G/test_sglang.py -k fa3" bash scripts/gpu_tests.sh "$RES/t1"
  if [ "$N" -ge 4 ]; then rows r1 $'1:sglang:qwen3-8b:bf16:0.3\n1:sglang:14b:bf16'
  else rows r1 $'1:sglang:qwen3-8b:bf16:0.3\n1:vllm:14b:int8+kv'; fi
}
lane0 & lane1 &
if [ "$N" -ge 4 ]; then
  rows r2 $'2:vllm:14b:bf16\n2:sglang:qwen3-8b:int8+kv:0.3' &
  rows r3 $'3:vllm:14b:int8+kv\n3:sglang:14b:int8+kv' &
fi
wait
touch "$RES/SESSIONDONE"
