#!/usr/bin/env bash
# One four-GPU host, two jobs side by side, after scripts/gpu_install.sh and gpu_install_sglang.sh:
#   GPUs 0-1  JOB01 (default scripts/gpu_job_async.sh: issues 42 / 43's GPU leftovers)
#   GPUs 2-3  issue 44's verl GRPO arms on one task LEVEL (default mul21), ARMS (CONFIG[+kv][-notis|-mis]:SEED)
#             dealt alternately to GPU 2 and GPU 3 (scripts/gpu_verl_runs.sh, HELDOUT=1: held-out accuracy from
#             a BF16 engine every CHECK_EVERY steps, STEPS steps)
#   setsid nohup bash scripts/gpu_job_x4.sh /root/res > /root/res/job.out 2>&1 < /dev/null &
# -> RES/j01/ (JOB01's results), RES/arms-LEVEL/; RES/SESSIONDONE when all finished. Runs already done
# (RES/arms-LEVEL/RUN.done) are skipped: the same command resumes. ARMS="" or JOB01="" leaves those GPUs idle.
set -uo pipefail
RES=${1:?usage: gpu_job_x4.sh RES}
cd "$(dirname "$0")/.." || exit 1
JOB01=${JOB01-scripts/gpu_job_async.sh}
LEVEL=${LEVEL:-mul21}
# issue 44's arms (3 seeds each): bf16 and int8 with and without TIS, fp8 and int8 + FP8 KV with TIS, int8 with
# token masking (MIS); a device session fits about 12 runs of 100 steps: run them in two sessions (resumable)
ARMS=${ARMS-bf16:0 bf16-notis:0 int8:0 int8-notis:0 bf16:1 bf16-notis:1 int8:1 int8-notis:1 bf16:2 bf16-notis:2 int8:2 int8-notis:2}
pids=()
if [ -n "$JOB01" ]; then
  mkdir -p "$RES/j01"
  (CUDA_VISIBLE_DEVICES=0,1 bash "$JOB01" "$RES/j01" > "$RES/j01/job.out" 2>&1) &
  pids+=($!)
fi
read -r -a arms <<< "$ARMS"
if [ ${#arms[@]} -gt 0 ]; then
  mkdir -p "$RES/arms-$LEVEL"
  for gpu in 2 3; do
    mine=(); for i in "${!arms[@]}"; do [ $(( i % 2 )) = $(( gpu - 2 )) ] && mine+=("${arms[$i]}"); done
    [ ${#mine[@]} -gt 0 ] || continue
    (CUDA_VISIBLE_DEVICES=$gpu LEVEL=$LEVEL STEPS=${STEPS:-100} HELDOUT=1 CHECK_EVERY=10 STAGGER=15 \
       bash scripts/gpu_verl_runs.sh "$RES/arms-$LEVEL" "${mine[@]}" > "$RES/arms-$LEVEL/runs-gpu$gpu.out" 2>&1) &
    pids+=($!)
    sleep 5  # the data set is written once (the second sees it)
  done
fi
wait "${pids[@]}"
touch "$RES/SESSIONDONE"
