#!/usr/bin/env bash
# Issues 42 + 43 on a two-GPU host, one session, after scripts/gpu_install.sh (default model staged) and
# gpu_install_sglang.sh; SmoothQuant profile staged at /root/sq (scripts/gpu_stage_sq.sh):
#   setsid nohup bash scripts/gpu_job_async.sh /root/res > /root/res/job.out 2>&1 < /dev/null &
# Side by side:
#   GPU 0    SGLang in-flight updates (every mode, FP8 KV in place without a drain) and SGLang sync regressions
#   GPU 1    benchmarks, one after another: async_stream on SGLang (7B), wire_sync through CUDA IPC and in the
#            engine (7B / 14B / 32B)
#   both     vLLM wire: TP = 2 MoE int8 and the calibrated YAML; after the SGLang tests, verl's fully-async
#            trainer (int8, fp8 + FP8 KV; rollouter and trainer on a GPU each) with the after-run fresh-engine check
# -> RES/{sgl,vwire}/ (gpu_tests.sh), RES/verl/, RES/bench/; RES/SESSIONDONE when all finished.
set -uo pipefail
RES=${1:?usage: gpu_job_async.sh RES}
cd "$(dirname "$0")/.." || exit 1
source scripts/gpu_env.sh
mkdir -p "$RES/bench" "$RES/verl"
G=tests/gpu
# H200 (141 GB) or H100 (80 GB): the 32B engine's share, and how many SGLang test engines fit side by side (each
# wants 70 % of the GPU free when it starts)
BIG=$([ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0)" -gt 100000 ] && echo 1 || echo 0)
UTIL=$([ "$BIG" = 1 ] && echo 0.4 || echo 0.75) JOBS=$([ "$BIG" = 1 ] && echo 3 || echo 2)
(export CUDA_VISIBLE_DEVICES=1 PYTHONUNBUFFERED=1
 PYTHONPATH=/tmp/site_sgl_tf:/tmp/site_sgl:$PYTHONPATH python3 benchmarks/async_stream.py --engine sglang --preset gpu \
   --seconds 40 --every 10 --gpu-memory-utilization 0.45 --workdir /root/w/bench \
   --json "$RES/bench/async_stream_sglang_7b.json" > "$RES/bench/async_stream_sglang.log" 2>&1
 python3 benchmarks/wire_sync.py --ipc --preset gpu --gpu-memory-utilization $UTIL --workdir /root/w/bench \
   --json "$RES/bench/wire_sync_ipc.json" > "$RES/bench/wire_sync_ipc.log" 2>&1
 python3 benchmarks/wire_sync.py --preset gpu --gpu-memory-utilization $UTIL --workdir /root/w/bench \
   --json "$RES/bench/wire_sync.json" > "$RES/bench/wire_sync.log" 2>&1) &
bench=$!
(CUDA_VISIBLE_DEVICES=0 GPU_WORK=/root/w/sgl TEST_GROUPS="sinflight:$JOBS:sglang:$G/test_sglang_inflight.py
sregress:2:sglang:$G/test_sglang.py::test_sglang_sync_equals_a_fresh_engine[dense-int8+kv] $G/test_sglang.py::test_sglang_sync_equals_a_fresh_engine[moe-fp8] $G/test_sglang.py::test_sglang_sync_equals_a_fresh_engine[dense-int8]" \
   bash scripts/gpu_tests.sh "$RES/sgl"
 # SGLang sizes its memory from what is free when it starts: verl's processes start after its engines
 RECIPE=async STEPS=${ASYNC_STEPS:-20} STAGGER=30 bash scripts/gpu_verl_runs.sh "$RES/verl" int8:0 fp8+kv:0 \
   > "$RES/verl/runs.out" 2>&1) &
sgl=$!
W="$G/test_vllm_wire.py"
FLASHRL_GPU_SQ=/root/sq GPU_WORK=/root/w/vwire TEST_GROUPS="vwire:2:vllm:$W::test_two_gpu_paths_equal_an_engine_side_sync[tp2-moe-int8] $W::test_a_calibrated_yaml_over_the_wire_equals_an_engine_side_sync[sq-int8]" \
  bash scripts/gpu_tests.sh "$RES/vwire"
wait $sgl $bench
touch "$RES/SESSIONDONE"
