#!/usr/bin/env bash
# One device session's work as a queue (DEVELOPERS.md "GPU (device tool)"): started with
#   setsid nohup bash scripts/gpu_session_queue.sh REPO_DIR > /root/res/queue.out 2>&1 < /dev/null &
# after install-vllm-bundle.sh; results and logs land in /root/res (tar them into $OUT from
# later calls). Phase 1: correctness checks side by side on the GPU (small models, fixed KV
# memory, at most MAX_JOBS at once, killed at P_DEADLINE s). Phase 2: throughput benchmarks
# alone on the GPU, in order. Edit the two lists for the session's plan.
R=$1; cd "$R" || exit 1; source scripts/gpu_env.sh
export VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=2
RES=/root/res; mkdir -p $RES /root/w
EA='{"gpu_memory_utilization": 0.04, "kv_cache_memory_bytes": 1073741824}'
G=benchmarks/gpu_runtime_check.py; M=benchmarks/gpu_moe_check.py; S=benchmarks/rl_step.py
KV="--skip-7b --kv-cache-dtype fp8 --reload --engine-args '$EA'"
IP="--skip-7b --reload --correctness-configs int8,fp8_channel --engine-args '$EA'"
EAGER='{"gpu_memory_utilization": 0.04, "kv_cache_memory_bytes": 1073741824, "enforce_eager": true}'
DEF="\$(python -c 'from flashrl_tools.models.default import ensure_default_model as e; print(e())')"
AK="python examples/async_kv_probe.py $DEF /root/w/pert --engine-args '$EA'"
CHECKS=(  # name|command (phase 1, in priority order; MoE and drift jobs are slow side by side:
          # at most 3 at once, DEVELOPERS.md "GPU (device tool)")
  "fp8-eager|python $G --skip-7b --reload --correctness-configs fp8 --engine-args '$EA' --workdir /root/w/c1 --json $RES/fp8-eager.json"
  "fp8-compiled|python $G --skip-7b --reload --compiled --correctness-configs fp8 --engine-args '$EA' --workdir /root/w/c2 --json $RES/fp8-compiled.json"
  "fp8-kv-compiled|python $G --skip-7b --reload --compiled --kv-cache-dtype fp8 --correctness-configs fp8 --engine-args '$EA' --workdir /root/w/c3 --json $RES/fp8-kv-compiled.json"
  "int8-fp8c-eager|python $G $IP --workdir /root/w/c4 --json $RES/int8-fp8c-eager.json"
)
BENCH=(  # name|command (phase 2, alone on the GPU, in order; ratios only within one session)
  "ws-dense|python benchmarks/weight_sync.py --shapes 7b,14b --modes bf16,fp8 --repeats 3 --workdir /root/w/ws --json $RES/ws-dense.json"
)
# Next machine (32B rows, one machine for all three):
#   rl-32b-bf16 / rl-32b-fp8 / rl-32b-int8+kv: python $S --shapes 32b --configs NAME --prompts 4
#   --first-max-len 256 --workdir /root/w/s --json $RES/rl-32b-NAME.json
# Two-GPU session (nvidia-h200-x2), when lent: python $M --archs qwen3_moe --configs int8,fp8 --tp 2
#   --no-bound --no-dense (per-channel fp8 now), then with FLASHRL_INPLACE_SYNC=tp, then --ep.
T0=$(date +%s); log() { echo "[$(( $(date +%s) - T0 ))s] $*" >> $RES/queue.log; }
[ "${ENSURE_DEFAULT:-1}" = 1 ] && python -c "from flashrl_tools.models.default import ensure_default_model as e; print(e())" >> $RES/queue.log 2>&1
declare -A PIDS
running() { local c=0; for n in "${!PIDS[@]}"; do kill -0 ${PIDS[$n]} 2>/dev/null && c=$((c+1)); done; echo $c; }
DEADLINE=$(( T0 + ${P_DEADLINE:-540} ))
for entry in "${CHECKS[@]}"; do
  name=${entry%%|*}; cmd=${entry#*|}
  while [ "$(running)" -ge "${MAX_JOBS:-3}" ] && [ $(date +%s) -lt $DEADLINE ]; do sleep 3; done
  [ $(date +%s) -ge $DEADLINE ] && { log "skip $name (deadline)"; continue; }
  VLLM_CACHE_ROOT=/root/vc/$name setsid bash -c "$cmd; echo \"exit \$?\"" > $RES/$name.log 2>&1 &
  PIDS[$name]=$!; log "start $name"
done
while [ "$(running)" -gt 0 ] && [ $(date +%s) -lt $DEADLINE ]; do sleep 3; done
for n in "${!PIDS[@]}"; do kill -0 ${PIDS[$n]} 2>/dev/null && { log "kill $n (deadline)"; kill -KILL -- -${PIDS[$n]}; }; done
sleep 3; log "phase 1 done"
for entry in "${BENCH[@]}"; do
  name=${entry%%|*}; cmd=${entry#*|}
  log "start $name"; VLLM_CACHE_ROOT=/root/vc/s bash -c "$cmd" > $RES/$name.log 2>&1; log "end $name rc=$?"
done
log "ALL DONE"; touch $RES/ALLDONE
