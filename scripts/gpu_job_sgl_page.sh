#!/usr/bin/env bash
# Issue 45: SGLang's 14B rows at verl's 0.5 with page_size 16 (the pool's KV slots by 16-token pages, as vLLM's
# blocks: flashrl's FP8 decode kernel then reads a sequence's keys from contiguous pages, not one slot a token),
# int8 + FP8 KV and bf16 (the same setting for the baseline), each its own process, with the step bands.
# Each row waits until its GPU's queue file (WAIT0 / WAIT1: a log that ends "exit N") is done, so it can follow
# another job on the same host:
#   WAIT0=RES/r0/goal/vllm_14b_bf16.log WAIT1=RES/r1/goal/vllm_14b_int8+kv.log \
#     setsid nohup bash scripts/gpu_job_sgl_page.sh RES > RES/page.out 2>&1 < /dev/null &
# -> RES/page/sglang_14b_CONFIG_page16.{json,log}, RES/PAGEDONE
set -uo pipefail
RES=${1:?usage: gpu_job_sgl_page.sh RES}
cd "$(dirname "$0")/.." || exit 1
source scripts/gpu_env.sh
export PYTHONUNBUFFERED=1
unset FLASHRL_DECODE_ATTN FLASHRL_DECODE_GEMM FLASHRL_FUSED_KV_STORE
O=$RES/page
mkdir -p "$O" /root/w
row() {  # row GPU CONFIG WAITFILE
  while [ -n "$3" ] && ! grep -q '^exit' "$3" 2>/dev/null; do sleep 5; done
  CUDA_VISIBLE_DEVICES=$1 PYTHONPATH=/tmp/site_sgl_tf:/tmp/site_sgl:$PYTHONPATH timeout 1200 python3 \
    benchmarks/rl_step.py --engine sglang --attention-backend fa3 --page-size 16 --shapes 14b --configs "$2" \
    --preset colocated --stats --unseeded --first-max-len 256 --step-bands --workdir "/root/w/page-$1" \
    --json "$O/sglang_14b_$2_page16.json" > "$O/sglang_14b_$2_page16.log" 2>&1
  echo "exit $?" >> "$O/sglang_14b_$2_page16.log"
}
row 0 int8+kv "${WAIT0:-}" &
row 1 bf16 "${WAIT1:-}" &
wait
touch "$RES/PAGEDONE"
