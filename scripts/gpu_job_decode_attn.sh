#!/usr/bin/env bash
# Issue 45 on a 2-GPU host (after scripts/gpu_install.sh with the trainers' wheels for uvicorn, and
# gpu_install_sglang.sh with the FA3 library): flashrl's FP8 decode attention (quant/kernels/fp8_decode_attn.py,
# FLASHRL_DECODE_ATTN=1) in the RL step against FA3, then the engine tests of both switches. Timings first:
#   GPU 0  rl_step vLLM Qwen3-8B int8 + FP8 KV with the switch off, then bf16
#   GPU 1  rl_step vLLM Qwen3-8B int8 + FP8 KV with the switch on; benchmarks/decode_attention.py in vLLM's HND
#          layout; then side by side the tests of an engine with the switch on = a fresh one (test_vllm_runtime.py
#          -k kv) and SGLang's fused FP8 KV store's (FLASHRL_FUSED_KV_STORE=1: test_sglang_kv_store.py,
#          test_sglang.py -k fa3)
# rl_step's workload: --preset colocated at TRL's share (0.3 of the GPU, 256 sequences), outputs up to 4,096 tokens.
# DA_BENCH=1 adds the kernel's full benchmark and sweep (NHD, ~6 minutes) on GPU 0 first.
#   setsid nohup bash scripts/gpu_job_decode_attn.sh RES > /root/job.out 2>&1 < /dev/null &
# -> RES/da/*, RES/{on,off}/goal/*.{json,log}, RES/{on,off}/bench.log, RES/tv/*, RES/t/*, RES/SESSIONDONE
set -uo pipefail
RES=${1:?usage: gpu_job_decode_attn.sh RES}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$RES/da" "$RES/t" "$RES/tv" "$RES/on" "$RES/off"
export ARGS="--preset colocated --gpu-memory-utilization 0.3 --max-len 4096"
G=tests/gpu
(source scripts/gpu_env.sh
 if [ "${DA_BENCH:-0}" = 1 ]; then
   CUDA_VISIBLE_DEVICES=0 python3 benchmarks/decode_attention.py --shapes qwen3-8b,7b,14b --batches 256,128,64,16,4 \
     --sweep 128,16 --json "$RES/da/decode_attention.json" > "$RES/da/bench.log" 2>&1
 fi
 FLASHRL_DECODE_ATTN=0 FLASHRL_BENCH_LOG=$RES/off/bench.log QUEUES=$'0:vllm:qwen3-8b:int8+kv,bf16' \
   bash scripts/gpu_job_goal.sh "$RES/off") &
(source scripts/gpu_env.sh
 FLASHRL_DECODE_ATTN=1 FLASHRL_BENCH_LOG=$RES/on/bench.log QUEUES=$'1:vllm:qwen3-8b:int8+kv' \
   bash scripts/gpu_job_goal.sh "$RES/on"
 CUDA_VISIBLE_DEVICES=1 python3 benchmarks/decode_attention.py --shapes qwen3-8b,7b --batches 128,16 --layout hnd \
   --json "$RES/da/decode_attention_hnd.json" > "$RES/da/bench_hnd.log" 2>&1
 CUDA_VISIBLE_DEVICES=1 python3 -m pytest -rA -p no:cacheprovider tests/test_kernels.py -k "compiled or fp8_decode" \
   > "$RES/da/kernel_test.log" 2>&1
 CUDA_VISIBLE_DEVICES=1 GPU_WORK=/root/w/gpu-tv FLASHRL_DECODE_ATTN=1 TEST_GROUPS="vllm-kv:4:vllm:$G/test_vllm_runtime.py -k kv" \
   bash scripts/gpu_tests.sh "$RES/tv" &
 CUDA_VISIBLE_DEVICES=1 GPU_WORK=/root/w/gpu-t FLASHRL_FUSED_KV_STORE=1 TEST_GROUPS="kv-store:1:sglang:$G/test_sglang_kv_store.py
sglang:2:sglang:$G/test_sglang.py -k fa3" bash scripts/gpu_tests.sh "$RES/t" &
 wait) &
wait
touch "$RES/SESSIONDONE"
