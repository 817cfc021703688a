#!/usr/bin/env bash
# Issue 30's trainer runs on one lent GPU (after scripts/gpu_install.sh), with checks beside them.
# vLLM's start-up memory profiling asserts when another process frees GPU memory meanwhile, and TRL
# cannot pass a fixed KV size (kv_cache_memory_bytes, which skips the profiling): so the TRL run starts
# first and alone; once it has logged its first step (its engine is up and sleeping/waking), the verl
# runs (fixed KV size, scripts/gpu_verl_runs.sh) and the CHECK command (engines with a fixed KV size)
# start beside it. A second TRL config would have to start alone again: use one per machine.
#   TRL=bf16 VERL="int8:2 fp8:1" CHECK="python3 -m pytest tests/gpu/test_vllm_lifecycle.py ..." \
#     setsid nohup bash scripts/gpu_trainer_session.sh /root/res > /root/res/session.out 2>&1 < /dev/null &
# -> RES/trl (gpu_trl_runs.sh), RES/verl (gpu_verl_runs.sh), RES/check.log, RES/SESSIONDONE.
set -uo pipefail
RES=${1:?usage: gpu_trainer_session.sh RES}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$RES"
T0=$(date +%s); log() { echo "[$(( $(date +%s) - T0 ))s] $*" >> "$RES/session.log"; }
pids=()
if [ -n "${TRL:-}" ]; then
  log "start TRL $TRL"
  STEPS=${TRL_STEPS:-100} bash scripts/gpu_trl_runs.sh "$RES/trl" $TRL & pids+=($!)
  first=$RES/trl/trl-${TRL%% *}.jsonl
  for _ in $(seq 1 ${TRL_START_WAIT:-400}); do [ -s "$first" ] || [ -e "$RES/trl/trl-${TRL%% *}.done" ] && break; sleep 1; done
  log "TRL engine up (or gave up waiting): $(ls -la "$first" 2>&1)"
fi
if [ -n "${VERL:-}" ]; then
  log "start verl $VERL"
  STEPS=${STEPS:-100} BATCH=${BATCH:-16} CHECK_EVERY=${CHECK_EVERY:-10} bash scripts/gpu_verl_runs.sh "$RES/verl" $VERL & pids+=($!)
fi
if [ -n "${CHECK:-}" ]; then
  log "start check"
  (source scripts/gpu_env.sh; export VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=2
   bash -c "$CHECK"; echo "exit $?") > "$RES/check.log" 2>&1 & pids+=($!)
fi
wait "${pids[@]}"
log "all done"
touch "$RES/SESSIONDONE"
