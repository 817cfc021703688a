#!/usr/bin/env bash
# Issue 42's SGLang leftovers on one GPU (CUDA_VISIBLE_DEVICES: its first), after scripts/gpu_install.sh and
# gpu_install_sglang.sh with the FA3 library; as gpu_job_x4.sh's JOB01 (JOB01_GPUS=3) beside issue 44's arms:
#   1. the async stream with triton, int8 and int8 + FP8 KV: the first token after the continue (the kept requests
#      now go on when the scales are written, one decode step earlier; the bound: 1.5x int8's)
#   2. the fa3 + FP8 KV stall (scripts/gpu_fa3_stall.sh as is, DIAG_TIMEOUT 240 s)
#   3. the in-place and retract FP8 KV GPU tests after that change (triton and fa3)
#   4. the stall without SGLang's overlap scheduler (last: the arms' runs end first, the machine may go back)
#   bash scripts/gpu_job_sglang42.sh OUT   -> OUT/*.json, *.log; OUT/gpu/sglang_inflight.json
set -uo pipefail
O=${1:?usage: gpu_job_sglang42.sh OUT}
cd "$(dirname "$0")/.." || exit 1
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES%%,*}
mkdir -p "$O"
source scripts/gpu_env.sh
SGL="/tmp/site_sgl_tf:/tmp/site_sgl:$PYTHONPATH"
PYTHONPATH=$SGL timeout 600 python3 benchmarks/async_stream.py --engine sglang --preset gpu --configs int8,int8+kv \
  --seconds 40 --every 10 --gpu-memory-utilization 0.45 --workdir /root/w/s42 \
  --json "$O/async_stream_sglang_triton_7b.json" > "$O/async_stream_sglang_triton_7b.log" 2>&1
VARIANTS=asis DIAG_TIMEOUT=${DIAG_TIMEOUT:-240} bash scripts/gpu_fa3_stall.sh "$O"
T=tests/gpu/test_sglang_inflight.py::test_sglang_inflight_update
PYTHONPATH=$SGL PYTHONUNBUFFERED=1 FLASHRL_GPU_RESULTS=$O/gpu FLASHRL_GPU_WORK=/root/w/s42gpu FLASHRL_GPU_JOBS=2 \
  timeout 900 python3 -m pytest -rA -p no:cacheprovider "$T[in_place-int8+kv]" "$T[in_place-int8+kv@fa3]" \
  "$T[retract-int8+kv]" > "$O/sglang_inflight_kv.log" 2>&1
echo "tests exit $?" >> "$O/sglang_inflight_kv.log"
VARIANTS=nooverlap DIAG_TIMEOUT=${DIAG_TIMEOUT:-240} bash scripts/gpu_fa3_stall.sh "$O"
