#!/usr/bin/env bash
# Issue 45, SGLang's 14B row at verl's 0.5 (0.649x against 0.60x): name what SGLang's decode step spends in "other"
# kernels at 256 sequences (4.73 ms a step against vLLM's 2.47; step_profile.py's JSON keeps each phase's
# `top_kernels`), on both engines, and run SGLang's 14B int8 + FP8 KV row without --page-size (the runtime's 16-token
# pages under flashrl's FP8 decode kernel: the row must record page_size 16). After scripts/gpu_install.sh and
# gpu_install_sglang.sh (FA3 library staged). On 2 GPUs (~8 minutes):
#   GPU 0  step_profile.py SGLang 14B bf16,int8+kv (fa3); then vLLM 14B int8+kv
#   GPU 1  SGLang 14B int8 + FP8 KV (colocated, 0.5)
#   setsid nohup bash scripts/gpu_job_other.sh RES > /root/job.out 2>&1 < /dev/null &
# -> RES/prof_{sglang,vllm}.{json,log}, RES/r1/goal/*.{json,log} (gpu_job_goal.sh), RES/SESSIONDONE
set -uo pipefail
RES=${1:?usage: gpu_job_other.sh RES}
cd "$(dirname "$0")/.." || exit 1
source scripts/gpu_env.sh
export PYTHONUNBUFFERED=1
unset FLASHRL_DECODE_ATTN FLASHRL_DECODE_GEMM FLASHRL_FUSED_KV_STORE
mkdir -p "$RES"
prof() {  # prof GPU ENGINE CONFIGS: step_profile.py at 14B, bulk 256 / tail 4 (the kernels by name; no plain timing)
  local extra=() path=$PYTHONPATH
  if [ "$2" = sglang ]; then extra=(--engine sglang --attention-backend fa3); path=/tmp/site_sgl_tf:/tmp/site_sgl:$path; fi
  CUDA_VISIBLE_DEVICES=$1 PYTHONPATH=$path timeout 900 python3 benchmarks/step_profile.py --preset gpu --shapes 14b \
    --configs "$3" --gpu-memory-utilization 0.5 --workdir "/root/w/prof-$1" "${extra[@]}" \
    --json "$RES/prof_$2.json" > "$RES/prof_$2.log" 2>&1
  echo "exit $?" >> "$RES/prof_$2.log"
}
(prof 0 sglang bf16,int8+kv; prof 0 vllm int8+kv) &
(QUEUES=$'1:sglang:14b:int8+kv' ARGS="--preset colocated --stats" bash scripts/gpu_job_goal.sh "$RES/r1") &
wait
touch "$RES/SESSIONDONE"
