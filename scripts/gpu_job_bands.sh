#!/usr/bin/env bash
# Issue 45, after 2026-11-27 (neither the FP8 KV cache nor FlashInfer attention moved the RL step; a faster
# few-rows INT8 GEMM did not show inside the 2 % spread between repeats): where the step's time goes by how many
# requests are still running -- `rl_step.py --step-bands` -- and one more 8-bit format in the step: fp8_channel
# (FP8 weights per channel, FP8 activations per token: a key vLLM's RMSNorm + quant fusion pass has patterns for,
# whether 0.26 applies it by default unchecked; INT8's activation quantization is a kernel of its own, +0.26 /
# +0.45 ms per tail step at 7B / 14B). On a 4-GPU host, after scripts/gpu_install.sh:
#   GPU 0 / 1  7B / 14B: bf16, int8+kv, int8               (each config its own process)
#   GPU 2 / 3  7B / 14B: bf16, int8+kv, fp8_channel+kv     (bf16 and int8+kv again: the spread)
#   setsid nohup bash scripts/gpu_job_bands.sh RES > RES/job.out 2>&1 < /dev/null &
# -> RES/dg/bands_SHAPE_CONFIG_gGPU.{json,log}; RES/SESSIONDONE at the end (~15 minutes at 14B)
set -uo pipefail
RES=${1:?usage: gpu_job_bands.sh RES}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$RES/dg" /root/w
source scripts/gpu_env.sh
export PYTHONUNBUFFERED=1
printf 'version: 1\nconfigs:\n- fn: fp8_channel\n  logprobs_mode: processed_logprobs\n' > /root/w/fp8_channel.yaml
rows() {  # rows GPU SHAPE CONFIG...: banded RL-step rows, one process each
  local gpu=$1 shape=$2; shift 2
  for config in "$@"; do
    local name=${config//\/root\/w\//}; name=${name//.yaml/}
    CUDA_VISIBLE_DEVICES=$gpu timeout 900 python3 benchmarks/rl_step.py --shapes "$shape" --configs "$config" \
      --prompts 16 --unseeded --first-max-len 256 --gpu-memory-utilization 0.85 --step-bands \
      --workdir "/root/w/bands-$gpu" --json "$RES/dg/bands_${shape}_${name}_g$gpu.json" \
      > "$RES/dg/bands_${shape}_${name}_g$gpu.log" 2>&1
    echo "exit $?" >> "$RES/dg/bands_${shape}_${name}_g$gpu.log"
  done
}
rows 0 7b bf16 int8+kv int8 & rows 1 14b bf16 int8+kv int8 &
rows 2 7b bf16 int8+kv /root/w/fp8_channel.yaml+kv & rows 3 14b bf16 int8+kv /root/w/fp8_channel.yaml+kv &
wait
touch "$RES/SESSIONDONE"
