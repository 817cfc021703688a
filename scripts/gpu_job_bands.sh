#!/usr/bin/env bash
# Issue 45, after 2026-11-27 (neither the FP8 KV cache nor FlashInfer attention moved the RL step; a faster
# few-rows INT8 GEMM did not show inside the 2 % spread between repeats): where the step's time goes by how many
# requests are still running -- `rl_step.py --step-bands` -- for BF16, int8 and int8 + FP8 KV, twice per shape
# (the spread). On a 4-GPU host, after scripts/gpu_install.sh:
#   GPU 0 / 2  rl_step.py 7B bf16, int8+kv, int8 (each its own process; GPU 2 is the repeat)
#   GPU 1 / 3  the same at 14B
#   setsid nohup bash scripts/gpu_job_bands.sh RES > RES/job.out 2>&1 < /dev/null &
# -> RES/dg/bands_SHAPE_CONFIG_gGPU.{json,log}; RES/SESSIONDONE at the end (~8 minutes at 14B)
set -uo pipefail
RES=${1:?usage: gpu_job_bands.sh RES}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$RES/dg"
source scripts/gpu_env.sh
export PYTHONUNBUFFERED=1
rows() {  # rows GPU SHAPE: the three banded RL-step rows, one process each
  for config in bf16 int8+kv int8; do
    CUDA_VISIBLE_DEVICES=$1 timeout 900 python3 benchmarks/rl_step.py --shapes "$2" --configs "$config" --prompts 16 \
      --unseeded --first-max-len 256 --gpu-memory-utilization 0.85 --step-bands --workdir "/root/w/bands-$1" \
      --json "$RES/dg/bands_$2_${config}_g$1.json" > "$RES/dg/bands_$2_${config}_g$1.log" 2>&1
    echo "exit $?" >> "$RES/dg/bands_$2_${config}_g$1.log"
  done
}
rows 0 7b & rows 1 14b & rows 2 7b & rows 3 14b &
wait
touch "$RES/SESSIONDONE"
