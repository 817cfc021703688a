#!/usr/bin/env bash
# Issue 42's SGLang leftovers on one GPU (CUDA_VISIBLE_DEVICES: its first), after scripts/gpu_install.sh and
# gpu_install_sglang.sh with the FA3 library; as gpu_job_x4.sh's JOB01 or gpu_job_speed.sh's GPU 0:
#   1. the 7B async stream, int8 and int8 + FP8 KV in one run, with fa3 (SGLang's default on Hopper: the scales
#      are read from tensors, no graph capture): the first token after the continue (bound: 1.5x int8's), the
#      continue's cost (the calibration's log line: drain, flushes, prefills, finish); triton last (3.)
#   2. the in-place FP8 KV GPU tests after the release change (triton and fa3; retract passed on 2026-11-26), with
#      the kept tokens' bound: in_place-int8's stale-KV effect + the FP8 cache's own effect
#   3. test_sglang.py's FP8 KV cases (sync = fresh engine, scales bit-equal: the batched calibration)
#   4. the same stream with triton
# Every stream runs with the stall logs (the engine's log, every engine process's stacks 10 s into a stall and
# /proc task states, the scheduler's own stacks after 30 s without a batch result) and an empty FlashInfer JIT
# cache: the stalls of 2026-11-26 (94-127 s, the first FP8 KV update on each fresh host) were FlashInfer building
# its top-k / top-p sampler for the decode batch that held the greedy calibration request beside the T=1 stream
# (the scheduler's stacks); calibration requests now sample like the running ones (scheduler.sample_like_running).
#   bash scripts/gpu_job_sglang42.sh OUT   -> OUT/async_stream_sglang_{fa3,triton}_7b.{json,log,engine.log},
#                                             OUT/gpu/sglang_inflight.json, OUT/sglang_inflight_kv.log
set -uo pipefail
O=${1:?usage: gpu_job_sglang42.sh OUT}
cd "$(dirname "$0")/.." || exit 1
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES%%,*}
mkdir -p "$O"
source scripts/gpu_env.sh
SGL="/tmp/site_sgl_tf:/tmp/site_sgl:$PYTHONPATH"
stream() {  # the 7B async stream on attention backend $1, int8 and int8 + FP8 KV in one run, with the stall logs
  rm -rf "/root/w/flashinfer-$1"  # an empty FlashInfer JIT cache: a kernel first built mid-stream shows as a stall
  FLASHINFER_WORKSPACE_BASE="/root/w/flashinfer-$1" \
  PYTHONPATH=$SGL FLASHRL_LOGGING_LEVEL=INFO FLASHRL_BENCH_LOG="$O/async_stream_sglang_$1_7b.engine.log" \
    FLASHRL_DEBUG_STACKS="$O/stacks" timeout "${STREAM_TIMEOUT:-420}" python3 benchmarks/async_stream.py \
    --engine sglang --preset gpu --configs int8,int8+kv --attention-backend "$1" --log-level info \
    --stall-dump 10 --seconds 40 --every 10 --gpu-memory-utilization 0.45 --workdir /root/w/s42 \
    --json "$O/async_stream_sglang_$1_7b.json" > "$O/async_stream_sglang_$1_7b.log" 2>&1
  echo "exit $?" >> "$O/async_stream_sglang_$1_7b.log"
}
stream fa3
T=tests/gpu/test_sglang_inflight.py::test_sglang_inflight_update
B=tests/gpu/test_sglang_inflight.py::test_kept_fp8_entries_are_no_further_from_a_recompute_than_stale_kv_plus_the_fp8_floor
PYTHONPATH=$SGL PYTHONUNBUFFERED=1 FLASHRL_GPU_RESULTS=$O/gpu FLASHRL_GPU_WORK=/root/w/s42gpu FLASHRL_GPU_JOBS=2 \
  timeout 900 python3 -m pytest -rA -p no:cacheprovider "$T[in_place-int8]" "$T[in_place-int8+kv]" \
  "$T[in_place-int8+kv@fa3]" "$B[in_place-int8+kv]" "$B[in_place-int8+kv@fa3]" \
  > "$O/sglang_inflight_kv.log" 2>&1
echo "tests exit $?" >> "$O/sglang_inflight_kv.log"
# the batched calibration (scales = a fresh engine's), and the in-place sync (issue 45: syncs 2 and 3 of each case
# copy through the slots the first one checked; int8, fp8 per channel, FP8 MoE's attention)
S=tests/gpu/test_sglang.py::test_sglang_sync_equals_a_fresh_engine
PYTHONPATH=$SGL PYTHONUNBUFFERED=1 FLASHRL_GPU_RESULTS=$O/gpu FLASHRL_GPU_WORK=/root/w/s42gpu FLASHRL_GPU_JOBS=3 \
  FLASHRL_LOGGING_LEVEL=INFO timeout 900 python3 -m pytest -rA -p no:cacheprovider "$S[dense-int8+kv]" \
  "$S[dense-int8+kv@fa3]" "$S[dense-int8]" "$S[dense-fp8]" "$S[moe-fp8]" > "$O/sglang_kv.log" 2>&1
echo "tests exit $?" >> "$O/sglang_kv.log"
[ -n "${NO_TRITON:-}" ] || stream triton  # last: the least needed (it recaptures the decode graphs whenever the scales change)
