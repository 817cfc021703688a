#!/usr/bin/env bash
# One four-GPU host, after scripts/gpu_install.sh (and gpu_install_sglang.sh when JOB01 needs SGLang):
#   JOB01 on GPUs JOB01_GPUS (default 0,1; default job scripts/gpu_job_async.sh: issues 42 / 43's GPU leftovers);
#             JOB01="" skips it
#   issue 44's verl GRPO arms on ARM_GPUS (default 2 3; "0 1 2 3" with JOB01=""), task LEVEL (default mul21),
#             ARMS (CONFIG[+kv][-notis|-mis]:SEED) dealt round-robin to those GPUs (scripts/gpu_verl_runs.sh,
#             HELDOUT=1: held-out accuracy from a BF16 engine every CHECK_EVERY steps, STEPS steps)
#   setsid nohup bash scripts/gpu_job_x4.sh /root/res > /root/res/job.out 2>&1 < /dev/null &
#   JOB01="" ARM_GPUS="0 1 2 3" setsid nohup bash scripts/gpu_job_x4.sh /root/res ...   # issue 44 alone: all 21 runs
# -> RES/j01/ (JOB01's results), RES/arms-LEVEL/; RES/SESSIONDONE when all finished. Runs already done
# (RES/arms-LEVEL/RUN.done) are skipped: the same command resumes. ARMS="" or JOB01="" leaves those GPUs idle.
set -uo pipefail
RES=${1:?usage: gpu_job_x4.sh RES}
cd "$(dirname "$0")/.." || exit 1
JOB01=${JOB01-scripts/gpu_job_async.sh}
LEVEL=${LEVEL:-mul21}
# issue 44's arms (3 seeds each): bf16 and int8 with and without TIS, fp8 and int8 + FP8 KV with TIS, int8 with
# token masking (MIS). 60 steps (the BF16 pilot's held-out accuracy: 0.19 -> 0.44-0.48 at step 60, level from
# there): six runs share a GPU at 12-15 s per step, so the 21 runs on four GPUs fit one device session with room
# for slower steps (100 steps did not fit)
ARMS=${ARMS-bf16:0 bf16-notis:0 int8:0 int8-notis:0 fp8:0 int8+kv:0 int8-mis:0 \
bf16:1 bf16-notis:1 int8:1 int8-notis:1 fp8:1 int8+kv:1 int8-mis:1 \
bf16:2 bf16-notis:2 int8:2 int8-notis:2 fp8:2 int8+kv:2 int8-mis:2}
# runs whose trimmed logs with their final check are committed (benchmarks/trim_logs.py) are not run again: the
# same command completes the set across device sessions (LOGGED="" runs them all)
LOGGED=${LOGGED-benchmarks/results/verl_arms_${LEVEL}_h200}
if [ -n "$LOGGED" ] && [ -d "$LOGGED" ]; then
  keep=(); for a in $ARMS; do grep -q '"final_check"' "$LOGGED/verl-${a%%:*}-s${a##*:}.jsonl" 2>/dev/null || keep+=("$a"); done
  ARMS="${keep[*]}"; echo "arms not yet logged in $LOGGED: ${ARMS:-none}"
fi
read -r -a gpus <<< "${ARM_GPUS:-2 3}"
pids=()
if [ -n "$JOB01" ]; then
  mkdir -p "$RES/j01"
  (CUDA_VISIBLE_DEVICES=${JOB01_GPUS:-0,1} bash "$JOB01" "$RES/j01" > "$RES/j01/job.out" 2>&1) &
  pids+=($!)
fi
read -r -a arms <<< "$ARMS"
if [ ${#arms[@]} -gt 0 ]; then
  mkdir -p "$RES/arms-$LEVEL"
  for g in "${!gpus[@]}"; do
    gpu=${gpus[$g]}
    mine=(); for i in "${!arms[@]}"; do [ $(( i % ${#gpus[@]} )) = "$g" ] && mine+=("${arms[$i]}"); done
    [ ${#mine[@]} -gt 0 ] || continue
    (CUDA_VISIBLE_DEVICES=$gpu LEVEL=$LEVEL STEPS=${STEPS:-60} HELDOUT=1 CHECK_EVERY=10 STAGGER=15 \
       bash scripts/gpu_verl_runs.sh "$RES/arms-$LEVEL" "${mine[@]}" > "$RES/arms-$LEVEL/runs-gpu$gpu.out" 2>&1) &
    pids+=($!)
    sleep 5  # the data set is written once (the others see it)
  done
fi
wait "${pids[@]}"
touch "$RES/SESSIONDONE"
