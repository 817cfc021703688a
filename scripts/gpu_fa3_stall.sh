#!/usr/bin/env bash
# Issue 42's open SGLang bug on one GPU (CUDA_VISIBLE_DEVICES picks it), after scripts/gpu_install.sh and
# gpu_install_sglang.sh with the FA3 library: the 7B async stream with fa3 + FP8 KV (int8), where the stream of
# 2026-11-26 stood still 127 s after its first update, rerun with SGLang's scheduler log (--log-level info: its
# decode-batch lines), the runtime's (the set-aside, the calibration, the release), the worker's whole output
# (FLASHRL_BENCH_LOG) and every engine process's Python stacks 10 s into a stall (--stall-dump 10).
#   bash scripts/gpu_fa3_stall.sh OUT   -> OUT/async_stream_sglang_fa3_diag.{json,log,engine.log}
# Bounded (timeout): a stall that never ends still leaves its logs.
set -uo pipefail
O=${1:?usage: gpu_fa3_stall.sh OUT}
cd "$(dirname "$0")/.." || exit 1
source scripts/gpu_env.sh
mkdir -p "$O" /root/w/stacks
PYTHONPATH="/tmp/site_sgl_tf:/tmp/site_sgl:$PYTHONPATH" FLASHRL_LOGGING_LEVEL=INFO \
  FLASHRL_BENCH_LOG="$O/async_stream_sglang_fa3_diag.engine.log" FLASHRL_DEBUG_STACKS=/root/w/stacks \
  timeout "${DIAG_TIMEOUT:-600}" python3 benchmarks/async_stream.py --engine sglang --preset gpu --configs int8+kv \
  --attention-backend fa3 --log-level info --stall-dump 10 --seconds 40 --every 10 --gpu-memory-utilization 0.45 \
  --workdir /root/w/diag --json "$O/async_stream_sglang_fa3_diag.json" > "$O/async_stream_sglang_fa3_diag.log" 2>&1
echo "exit $?" >> "$O/async_stream_sglang_fa3_diag.log"
