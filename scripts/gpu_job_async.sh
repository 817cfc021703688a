#!/usr/bin/env bash
# Issues 42 + 43 on a two-GPU host, what the run of 2026-11-26 left (benchmarks/RESULTS.md), after
# scripts/gpu_install.sh (default model staged) and gpu_install_sglang.sh; SmoothQuant profile at /root/sq
# (scripts/gpu_stage_sq.sh):
#   setsid nohup bash scripts/gpu_job_async.sh /root/res > /root/res/job.out 2>&1 < /dev/null &
# Side by side:
#   GPU 0    SGLang with fa3 attention (it reads the FP8 KV scales from tensors: no decode-graph capture per
#            update): an in-place update with FP8 KV, and a sync = fresh engines; an in-place update pushed through
#            update_weights_from_distributed; then verl's fully-async trainer
#            (int8, fp8 + FP8 KV; rollouter and trainer on a GPU each; long responses, staleness 2: syncs land
#            on requests in flight -> partial rollouts) with the after-run fresh-engine check
#   GPU 1    benchmarks, one after another: async_stream on SGLang with fa3 (7B), wire_sync through CUDA IPC
#   both     vLLM wire: TP = 2 MoE int8 (recording the MoE quant configs' scale copies) and the calibrated YAML;
#            then the calibrated YAML updated in flight on vLLM (keep, abort)
# -> RES/{sgl,vwire,vinfl}/ (gpu_tests.sh), RES/verl/, RES/bench/; RES/SESSIONDONE when all finished.
set -uo pipefail
RES=${1:?usage: gpu_job_async.sh RES}
cd "$(dirname "$0")/.." || exit 1
source scripts/gpu_env.sh
mkdir -p "$RES/bench" "$RES/verl"
G=tests/gpu
# H200 (141 GB) or H100 (80 GB): the 32B engine's share
BIG=$([ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0)" -gt 100000 ] && echo 1 || echo 0)
UTIL=$([ "$BIG" = 1 ] && echo 0.4 || echo 0.75)
(export CUDA_VISIBLE_DEVICES=1 PYTHONUNBUFFERED=1
 PYTHONPATH=/tmp/site_sgl_tf:/tmp/site_sgl:$PYTHONPATH python3 benchmarks/async_stream.py --engine sglang --preset gpu \
   --configs int8,int8+kv --attention-backend fa3 --seconds 40 --every 10 --gpu-memory-utilization 0.45 \
   --workdir /root/w/bench --json "$RES/bench/async_stream_sglang_fa3_7b.json" > "$RES/bench/async_stream_sglang_fa3.log" 2>&1
 python3 benchmarks/wire_sync.py --ipc --preset gpu --gpu-memory-utilization "$UTIL" --workdir /root/w/bench \
   --json "$RES/bench/wire_sync_ipc.json" > "$RES/bench/wire_sync_ipc.log" 2>&1) &
bench=$!
(CUDA_VISIBLE_DEVICES=0 GPU_WORK=/root/w/sgl TEST_GROUPS="sinflight:2:sglang:$G/test_sglang_inflight.py::test_sglang_inflight_update[in_place-int8+kv@fa3] $G/test_sglang_inflight.py::test_sglang_inflight_update[in_place-int8+kv@dist]
sfa3:1:sglang:$G/test_sglang.py::test_sglang_sync_equals_a_fresh_engine[dense-int8+kv@fa3]" \
   bash scripts/gpu_tests.sh "$RES/sgl"
 # SGLang sizes its memory from what is free when it starts: verl's processes start after its engines
 RECIPE=async STEPS=${ASYNC_STEPS:-12} MAX_RESPONSE_LEN=256 STALENESS=2 STAGGER=30 \
   bash scripts/gpu_verl_runs.sh "$RES/verl" int8:0 fp8+kv:0 > "$RES/verl/runs.out" 2>&1) &
sgl=$!
W="$G/test_vllm_wire.py"
FLASHRL_GPU_SQ=/root/sq GPU_WORK=/root/w/vwire TEST_GROUPS="vwire:2:vllm:$W::test_two_gpu_paths_equal_an_engine_side_sync[tp2-moe-int8] $W::test_a_calibrated_yaml_over_the_wire_equals_an_engine_side_sync[sq-int8]" \
  bash scripts/gpu_tests.sh "$RES/vwire"
# then, in the same work directory (the calibrated checkpoint and profile already built there): the calibrated
# YAML updated in flight (keep, abort)
FLASHRL_GPU_SQ=/root/sq GPU_WORK=/root/w/vwire TEST_GROUPS="vinfl:2:vllm:$G/test_vllm_inflight.py::test_calibrated_yaml_inflight_update" \
  bash scripts/gpu_tests.sh "$RES/vinfl"
wait $sgl $bench
touch "$RES/SESSIONDONE"
