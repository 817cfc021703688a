#!/usr/bin/env bash
# Issues 42 + 43 on two GPUs, what the runs of 2026-11-26 left (benchmarks/RESULTS.md), after
# scripts/gpu_install.sh (default model staged), gpu_install_sglang.sh with the FA3 library staged
# (FA3=1 scripts/gpu_stage_sglang.sh: DIR/fa3/fN) and the SmoothQuant profile at /root/sq (scripts/gpu_stage_sq.sh):
#   setsid nohup bash scripts/gpu_job_async.sh /root/res > /root/res/job.out 2>&1 < /dev/null &
# Side by side:
#   GPU 0    SGLang with fa3 attention (it reads the FP8 KV scales from tensors: no decode-graph capture per
#            update): an in-place update with FP8 KV, and a sync = fresh engines; SGLang's 8-bit updates for dense
#            fp8 and the calibrated YAML (issue 43); then verl's fully-async
#            trainer (int8, fp8 + FP8 KV; rollouter and trainer on a GPU each; a rollouter slower than the
#            trainer, 4 sequences at a time: syncs land on requests in flight -> partial rollouts) with the
#            after-run fresh-engine check
#   GPU 1    async_stream on SGLang with fa3 (7B): the first token after a continue, with and without FP8 KV
#   both     vLLM wire reruns: TP = 2 MoE int8 (MoE quant-config copies compared by value) and the calibrated
#            YAML (the refusal sent with flashrl.converted; the BF16 sync after it)
# -> RES/{sgl,swire,vwire}/ (gpu_tests.sh), RES/verl/, RES/bench/; RES/SESSIONDONE when all finished.
set -uo pipefail
RES=${1:?usage: gpu_job_async.sh RES}
cd "$(dirname "$0")/.." || exit 1
source scripts/gpu_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
mkdir -p "$RES/bench" "$RES/verl"
G=tests/gpu
(export CUDA_VISIBLE_DEVICES=1 PYTHONUNBUFFERED=1
 PYTHONPATH=/tmp/site_sgl_tf:/tmp/site_sgl:$PYTHONPATH python3 benchmarks/async_stream.py --engine sglang --preset gpu \
   --configs int8,int8+kv --attention-backend fa3 --seconds 40 --every 10 --gpu-memory-utilization 0.45 \
   --workdir /root/w/bench --json "$RES/bench/async_stream_sglang_fa3_7b.json" > "$RES/bench/async_stream_sglang_fa3.log" 2>&1) &
bench=$!
(CUDA_VISIBLE_DEVICES=0 GPU_WORK=/root/w/sgl TEST_GROUPS="sinflight:1:sglang:$G/test_sglang_inflight.py::test_sglang_inflight_update[in_place-int8+kv@fa3]
sfa3:1:sglang:$G/test_sglang.py::test_sglang_sync_equals_a_fresh_engine[dense-int8+kv@fa3]" \
   bash scripts/gpu_tests.sh "$RES/sgl"
 CUDA_VISIBLE_DEVICES=0 GPU_WORK=/root/w/sgl FLASHRL_GPU_SQ=/root/sq \
   TEST_GROUPS="swire:1:sglang:$G/test_sglang_wire.py::test_trainer_quantized_updates_equal_a_fresh_engine[dense-fp8] $G/test_sglang_wire.py::test_a_calibrated_yaml_over_the_wire_equals_an_engine_side_sync" \
   bash scripts/gpu_tests.sh "$RES/swire"
 # SGLang sizes its memory from what is free when it starts: verl's processes start after its engines
 RECIPE=async STEPS=${ASYNC_STEPS:-12} ROLLOUT_MAX_SEQS=4 MAX_RESPONSE_LEN=256 STALENESS=2 STAGGER=30 \
   bash scripts/gpu_verl_runs.sh "$RES/verl" int8:0 fp8+kv:0 > "$RES/verl/runs.out" 2>&1) &
sgl=$!
W="$G/test_vllm_wire.py"
FLASHRL_GPU_SQ=/root/sq GPU_WORK=/root/w/vwire TEST_GROUPS="vwire:2:vllm:$W::test_two_gpu_paths_equal_an_engine_side_sync[tp2-moe-int8] $W::test_a_calibrated_yaml_over_the_wire_equals_an_engine_side_sync[sq-int8]" \
  bash scripts/gpu_tests.sh "$RES/vwire"
wait $sgl $bench
touch "$RES/SESSIONDONE"
