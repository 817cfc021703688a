#!/usr/bin/env bash
# Issue 32's GPU work on one lent GPU, after scripts/gpu_install.sh (vLLM bundle, trainers' wheels) and
# scripts/gpu_install_sglang.sh (/tmp/site_sgl): the SGLang backend's checks, its rollout throughput with
# one sync's time, and verl's SGLang rollout path. Starts once WAIT_FOR exists (a trainer run beside it
# must finish first: vLLM's start-up profiling breaks when other processes free GPU memory).
#   WAIT_FOR=/root/res/SESSIONDONE setsid nohup bash scripts/gpu_sglang_session.sh /root/res/sgl \
#     > /root/res/sgl.out 2>&1 < /dev/null &
# -> RES/{check,throughput,verl,kv,dist,cli*}.{log,json}, RES/session.log, RES/SGLDONE. STEPS="check throughput
# verl" (also: kv = the FP8 KV cases, dist = update_weights_from_distributed, cli = `flashrl verify --engine
# sglang`), TP_SHAPES=7b,14b, VERL_CONFIGS, KV_CASES, DIST_CONFIGS. Needs Ray (verl imports it) for `verl`: the r1/r2 parts of gpu_stage_trainers.sh.
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
    verl) python3 benchmarks/gpu_verl_sglang_check.py --workdir /root/w/sgl --configs "${VERL_CONFIGS:-int8,fp8}" \
             --json "$RES/verl.json" > "$RES/verl.log" 2>&1 ;;
    kv) python3 benchmarks/gpu_sglang_check.py --jobs "${JOBS:-3}" --workdir /root/w/sgl --json "$RES/kv.json" \
             --cases "${KV_CASES:-dense-int8,moe-fp8,dense-bf16+kv,dense-int8+kv,dense-fp8+kv,moe-fp8+kv}" \
             > "$RES/kv.log" 2>&1 ;;
    dist) python3 benchmarks/gpu_sglang_distributed_check.py --workdir /root/w/sgl --configs "${DIST_CONFIGS:-int8,fp8,int8+kv}" \
             --json "$RES/dist.json" > "$RES/dist.log" 2>&1 ;;
    cli) # the CLI itself on the checks' tiny dense model (made by the kv / check step, or here)
         [ -f /root/w/sgl/dense/config.json ] || python3 -c "import sys; sys.path.insert(0, 'benchmarks'); \
           import gpu_sglang_check as g; from pathlib import Path; g.make_models(Path('/root/w/sgl'), {'dense'})"
         export FLASHRL_ENGINE_ARGS='{"max_total_tokens": 8192, "cuda_graph_max_bs_decode": 8}'  # engines side by side
         { python3 -m flashrl_tools verify reload --engine sglang -c int8 -m /root/w/sgl/dense --json "$RES/cli_reload_int8.json"
           FLASHRL_KV_CACHE_DTYPE=fp8 python3 -m flashrl_tools verify reload --engine sglang -c fp8 -m /root/w/sgl/dense \
             --json "$RES/cli_reload_fp8_kv.json"
           python3 -m flashrl_tools verify drift --engine sglang -c int8 -m /root/w/sgl/dense --json "$RES/cli_drift_int8.json"
         } > "$RES/cli.log" 2>&1 ;;
  esac
  log "end $step rc=$?"
done
log "all done"; touch "$RES/SGLDONE"
