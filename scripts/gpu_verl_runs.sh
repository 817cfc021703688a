#!/usr/bin/env bash
# Issue 30's verl runs on one lent GPU, side by side (DEVELOPERS.md "GPU (device tool)"): every RUN
# (CONFIG:SEED) is examples/verl/run_grpo_smollm2.sh with FINAL_CHECK=1 in its own Ray cluster and
# its own /tmp (scripts/private_tmp.sh: verl's sync socket path is the same for every cluster),
# then examples/verl/final_check.py with the same FLASHRL_CONFIG. Started under setsid after
# scripts/gpu_install.sh:
#   STEPS=100 setsid nohup bash scripts/gpu_verl_runs.sh /root/res/verl bf16:0 int8:0 fp8:0 moe-int8:0 ... &
# (moe-CONFIG:SEED: issue 30's MoE run, `flashrl models tiny --arch qwen3_moe`, MOE_STEPS=20 steps;
# CONFIG+kv: with FLASHRL_KV_CACHE_DTYPE=fp8; CONFIG-notis / CONFIG-mis: the recipe's TIS=off / mis, issue 44's
# arms; CONFIG names OUT/CONFIG.yaml where that file exists). LEVEL=add2c|mul21|...: the task level (default
# add1). HELDOUT=1: every CHECK_EVERY steps a checkpoint kept, evaluated while the runs go on by one BF16 engine
# (examples/verl/heldout_eval.py --watch: OUT/RUN.heldout.jsonl, read by benchmarks/rl_curves.py) and removed but the latest. A run whose OUT/RUN.done exists is skipped: the
# same command resumes a set of runs cut short. RECIPE=async: examples/verl/run_fully_async_smollm2.sh
# instead (two GPUs: rollouter and trainer; runs async-CONFIG-sSEED, final check of the last sync).
# Per run: OUT/verl-CONFIG-sSEED.jsonl (verl's file logger + the final check), OUT/RUN.log, and
# OUT/RUN.done when both finished. Many runs share the GPU: each vLLM engine gets a fixed 1 GiB KV
# cache (kv_cache_memory_bytes skips vLLM's memory profiling, which other processes trip) and
# verl's helper-process pools are cut to what one small model needs.
set -uo pipefail
OUT=${1:?usage: gpu_verl_runs.sh OUT CONFIG:SEED ...}; shift
cd "$(dirname "$0")/.." || exit 1
source scripts/gpu_env.sh
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=2
# every process would start a BLAS / OpenMP pool as wide as the host: a dozen verl runs side by side ran out of
# threads on a 64-core host (2026-11-26: "pthread_create failed: Resource temporarily unavailable", runs lost)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
# 21 runs at once still did (2026-11-26, 4 x H200: "can't start new thread" in verl's agent-loop workers, the
# tokenizers' Rust pool among the stacks; 12 of 21 runs lost at their start): the tokenizers' pool cut too, and a
# run that dies of it before its first checkpoint is started again
export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false
unset VLLM_ENABLE_V1_MULTIPROCESSING   # verl runs vLLM's engine core as its own process
mkdir -p "$OUT"
MODEL=$(python3 -c "from flashrl_tools.models.default import ensure_default_model as e; print(e())"); export MODEL
LEVEL=${LEVEL:-add1}; export LEVEL
DATA=$OUT/data; [ "$LEVEL" = add1 ] || DATA=$OUT/data-$LEVEL
[ -f "$DATA/train.parquet" ] || python3 examples/verl/arith_data.py "$DATA" --train $(( ${STEPS:-100} * ${BATCH:-32} )) \
  --seed 0 --level "$LEVEL" >/dev/null
RECIPE_SH=examples/verl/run_grpo_smollm2.sh PREFIX=verl CHECK_ARGS=()
[ "${RECIPE:-grpo}" = async ] && RECIPE_SH=examples/verl/run_fully_async_smollm2.sh PREFIX=async CHECK_ARGS=(--last-sync)
if [ "${HELDOUT:-0}" = 1 ]; then  # one BF16 engine evaluates every run's checkpoints as they come (sidecar logs)
  runs=(); for spec in "$@"; do [ -f "$OUT/$PREFIX-${spec%%:*}-s${spec##*:}.done" ] || runs+=("$PREFIX-${spec%%:*}-s${spec##*:}"); done
  [ ${#runs[@]} -gt 0 ] && VLLM_CACHE_ROOT=/root/vc/heldout-$$ python3 examples/verl/heldout_eval.py "$OUT" "${runs[@]}" \
    --data "$DATA" --model "$MODEL" --watch --delete > "$OUT/heldout-$$.log" 2>&1 &
fi
for spec in "$@"; do
  cfg=${spec%%:*} seed=${spec##*:} run=$PREFIX-${spec%%:*}-s${spec##*:} model=$MODEL steps=${STEPS:-100} plen=64 kv= tis=token
  [ -f "$OUT/$run.done" ] && { echo "$run: done before, skipped"; continue; }
  case $cfg in *-notis) cfg=${cfg%-notis} tis=off ;; *-mis) cfg=${cfg%-mis} tis=mis ;; esac
  [ "${cfg%+kv}" != "$cfg" ] && cfg=${cfg%+kv} kv=fp8
  [ -f "$OUT/$cfg.yaml" ] && cfg=$(realpath "$OUT/$cfg.yaml")  # an arm's own config: OUT/CONFIG.yaml
  if [ "${cfg#moe-}" != "$cfg" ]; then  # moe-CONFIG:SEED: the tiny random Qwen3-MoE (byte tokenizer), MOE_STEPS
    cfg=${cfg#moe-} steps=${MOE_STEPS:-20} plen=256
    model=$OUT/tiny-qwen3-moe
    [ -f "$model/config.json" ] || python3 -m flashrl_tools models tiny --arch qwen3_moe -o "$model" >/dev/null
  fi
  (
    for try in 1 2 3; do  # verl picks torch.distributed's port at random: runs side by side may collide
    FLASHRL_CONFIG=$cfg FLASHRL_KV_CACHE_DTYPE=$kv SEED=$seed OUT=$OUT FINAL_CHECK=1 VLLM_CACHE_ROOT=/root/vc/$run TIS=$tis \
      RUN=$run MODEL=$model STEPS=$steps PROMPT_LEN=$plen CHECK_EVERY=${CHECK_EVERY:-10} \
      bash scripts/private_tmp.sh "/root/tmp/$run" bash "$RECIPE_SH" \
      +ray_kwargs.ray_init._temp_dir=/tmp/ray_$run +ray_kwargs.ray_init.include_dashboard=False \
      +ray_kwargs.ray_init.object_store_memory=2000000000 \
      actor_rollout_ref.rollout.gpu_memory_utilization=${GPU_UTIL:-0.08} \
      +actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes=1073741824 \
      actor_rollout_ref.rollout.agent.num_workers=2 reward.num_workers=2 data.dataloader_num_workers=0 \
      transfer_queue.backend.SimpleStorage.num_data_storage_units=1 \
      ${VERL_EXTRA:-} > "$OUT/$run.log" 2>&1
    rc=$?; echo "train exit $rc (try $try)" >> "$OUT/$run.log"
    [ "$rc" = 0 ] && break
    grep -qE "EADDRINUSE|can't start new thread|pthread_create failed|Resource temporarily unavailable" \
      "$OUT/$run.log" || break
    ls -d "$OUT/ckpt-$run"/global_step_* >/dev/null 2>&1 && break  # past its first checkpoint: not afresh
    mv "$OUT/$run.log" "$OUT/$run.try$try.log"; [ -f "$OUT/$run.jsonl" ] && mv "$OUT/$run.jsonl" "$OUT/$run.try$try.jsonl"
    sleep $(( RANDOM % 20 + 5 ))
    done
    if [ "$rc" = 0 ]; then  # RUN.done only for a run that finished (a failed one is run again by the same command)
      FLASHRL_CONFIG=$cfg FLASHRL_KV_CACHE_DTYPE=$kv VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CACHE_ROOT=/root/vc/$run-fresh \
        python3 examples/verl/final_check.py "$OUT" "$run" --data "$DATA" "${CHECK_ARGS[@]}" > "$OUT/$run.check.log" 2>&1
      echo "check exit $?" >> "$OUT/$run.log"
      touch "$OUT/$run.done"
    else
      touch "$OUT/$run.failed"
    fi
  ) &
  sleep "${STAGGER:-20}"   # start-ups one after another (compile, memory checks)
done
wait
touch "$OUT/ALLDONE"
