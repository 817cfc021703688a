#!/usr/bin/env bash
# Issue 45, the next question after 2026-11-27: does the FP8 KV cache pay at the RL step's context lengths? (vLLM's
# FP8 attention on Hopper breaks even with BF16 KV only at several thousand tokens of context; the step's contexts
# are 1k-token prompts + a mean of 2.6k out.) On a 4-GPU host, after scripts/gpu_install.sh:
#   GPU 0  rl_step.py 7B: int8 (BF16 KV), bf16, int8 + FP8 KV -- each its own process, the goal rows' workload
#   GPU 3  the same at 14B
#   GPU 1  step_profile.py --plain --cached-prompts at long contexts (4k-token prompts, 64 / 4 sequences), 7B:
#          bf16, int8, int8 + FP8 KV
#   GPU 2  the same at 14B
#   setsid nohup bash scripts/gpu_job_kv_choice.sh RES > RES/job.out 2>&1 < /dev/null &
# -> RES/dg/rl_step_SHAPE_CONFIG.{json,log}, RES/dg/step_profile_long_SHAPE.{json,log}; RES/SESSIONDONE at the end
set -uo pipefail
RES=${1:?usage: gpu_job_kv_choice.sh RES}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$RES/dg"
source scripts/gpu_env.sh
export PYTHONUNBUFFERED=1
rows() {  # rows GPU SHAPE: the three RL-step rows, one process each
  for config in int8 bf16 int8+kv; do
    CUDA_VISIBLE_DEVICES=$1 timeout 1500 python3 benchmarks/rl_step.py --shapes "$2" --configs "$config" --prompts 16 \
      --unseeded --first-max-len 256 --gpu-memory-utilization 0.85 --workdir "/root/w/kv-rl-$1" \
      --json "$RES/dg/rl_step_$2_$config.json" > "$RES/dg/rl_step_$2_$config.log" 2>&1
    echo "exit $?" >> "$RES/dg/rl_step_$2_$config.log"
  done
}
long() {  # long GPU SHAPE: decode steps at long contexts, profiled and plain
  CUDA_VISIBLE_DEVICES=$1 timeout 1500 python3 benchmarks/step_profile.py --preset gpu --shapes "$2" \
    --configs bf16,int8,int8+kv --plain --cached-prompts --prompt-len 4096 --bulk 64 --tail 4 \
    --workdir "/root/w/kv-prof-$1" --json "$RES/dg/step_profile_long_$2.json" > "$RES/dg/step_profile_long_$2.log" 2>&1
  echo "exit $?" >> "$RES/dg/step_profile_long_$2.log"
}
rows 0 7b & long 1 7b & long 2 14b & rows 3 14b &
wait
touch "$RES/SESSIONDONE"
