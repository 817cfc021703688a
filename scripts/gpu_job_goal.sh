#!/usr/bin/env bash
# Issue 45's goal rows on both engines, after scripts/gpu_install.sh and gpu_install_sglang.sh (FA3 library staged):
# each config its own process, every row with `rl_step.py --step-bands`, FLASHRL_DECODE_GEMM at its default
# (`auto`: 16 rows on Hopper). On a 4-GPU host (~20 minutes, the 14B queues the longest):
#   GPU 0  vLLM 7B: bf16, int8 + FP8 KV, int8          GPU 1  vLLM 14B: the same
#   GPU 2  SGLang 7B (fa3, overlap on): bf16, int8 + FP8 KV, int8      GPU 3  SGLang 14B: the same (never run before)
# On 2 GPUs (the 4-GPU kinds are not always lent), QUEUES picks the queues, "GPU:ENGINE:SHAPE:CONFIGS" per line, e.g.
# SGLang's 14B rows alone (~10 minutes): QUEUES=$'0:sglang:14b:bf16,int8\n1:sglang:14b:int8+kv'; lines naming
# the same GPU run one after the other, in their order. ARGS replaces the workload's flags (default the goal rows':
# `--prompts 16 --gpu-memory-utilization 0.85`), e.g. ARGS="--preset colocated --stats" for verl's colocated share.
# A line's optional fifth and sixth fields: the share (`--gpu-memory-utilization`, after ARGS) and environment
# assignments for its rows, both in the files' names, e.g. `1:sglang:qwen3-8b:int8+kv:0.3:FLASHRL_DECODE_ATTN=1`
# -> goal/sglang_qwen3-8b_int8+kv_0.3_FLASHRL_DECODE_ATTN-1.json.
#   setsid nohup bash scripts/gpu_job_goal.sh RES > RES/job.out 2>&1 < /dev/null &
# -> RES/goal/ENGINE_SHAPE_CONFIG.{json,log}; RES/SESSIONDONE at the end
set -uo pipefail
RES=${1:?usage: gpu_job_goal.sh RES}
cd "$(dirname "$0")/.." || exit 1
source scripts/gpu_env.sh
export PYTHONUNBUFFERED=1
O=$RES/goal
mkdir -p "$O" /root/w
SGL="/tmp/site_sgl_tf:/tmp/site_sgl:$PYTHONPATH"
queue() {  # queue GPU ENGINE SHAPE [CONFIGS [SHARE [ENV]]]: the configs (bf16,int8+kv,int8) one after the other, each its own process
  local gpu=$1 engine=$2 shape=$3 configs=${4:-bf16,int8+kv,int8} share=${5:-} envs=${6:-} config extra path=$PYTHONPATH
  local tag=${share:+_$share}${envs:+_${envs//[ =]/-}} stem
  extra=(--step-bands)
  if [ "$engine" = sglang ]; then extra+=(--engine sglang --attention-backend fa3); path=$SGL; fi
  [ -n "$share" ] && extra+=(--gpu-memory-utilization "$share")
  for config in ${configs//,/ }; do
    stem=$O/${engine}_${shape}_$config$tag
    # shellcheck disable=SC2086  # ARGS is a list of flags, envs a list of assignments
    env $envs CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=$path timeout 1200 python3 benchmarks/rl_step.py --shapes "$shape" \
      --configs "$config" ${ARGS:---prompts 16 --gpu-memory-utilization 0.85} --unseeded --first-max-len 256 "${extra[@]}" \
      --workdir "/root/w/goal-$gpu" --json "$stem.json" > "$stem.log" 2>&1
    echo "exit $?" >> "$stem.log"
  done
}
QUEUES=${QUEUES:-$'0:vllm:7b\n1:vllm:14b\n2:sglang:7b\n3:sglang:14b'}
for g in $(cut -d: -f1 <<< "$QUEUES" | sort -u); do  # one background queue per GPU, its lines in order
  grep "^$g:" <<< "$QUEUES" | while IFS=: read -r gpu engine shape configs share envs; do
    queue "$gpu" "$engine" "$shape" "$configs" "$share" "$envs"
  done &
done
wait
touch "$RES/SESSIONDONE"
