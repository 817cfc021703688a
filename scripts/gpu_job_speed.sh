#!/usr/bin/env bash
# Issue 45's measurements and issue 42's SGLang leftovers, after scripts/gpu_install.sh and gpu_install_sglang.sh
# (FA3 library staged); each GPU its own queue, each row its own process, rows compared only within this run:
#   setsid nohup bash scripts/gpu_job_speed.sh /root/res > /root/res/job.out 2>&1 < /dev/null &
# Four GPUs:
#   GPU 0  issue 42's leftovers (scripts/gpu_job_sglang42.sh without the triton stream: the fa3 stream with an
#          empty FlashInfer cache, the in-place FP8 KV tests, test_sglang.py's FP8 KV and in-place sync cases)
#          -> RES/j01
#   GPU 1  SGLang's RL-step rows (fa3, overlap scheduler on; FLASHRL_SYNC_TIMING: each sync's conversion vs
#          write in the engine log; the calibration's time): bf16, int8 + FP8 KV; then int8 + FP8 KV with
#          FLASHRL_INPLACE_SYNC=0 (SGLang's loaders for every tensor: what the in-place slots save)
#   GPU 2  the DAPO-like workload (Qwen3-8B shape, prompts 1-2k, responses <= 16k): bf16, int8 + FP8 KV, fp8 + FP8 KV
#   GPU 3  step_profile at 14B
# Two GPUs (GPUS=2 or what nvidia-smi lists): GPU 0 issue 42's leftovers, then SGLang's rows; GPU 1 the DAPO rows,
# then the 14B step profile. (The vLLM 7B / 14B goal rows ran on 2 x H200 on 2026-11-26: RESULTS.)
# -> RES/speed/*.json + logs; RES/SESSIONDONE when all finished.
set -uo pipefail
RES=${1:?usage: gpu_job_speed.sh RES}
cd "$(dirname "$0")/.." || exit 1
source scripts/gpu_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1
O=$RES/speed
mkdir -p "$O"
SGL="/tmp/site_sgl_tf:/tmp/site_sgl:$PYTHONPATH"
RL=(--first-max-len 256 --gpu-memory-utilization 0.85)
rl() {  # rl NAME WORKDIR ARGS...: one rl_step.py run -> $O/NAME.json, .log
  local name=$1 work=$2
  shift 2
  python3 benchmarks/rl_step.py "$@" "${RL[@]}" --workdir "$work" --json "$O/$name.json" > "$O/$name.log" 2>&1
}

sglang_rows() {  # SGLang's RL-step rows (fa3; each sync's convert vs write seconds in the engine log)
  PYTHONPATH=$SGL FLASHRL_LOGGING_LEVEL=INFO FLASHRL_SYNC_TIMING=1 FLASHRL_DEBUG_STACKS="$O/stacks" \
    FLASHRL_BENCH_LOG="$O/rl_step_sglang_7b.engine.log" \
    rl rl_step_sglang_7b "$1" --engine sglang --attention-backend fa3 --shapes 7b --configs bf16,int8+kv \
    --prompts 16 --unseeded
  # the same INT8 row with the in-place sync off (SGLang's loaders for every tensor): what the slots save
  PYTHONPATH=$SGL FLASHRL_LOGGING_LEVEL=INFO FLASHRL_SYNC_TIMING=1 FLASHRL_INPLACE_SYNC=0 \
    FLASHRL_BENCH_LOG="$O/rl_step_sglang_7b_loaders.engine.log" \
    rl rl_step_sglang_7b_loaders "$1" --engine sglang --attention-backend fa3 --shapes 7b --configs int8+kv \
    --prompts 16 --unseeded
}
dapo_and_profile() {  # the DAPO-like Qwen3-8B rows, then the 14B step profile
  rl rl_step_dapo_qwen3_8b "$1" --preset dapo --shapes qwen3-8b --configs bf16,int8+kv,fp8+kv --prompts 16 --unseeded
  python3 benchmarks/step_profile.py --preset gpu --shapes 14b --workdir "$1" --json "$O/step_profile_14b.json" \
    > "$O/step_profile_14b.log" 2>&1
}
GPUS=${GPUS:-$(nvidia-smi -L | wc -l)}
if [ "$GPUS" -ge 4 ]; then
(export CUDA_VISIBLE_DEVICES=0
 NO_TRITON=1 bash scripts/gpu_job_sglang42.sh "$RES/j01") &
g0=$!
(export CUDA_VISIBLE_DEVICES=1
 sglang_rows /root/w/s1) &
g1=$!
(export CUDA_VISIBLE_DEVICES=2
 rl rl_step_dapo_qwen3_8b /root/w/s2 --preset dapo --shapes qwen3-8b --configs bf16,int8+kv,fp8+kv --prompts 16 \
   --unseeded) &
g2=$!
(export CUDA_VISIBLE_DEVICES=3
 python3 benchmarks/step_profile.py --preset gpu --shapes 14b --workdir /root/w/s3 --json "$O/step_profile_14b.json" \
   > "$O/step_profile_14b.log" 2>&1) &
g3=$!
wait $g0 $g1 $g2 $g3
else  # two GPUs: issue 42's leftovers (no triton stream) then SGLang's rows on GPU 0; the DAPO rows on GPU 1
(export CUDA_VISIBLE_DEVICES=0
 NO_TRITON=1 bash scripts/gpu_job_sglang42.sh "$RES/j01"
 sglang_rows /root/w/s0) &
g0=$!
(export CUDA_VISIBLE_DEVICES=1
 dapo_and_profile /root/w/s1) &
g1=$!
wait $g0 $g1
fi
touch "$RES/SESSIONDONE"
