#!/usr/bin/env bash
# Issue 45's measurements and issue 42's SGLang leftovers, on a four-GPU host (each GPU its own queue, each row
# its own process; rows compared only within this run), after scripts/gpu_install.sh and gpu_install_sglang.sh
# (FA3 library staged):
#   setsid nohup bash scripts/gpu_job_speed.sh /root/res > /root/res/job.out 2>&1 < /dev/null &
#   GPU 0  SGLang: issue 42's leftovers (scripts/gpu_job_sglang42.sh: the fa3 and triton async streams with the
#          stall logs, the in-place FP8 KV tests) -> RES/j01
#   GPU 1  vLLM RL step at 7B as the issue measured it (16 x 8, seeded), then unseeded (as verl / TRL sample)
#   GPU 2  vLLM 7B without sampling logprobs, then 14B unseeded, then the RL-step rows on SGLang (fa3, its
#          default on Hopper; overlap scheduler on; FLASHRL_SYNC_TIMING: each sync's conversion vs SGLang's
#          load_weights in the engine log -- where an INT8 sync's 3.2x BF16 goes)
#   GPU 3  step_profile at 14B, then the DAPO-like workload (Qwen3-8B shape, prompts 1-2k, responses <= 16k)
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

(export CUDA_VISIBLE_DEVICES=0
 bash scripts/gpu_job_sglang42.sh "$RES/j01") &
g0=$!
(export CUDA_VISIBLE_DEVICES=1
 python3 benchmarks/rl_step.py --shapes 7b --configs bf16,int8+kv,fp8+kv --prompts 16 "${RL[@]}" --workdir /root/w/s1 \
   --json "$O/rl_step_7b_seeded.json" > "$O/rl_step_7b_seeded.log" 2>&1
 python3 benchmarks/rl_step.py --shapes 7b --configs bf16,int8+kv --prompts 16 --unseeded "${RL[@]}" --workdir /root/w/s1 \
   --json "$O/rl_step_7b_unseeded.json" > "$O/rl_step_7b_unseeded.log" 2>&1) &
g1=$!
(export CUDA_VISIBLE_DEVICES=2
 python3 benchmarks/rl_step.py --shapes 7b --configs bf16,int8+kv --prompts 16 --unseeded --no-logprobs "${RL[@]}" \
   --workdir /root/w/s2 --json "$O/rl_step_7b_nologprobs.json" > "$O/rl_step_7b_nologprobs.log" 2>&1
 python3 benchmarks/rl_step.py --shapes 14b --configs bf16,int8+kv --prompts 16 --unseeded "${RL[@]}" --workdir /root/w/s2 \
   --json "$O/rl_step_14b_unseeded.json" > "$O/rl_step_14b_unseeded.log" 2>&1
 PYTHONPATH=$SGL FLASHRL_LOGGING_LEVEL=INFO FLASHRL_SYNC_TIMING=1 FLASHRL_BENCH_LOG="$O/rl_step_sglang_7b.engine.log" \
   python3 benchmarks/rl_step.py --engine sglang --attention-backend fa3 --shapes 7b --configs bf16,int8+kv --prompts 16 \
   --unseeded "${RL[@]}" --workdir /root/w/s2 --json "$O/rl_step_sglang_7b.json" > "$O/rl_step_sglang_7b.log" 2>&1) &
g2=$!
(export CUDA_VISIBLE_DEVICES=3
 python3 benchmarks/step_profile.py --preset gpu --shapes 14b --workdir /root/w/s3 --json "$O/step_profile_14b.json" \
   > "$O/step_profile_14b.log" 2>&1
 python3 benchmarks/rl_step.py --preset dapo --shapes qwen3-8b --configs bf16,int8+kv --prompts 16 --unseeded "${RL[@]}" \
   --workdir /root/w/s3 --json "$O/rl_step_dapo_qwen3_8b.json" > "$O/rl_step_dapo_qwen3_8b.log" 2>&1) &
g3=$!
wait $g0 $g1 $g2 $g3
touch "$RES/SESSIONDONE"
