#!/usr/bin/env bash
# Issue 45, SGLang's 14B row at verl's 0.5 (0.649x against 0.60x): name what SGLang's decode step spends in "other"
# kernels at 256 sequences (4.73 ms a step against vLLM's 2.47; step_profile.py's JSON now keeps each phase's
# `top_kernels`), then the 14B pair without --page-size (the runtime's 16-token pages under flashrl's FP8 decode
# kernel: the rows must record page_size 16 for int8 + FP8 KV, SGLang's 1 for BF16); first, on GPU 0, a GRPO group's
# shared prompt read once per group (`decode_attn_variants.py` group_hpp2_hf against the package kernel, ~1 min).
# After scripts/gpu_install.sh and gpu_install_sglang.sh (FA3 library staged). On 2 GPUs (~13 minutes):
#   GPU 0  the group variant; step_profile.py vLLM 14B bf16,int8+kv --plain; then SGLang 14B bf16 (colocated, 0.5)
#   GPU 1  step_profile.py SGLang 14B bf16,int8+kv --plain (fa3); then SGLang 14B int8 + FP8 KV (colocated, 0.5)
#   setsid nohup bash scripts/gpu_job_other.sh RES > /root/job.out 2>&1 < /dev/null &
# -> RES/group.{json,log}, RES/prof_{vllm,sglang}.{json,log}, RES/rN/goal/*.{json,log} (gpu_job_goal.sh),
#    RES/SESSIONDONE
set -uo pipefail
RES=${1:?usage: gpu_job_other.sh RES}
cd "$(dirname "$0")/.." || exit 1
source scripts/gpu_env.sh
export PYTHONUNBUFFERED=1
unset FLASHRL_DECODE_ATTN FLASHRL_DECODE_GEMM FLASHRL_FUSED_KV_STORE
mkdir -p "$RES"
prof() {  # prof GPU ENGINE: step_profile.py at 14B, bf16 and int8 + FP8 KV, bulk 256 / tail 4, with the plain timing
  local extra=() path=$PYTHONPATH
  if [ "$2" = sglang ]; then extra=(--engine sglang --attention-backend fa3); path=/tmp/site_sgl_tf:/tmp/site_sgl:$path; fi
  CUDA_VISIBLE_DEVICES=$1 PYTHONPATH=$path timeout 1200 python3 benchmarks/step_profile.py --preset gpu --shapes 14b \
    --configs bf16,int8+kv --plain --gpu-memory-utilization 0.5 --workdir "/root/w/prof-$1" "${extra[@]}" \
    --json "$RES/prof_$2.json" > "$RES/prof_$2.log" 2>&1
  echo "exit $?" >> "$RES/prof_$2.log"
}
rows() { QUEUES=$2 ARGS="--preset colocated --stats" bash scripts/gpu_job_goal.sh "$RES/$1"; }
group() {  # the shared-prompt variant at 14B and Qwen3-8B, 256 / 128 sequences, prompts of 1,024 tokens in groups of 8
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/decode_attn_variants.py --shapes 14b,qwen3-8b --batches 256,128 \
    --shared-prompt 1024 --group 8 --variants package,group_hpp2_hf --tiles 64:4:2,32:4:2 --json "$RES/group.json" \
    > "$RES/group.log" 2>&1
  echo "exit $?" >> "$RES/group.log"
}
(group; prof 0 vllm; rows r0 $'0:sglang:14b:bf16') &
(prof 1 sglang; rows r1 $'1:sglang:14b:int8+kv') &
wait
touch "$RES/SESSIONDONE"
