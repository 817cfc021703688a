#!/usr/bin/env bash
# One four-GPU host, two jobs side by side, after scripts/gpu_install.sh and gpu_install_sglang.sh:
#   GPUs 0-1  scripts/gpu_job_async.sh (issues 42 / 43: SGLang fa3 / distributed in-flight cases, verl's
#             fully-async trainer with partial rollouts, the fa3 stream, wire_sync over IPC, TP = 2 wire tests)
#   GPU 2, 3  issue 44's verl GRPO arms on one task LEVEL each (scripts/gpu_verl_runs.sh, HELDOUT=1: held-out
#             accuracy from a BF16 engine every CHECK_EVERY steps); ARMS and LEVELS below, STEPS steps
#   setsid nohup bash scripts/gpu_job_x4.sh /root/res > /root/res/job.out 2>&1 < /dev/null &
# -> RES/async/ (gpu_job_async.sh), RES/arms-LEVEL/; RES/SESSIONDONE when all finished. Runs already done
# (RES/arms-LEVEL/RUN.done) are skipped: the same command resumes.
set -uo pipefail
RES=${1:?usage: gpu_job_x4.sh RES}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$RES/async"
ARMS=${ARMS:-bf16:0 bf16:1 bf16:2 int8:0 int8:1 int8:2}
read -r -a LEVEL_LIST <<< "${LEVELS:-add2c mul21}"
(CUDA_VISIBLE_DEVICES=0,1 bash scripts/gpu_job_async.sh "$RES/async" > "$RES/async/job.out" 2>&1) &
pids=($!)
gpu=2
for level in "${LEVEL_LIST[@]}"; do
  mkdir -p "$RES/arms-$level"
  # shellcheck disable=SC2086
  (CUDA_VISIBLE_DEVICES=$gpu LEVEL=$level STEPS=${STEPS:-80} HELDOUT=1 CHECK_EVERY=10 STAGGER=15 \
     bash scripts/gpu_verl_runs.sh "$RES/arms-$level" $ARMS > "$RES/arms-$level/runs.out" 2>&1) &
  pids+=($!)
  gpu=$((gpu + 1))
done
wait "${pids[@]}"
touch "$RES/SESSIONDONE"
