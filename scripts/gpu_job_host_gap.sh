#!/usr/bin/env bash
# Issue 45's "where the time goes", the host's share: benchmarks/step_profile.py --plain (the profiled kernels per
# decode step, then the same generate without the profiler in vLLM's default engine-core process) on a 4-GPU host,
# one config per GPU, after scripts/gpu_install.sh:
#   GPU 0 7B bf16, GPU 1 7B int8 + FP8 KV, GPU 2 14B bf16, GPU 3 14B int8 + FP8 KV
#   (2026-11-27: RESULTS "The host's share at full speed"; long contexts: scripts/gpu_job_kv_choice.sh)
#   setsid nohup bash scripts/gpu_job_host_gap.sh RES > RES/job.out 2>&1 < /dev/null &
# -> RES/dg/step_profile_plain_SHAPE_CONFIG.{json,log}; RES/SESSIONDONE when all finished
set -uo pipefail
RES=${1:?usage: gpu_job_host_gap.sh RES}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$RES/dg"
source scripts/gpu_env.sh
export PYTHONUNBUFFERED=1
one() {  # one GPU SHAPE CONFIG
  local name=$RES/dg/step_profile_plain_$2_$3
  CUDA_VISIBLE_DEVICES=$1 timeout 1200 python3 benchmarks/step_profile.py --preset gpu --shapes "$2" --configs "$3" \
    --plain --workdir "/root/w/gap-$1" --json "$name.json" > "$name.log" 2>&1
  echo "exit $?" >> "$name.log"
}
one 0 7b bf16 & one 1 7b int8+kv & one 2 14b bf16 & one 3 14b int8+kv &
wait
touch "$RES/SESSIONDONE"
