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
  # passed on the H100 at stop 27: a calibrated kv_cache_scheme checkpoint, the CPU test itself
  # (pytest carried to /root/pyt)
  # "kv-ckpt|FLASHRL_ENGINE_ARGS='$EA' PYTHONPATH=\$PYTHONPATH:/root/pyt python -m pytest -q -rA -p no:cacheprovider tests/test_kv_cache.py -k checkpoint_kv_scales"
)
L="--fixed-len --stats --first-max-len 256 --workdir /root/w/s"  # issue 15's workload (PLAN=long15)
BENCH=(  # name|command (phase 2, alone on the GPU, in order; ratios only within one session)
  # done at stop 27: 32B bf16 / int8 / int8+kv (results/rl_step_32b_int8.json), PLAN=long15 below.
  # next: issue 15's workload at 7B with INT8 weights alone (the row it lacks), BF16 again beside it
  "long-7b-bf16|python $S --shapes 7b --configs bf16 --prompts 26 --samples 8 $L --json $RES/long-7b-bf16.json"
  "long-7b-int8|python $S --shapes 7b --configs int8 --prompts 26 --samples 8 $L --json $RES/long-7b-int8.json"
)
if [ "${PLAN:-}" = long15 ]; then  # (ran at stop 27) issue 15's workload: 1k prompts, every output 8,192 tokens,
  # 2x the full-length sequences BF16's KV cache holds (7B: 102 -> 208; 14B: 22 -> 48), in order of the goals
  BENCH=(
    "long-14b-bf16|python $S --shapes 14b --configs bf16 --prompts 6 --samples 8 $L --json $RES/long-14b-bf16.json"
    "long-14b-int8kv|python $S --shapes 14b --configs int8+kv --prompts 6 --samples 8 $L --json $RES/long-14b-int8kv.json"
    "long-7b-bf16|python $S --shapes 7b --configs bf16 --prompts 26 --samples 8 $L --json $RES/long-7b-bf16.json"
    "long-7b-int8kv|python $S --shapes 7b --configs int8+kv --prompts 26 --samples 8 $L --json $RES/long-7b-int8kv.json"
  )
fi
if [ "${PLAN:-}" = tp2 ]; then  # a two-GPU machine (nvidia-h200-x2): tensor / expert parallel checks
  T2='{"gpu_memory_utilization": 0.1, "kv_cache_memory_bytes": 1073741824}'
  T2D='{"gpu_memory_utilization": 0.1, "kv_cache_memory_bytes": 1073741824, "tensor_parallel_size": 2}'
  MP="VLLM_ENABLE_V1_MULTIPROCESSING=1"
  CHECKS=(
    # done on 2x H200 at stop 26: dense int8/fp8 =tp eager, MoE int8 =tp, MoE fp8 TP and TP+EP (reload)
    "moe-tp2-ip-fp8|$MP FLASHRL_INPLACE_SYNC=tp python $M --archs qwen3_moe --configs fp8 --tp 2 --no-bound --no-dense --engine-args '$T2' --workdir /root/w/t2 --json $RES/moe-tp2-ip-fp8.json"
    "dense-tp2-ip-c|$MP FLASHRL_INPLACE_SYNC=tp python $G --skip-7b --reload --compiled --correctness-configs int8,fp8 --engine-args '$T2D' --workdir /root/w/t1 --json $RES/dense-tp2-ip-c.json"
  )
  BENCH=()
fi
if [ "${PLAN:-}" = lifecycle ]; then  # issue 29 (ran at stop 28): sleep mode, bucketed pushes, verl's own sync.
  # --verl needs scripts/gpu_stage_trainers.sh's wheels (+ Ray) installed by scripts/gpu_install.sh.
  # 16 cases x 2 compiled engines: ~10 min with --jobs 16 on an H100. Left at stop 28: verl's code for int8.
  CHECKS=(
    "lifecycle-verl-int8|python benchmarks/gpu_lifecycle_check.py --verl --cases dense-int8,moe-int8 --kv off --jobs 2 --workdir /root/w/lv --json $RES/lifecycle-verl-int8.json"
  )
  BENCH=()
fi
if [ "${PLAN:-}" = recheck ]; then  # issues 29 + 31: the exactness checks again after the runtime's restructuring
  # (one H100; --verl and sq-int8 need the trainers' wheels, Ray, the default model and /root/sq)
  CHECKS=(
    "lifecycle|python benchmarks/gpu_lifecycle_check.py --verl --jobs 12 --workdir /root/w/lc --json $RES/lifecycle.json"
    "lifecycle-sq|python benchmarks/gpu_lifecycle_check.py --verl --cases sq-int8 --kv off --sq /root/sq --jobs 1 --workdir /root/w/sq --json $RES/lifecycle-sq.json"
    "runtime-c|python $G --skip-7b --reload --compiled --engine-args '$EA' --workdir /root/w/rc --json $RES/runtime-compiled.json"
    "moe-c|python $M --archs qwen3_moe --configs int8,fp8 --compiled --no-bound --no-dense --engine-args '$EA' --workdir /root/w/mc --json $RES/moe-compiled.json"
  )
  BENCH=()
fi
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
