#!/usr/bin/env bash
# Issue 42's open SGLang bug on one GPU (CUDA_VISIBLE_DEVICES picks it), after scripts/gpu_install.sh and
# gpu_install_sglang.sh with the FA3 library: the 7B async stream with fa3 + FP8 KV (int8), where the streams of
# 2026-11-26 stood still 127 s and 123 s after their first update. Kept: SGLang's scheduler log (--log-level info:
# its decode-batch lines), the runtime's (the set-aside, the calibration, the release), the worker's whole output
# (FLASHRL_BENCH_LOG), 10 s into a stall every engine process's Python stacks (SIGUSR1) and its threads' kernel
# states (/proc: D = waiting in a driver call), and the scheduler's own stacks after 30 s without a batch result
# (faulthandler's watchdog thread: the scheduler of 2026-11-26 printed nothing on SIGUSR1). Then the same stream
# with SGLang's overlap scheduler off (does the stall need it?).
#   bash scripts/gpu_fa3_stall.sh OUT   -> OUT/async_stream_sglang_fa3_diag{,_nooverlap}.{json,log,engine.log}
# Bounded (timeout): a stall that never ends still leaves its logs. VARIANTS picks: asis, nooverlap.
set -uo pipefail
O=${1:?usage: gpu_fa3_stall.sh OUT}
cd "$(dirname "$0")/.." || exit 1
source scripts/gpu_env.sh
mkdir -p "$O" /root/w/stacks
for v in ${VARIANTS-asis nooverlap}; do
  variant=; [ "$v" = nooverlap ] && variant=_nooverlap
  extra=(); [ -n "$variant" ] && extra=(--no-overlap)
  PYTHONPATH="/tmp/site_sgl_tf:/tmp/site_sgl:$PYTHONPATH" FLASHRL_LOGGING_LEVEL=INFO \
    FLASHRL_BENCH_LOG="$O/async_stream_sglang_fa3_diag$variant.engine.log" FLASHRL_DEBUG_STACKS="$O/stacks" \
    timeout "${DIAG_TIMEOUT:-420}" python3 benchmarks/async_stream.py --engine sglang --preset gpu --configs int8+kv \
    --attention-backend fa3 --log-level info --stall-dump 10 --seconds 40 --every 10 --gpu-memory-utilization 0.45 \
    "${extra[@]}" --workdir /root/w/diag --json "$O/async_stream_sglang_fa3_diag$variant.json" \
    > "$O/async_stream_sglang_fa3_diag$variant.log" 2>&1
  echo "exit $?" >> "$O/async_stream_sglang_fa3_diag$variant.log"
done
