#!/usr/bin/env bash
# Issue 32's GPU work on one lent GPU, after scripts/gpu_install.sh (vLLM bundle, trainers' wheels) and
# scripts/gpu_install_sglang.sh (/tmp/site_sgl): the SGLang backend's checks, its rollout throughput with
# one sync's time, and verl's SGLang rollout path. Starts once WAIT_FOR exists (a trainer run beside it
# must finish first: vLLM's start-up profiling breaks when other processes free GPU memory).
#   WAIT_FOR=/root/res/SESSIONDONE setsid nohup bash scripts/gpu_sglang_session.sh /root/res/sgl \
#     > /root/res/sgl.out 2>&1 < /dev/null &
# -> RES/{check,throughput,verl}.{log,json}, RES/session.log, RES/SGLDONE. STEPS="check throughput verl",
# TP_SHAPES=7b,14b. Needs Ray (verl imports it) for `verl`: the r1/r2 parts of gpu_stage_trainers.sh.
set -uo pipefail
RES=${1:?usage: gpu_sglang_session.sh RES}
cd "$(dirname "$0")/.." || exit 1
source scripts/gpu_env.sh
export PYTHONPATH=/tmp/site_sgl:$PYTHONPATH PYTHONUNBUFFERED=1
# transformers 5.12.1 + tokenizers 0.22 as SGLang pins them (the host's 5.17 breaks `import sglang.srt`)
[ -d /tmp/site_sgl_tf ] && export PYTHONPATH=/tmp/site_sgl_tf:$PYTHONPATH
mkdir -p "$RES" /root/w
T0=$(date +%s); log() { echo "[$(( $(date +%s) - T0 ))s] $*" >> "$RES/session.log"; }
[ -n "${WAIT_FOR:-}" ] && { log "waiting for $WAIT_FOR"; while [ ! -e "$WAIT_FOR" ]; do sleep 2; done; }
for step in ${STEPS:-check throughput verl}; do
  log "start $step"
  case $step in
    check) python3 benchmarks/gpu_sglang_check.py --jobs "${JOBS:-3}" --workdir /root/w/sgl \
             --json "$RES/check.json" > "$RES/check.log" 2>&1 ;;
    throughput) python3 benchmarks/rollout_throughput.py --engine sglang --preset gpu --shapes "${TP_SHAPES:-7b,14b}" \
             --gpu-memory-utilization 0.85 --sync-bucket-mb 512 --workdir /root/w/tp \
             --json "$RES/throughput.json" > "$RES/throughput.log" 2>&1 ;;
    verl) python3 benchmarks/gpu_verl_sglang_check.py --workdir /root/w/sgl --json "$RES/verl.json" \
             > "$RES/verl.log" 2>&1 ;;
  esac
  log "end $step rc=$?"
done
log "all done"; touch "$RES/SGLDONE"
