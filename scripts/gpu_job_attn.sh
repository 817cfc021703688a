#!/usr/bin/env bash
# Issue 45, after gpu_job_kv_choice.sh (2026-11-27: vLLM's default FP8 decode attention, FLASH_ATTN with an FP8
# query, reads the FP8 KV cache at ~half the bandwidth its BF16 one reaches): the same rows with vLLM's FLASHINFER
# attention backend. On a 4-GPU host, after scripts/gpu_install.sh:
#   GPU 0  rl_step.py 7B int8 + FP8 KV, then bf16, both FLASHINFER   GPU 3  rl_step.py 14B int8 + FP8 KV, FLASHINFER
#   GPU 1  step_profile.py --plain --cached-prompts 4k-token prompts, 7B bf16 and int8 + FP8 KV, FLASHINFER
#   GPU 2  the same at 14B, int8 + FP8 KV
#   setsid nohup bash scripts/gpu_job_attn.sh RES > RES/job.out 2>&1 < /dev/null &
# -> RES/dg/rl_step_SHAPE_CONFIG_BACKEND.{json,log}, RES/dg/step_profile_long_SHAPE_BACKEND.{json,log} (lower case); RES/SESSIONDONE
set -uo pipefail
RES=${1:?usage: gpu_job_attn.sh RES}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$RES/dg"
B=${BACKEND:-FLASHINFER}; T=${B,,}  # another backend: BACKEND=TRITON_ATTN
source scripts/gpu_env.sh
export PYTHONUNBUFFERED=1
rows() {  # rows GPU SHAPE CONFIG...: RL-step rows with FLASHINFER, one process each
  local gpu=$1 shape=$2; shift 2
  for config in "$@"; do
    CUDA_VISIBLE_DEVICES=$gpu timeout 900 python3 benchmarks/rl_step.py --shapes "$shape" --configs "$config" \
      --prompts 16 --unseeded --first-max-len 256 --gpu-memory-utilization 0.85 --attention-backend "$B" \
      --workdir "/root/w/$T-rl-$gpu" --json "$RES/dg/rl_step_${shape}_${config}_$T.json" \
      > "$RES/dg/rl_step_${shape}_${config}_$T.log" 2>&1
    echo "exit $?" >> "$RES/dg/rl_step_${shape}_${config}_$T.log"
  done
}
long() {  # long GPU SHAPE CONFIGS: decode steps at 4k-token contexts with FLASHINFER, profiled and plain
  CUDA_VISIBLE_DEVICES=$1 timeout 900 python3 benchmarks/step_profile.py --preset gpu --shapes "$2" --configs "$3" \
    --plain --cached-prompts --prompt-len 4096 --bulk 64 --tail 4 --attention-backend "$B" \
    --workdir "/root/w/$T-prof-$1" --json "$RES/dg/step_profile_long_$2_$T.json" > "$RES/dg/step_profile_long_$2_$T.log" 2>&1
  echo "exit $?" >> "$RES/dg/step_profile_long_$2_$T.log"
}
rows 0 7b int8+kv bf16 & long 1 7b int8+kv,bf16 & long 2 14b int8+kv & rows 3 14b int8+kv &
wait
touch "$RES/SESSIONDONE"
