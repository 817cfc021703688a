#!/usr/bin/env bash
# The one GPU job runner (scripts/GPU.md): runs the job files scripts/jobs/JOB.job one after another (a NAME.queue
# there lists job names, one a line), after the staging their NEEDS name. A job file is bash variables:
#   NEEDS="vllm sglang trainers ray model xqa sq"  what must be staged (checked here; NO_CHECK=1 skips the check)
#   GPUS=N                                     GPUs it uses (the host must have them)
#   TESTS="name:jobs:engine:node ids" lines    scripts/gpu_tests.sh's TEST_GROUPS (`default`: its own groups)
#   ROWS="GPU:ENGINE:SHAPE[:CONFIGS[:SHARE[:ENV]]]" lines, ROW_ARGS="..."   scripts/gpu_rows.sh's QUEUES and ARGS
#                                              (GPU "0,1": a tensor-parallel row's GPUs, a lane of their own)
#   RUN="shell command"                        run by bash from the repository root, gpu_env.sh sourced, JOBDIR set
#   TESTS_GPU / RUN_GPU=N                      the GPU those parts run on (unset: every GPU, a lane of their own,
#                                              beside the rows: a one-GPU job with ROWS names the rows' GPU)
#   ENV="A=1 B=2"                              set for the whole job (FLASHRL_DECODE_* / _FUSED_KV_STORE start unset)
# ROWS_MATCH=TEXT in the runner's environment keeps only the ROWS lines that contain TEXT (one row of a job rerun).
# A job's parts on one GPU run in the order TESTS, RUN, ROWS; different GPUs side by side. Per job RES/JOB/ (the
# tests' gpu/*.json and GROUP.log, run.log, goal/*.{json,log}); RES/session.log; RES/SESSIONDONE at the end:
#   setsid nohup bash scripts/gpu_job.sh /root/res JOB [JOB ...] > /root/job.out 2>&1 < /dev/null &
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
J=scripts/jobs
names() { ls "$J" | sed 's/\.[a-z]*$//' | sort -u | paste -sd' '; }
[ $# -ge 2 ] || { echo "usage: gpu_job.sh RES JOB|QUEUE [...] (scripts/jobs: $(names))" >&2; exit 2; }
RES=$(realpath -m "$1"); shift
unknown() { echo "gpu_job.sh: unknown job '$1' (scripts/jobs: $(names))" >&2; exit 2; }
jobs=()
for a in "$@"; do
  [[ $a =~ ^[A-Za-z0-9_-]+$ ]] || unknown "$a"
  if [ -f "$J/$a.job" ]; then jobs+=("$a")
  elif [ -f "$J/$a.queue" ]; then
    while read -r n _; do [ -z "$n" ] || [ "${n:0:1}" = "#" ] || jobs+=("$n"); done < "$J/$a.queue"
  else unknown "$a"; fi
done
[ ${#jobs[@]} -gt 0 ] || unknown "$*"
for n in "${jobs[@]}"; do [[ $n =~ ^[A-Za-z0-9_-]+$ ]] && [ -f "$J/$n.job" ] || unknown "$n"; done
check() {  # check JOB: its GPUs present and its NEEDS staged, or one line saying what is missing
  ( source "$J/$1.job"; n=$(nvidia-smi -L 2>/dev/null | wc -l)
    [ "$n" -ge "${GPUS:-1}" ] || { echo "gpu_job.sh: $1 needs $GPUS GPUs, this host has $n"; exit 1; }
    for x in ${NEEDS:-}; do
      case $x in vllm) p=/tmp/site/vllm ;; sglang) p=/tmp/site_sgl/sgl_kernel/flash_ops.abi3.so ;; sq) p=/root/sq ;;
        trainers) p=/tmp/site/verl ;; ray) p=/tmp/site/ray ;; model) p=/root/gguf ;; xqa) p=$(compgen -G "/tmp/site/flashinfer/data/aot/xqa_*" | head -n 1) ;;
        *) echo "gpu_job.sh: $1 names an unknown NEED '$x'"; exit 1 ;; esac
      [ -n "$p" ] && [ -e "$p" ] || { echo "gpu_job.sh: $1 needs $x staged (scripts/GPU.md; ${p:-its files} missing)"; exit 1; }
    done ) >&2
}
if [ -z "${NO_CHECK:-}" ]; then for n in "${jobs[@]}"; do check "$n" || exit 2; done; fi
# Each device `run` call copies the working tree again, under a running job too (a module briefly missing failed a
# probe's start): the job runs from a copy of its own.
SNAP=/root/job-tree-$$; rm -rf "$SNAP"; mkdir -p "$SNAP"
tar --exclude=./.stage --exclude=./.git --exclude=./.venv --exclude=./.whl --exclude=./.gl -cf - . | tar -C "$SNAP" -xf - || exit 1
cd "$SNAP" || exit 1
source scripts/gpu_env.sh
export PYTHONUNBUFFERED=1
mkdir -p "$RES" /root/w && rm -f "$RES/SESSIONDONE"
T0=$(date +%s); log() { echo "[$(( $(date +%s) - T0 ))s] $*" >> "$RES/session.log"; }
lane() {  # lane GPU|all: the job's parts on that GPU, one after another
  local g=$1
  [ "$g" = all ] || export CUDA_VISIBLE_DEVICES=$g
  if [ -n "$TESTS" ] && [ "${TESTS_GPU:-all}" = "$g" ]; then
    log "$JOB: tests on GPU $g"
    TEST_GROUPS=${TESTS#default} GPU_WORK=/root/w/$JOB-tests bash scripts/gpu_tests.sh "$JOBDIR"
  fi
  if [ -n "$RUN" ] && [ "${RUN_GPU:-all}" = "$g" ]; then
    log "$JOB: run on GPU $g"
    bash -c "$RUN" > "$JOBDIR/run.log" 2>&1; echo "exit $?" >> "$JOBDIR/run.log"
  fi
  if [ "$g" != all ] && grep -q "^$g:" <<< "$ROWS"; then
    log "$JOB: rows on GPU $g${ROWS_MATCH:+ matching $ROWS_MATCH}"
    QUEUES=$(grep "^$g:" <<< "$ROWS") ARGS=$ROW_ARGS bash scripts/gpu_rows.sh "$JOBDIR"
  fi
  log "$JOB: GPU $g done"
}
for JOB in "${jobs[@]}"; do
  (unset FLASHRL_DECODE_ATTN FLASHRL_DECODE_GEMM FLASHRL_FUSED_KV_STORE
   TESTS= TESTS_GPU= RUN= RUN_GPU= ROWS= ROW_ARGS= ENV=
   source "$J/$JOB.job"
   [ -n "${ROWS_MATCH:-}" ] && ROWS=$(grep -F -e "$ROWS_MATCH" <<< "$ROWS")
   export JOB JOBDIR=$RES/$JOB
   # shellcheck disable=SC2086  # ENV: assignments
   [ -n "$ENV" ] && export $ENV
   mkdir -p "$JOBDIR"
   log "start $JOB"
   lanes=$({ [ -n "$TESTS" ] && echo "${TESTS_GPU:-all}"; [ -n "$RUN" ] && echo "${RUN_GPU:-all}"
             grep -o '^[0-9][0-9,]*' <<< "$ROWS"; } | sort -u)  # a ROWS line on "0,1": a lane of both GPUs
   for g in $lanes; do lane "$g" & done
   wait
   log "end $JOB") || log "$JOB stopped: exit $?"
done
log "all done"; touch "$RES/SESSIONDONE"
