#!/usr/bin/env bash
# Issue 30's TRL runs on the lent GPU (after scripts/gpu_install.sh): examples/trl_grpo.py with sleep
# mode and the final engine-vs-fresh check, one per CONFIG, one after the other (vLLM's start-up
# memory profiling fails when another process frees GPU memory meanwhile -- a TRL run beside it
# sleeps and wakes every step -- and TRL cannot pass a fixed KV size; ~3.6 s/step on an H100).
# TRL lives in /tmp/site_trl (verl 0.9.1 breaks when TRL 1.16 is importable).
#   STEPS=100 setsid nohup bash scripts/gpu_trl_runs.sh /root/res/trl bf16 int8 &
set -uo pipefail
OUT=${1:?usage: gpu_trl_runs.sh OUT CONFIG ...}; shift
cd "$(dirname "$0")/.." || exit 1
source scripts/gpu_env.sh
export PYTHONPATH=/tmp/site_trl:$PYTHONPATH PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
mkdir -p "$OUT"
for cfg in "$@"; do
  for try in 1 2 3 4; do  # beside other engines: retry a start that died in vLLM's memory profiling
    FLASHRL_CONFIG=$cfg VLLM_CACHE_ROOT=/root/vc/trl-$cfg python3 examples/trl_grpo.py --steps "${STEPS:-100}" \
      --batch "${TRL_BATCH:-64}" --sleep-mode --final-check --log "$OUT/trl-$cfg.jsonl" --out "$OUT/out-$cfg" \
      > "$OUT/trl-$cfg.log" 2>&1
    rc=$?; echo "exit $rc (try $try)" >> "$OUT/trl-$cfg.log"
    [ "$rc" != 0 ] && [ ! -s "$OUT/trl-$cfg.jsonl" ] && grep -q "memory profiling" "$OUT/trl-$cfg.log" || break
    mv "$OUT/trl-$cfg.log" "$OUT/trl-$cfg.try$try.log"; sleep $(( RANDOM % 10 + 2 ))
  done
  touch "$OUT/trl-$cfg.done"
done
