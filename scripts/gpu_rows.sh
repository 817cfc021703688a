#!/usr/bin/env bash
# benchmarks/rl_step.py rows on the lent GPU host (called by scripts/gpu_job.sh for a job's ROWS), each config its
# own process, every row `--unseeded --first-max-len 256 --step-bands`; SGLang rows with fa3 and SGLang's pinned
# transformers first on the path. One queue per GPU, its lines in order; the GPUs' queues side by side.
#   QUEUES: "GPU:ENGINE:SHAPE[:CONFIGS[:SHARE[:ENV]]]" per line -- GPU one index or several ("0,1": ARGS' --tp 2),
#     CONFIGS comma-separated (default bf16,int8+kv,int8); SHARE `--gpu-memory-utilization` after ARGS; ENV
#     assignments for the line's rows, e.g.
#     1:sglang:qwen3-8b:int8+kv:0.3:FLASHRL_DECODE_ATTN=1 -> goal/sglang_qwen3-8b_int8+kv_0.3_FLASHRL_DECODE_ATTN-1.json
#   ARGS: the workload's flags (default `--prompts 16 --gpu-memory-utilization 0.85`; e.g. `--preset colocated --stats`)
#   QUEUES=... ARGS=... bash scripts/gpu_rows.sh RES -> RES/goal/ENGINE_SHAPE_CONFIG[_SHARE][_ENV].{json,log}
#   (each log ends "exit N"); RES/SESSIONDONE at the end
set -uo pipefail
RES=${1:?usage: gpu_rows.sh RES}
cd "$(dirname "$0")/.." || exit 1
source scripts/gpu_env.sh
export PYTHONUNBUFFERED=1
O=$RES/goal
mkdir -p "$O" /root/w
SGL="/tmp/site_sgl_tf:/tmp/site_sgl:$PYTHONPATH"
queue() {  # queue GPU ENGINE SHAPE [CONFIGS [SHARE [ENV]]]: the configs one after the other, each its own process
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
