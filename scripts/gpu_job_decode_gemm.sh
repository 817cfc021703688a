#!/usr/bin/env bash
# Issue 45's few-rows INT8 GEMM (quant/kernels/w8a8_gemm.py, FLASHRL_DECODE_GEMM) on one GPU (CUDA_VISIBLE_DEVICES),
# after scripts/gpu_install.sh:
#   1. tests/test_kernels.py: the Triton GEMM = vLLM's CUTLASS kernel bit for bit (and the INT8 quantizer's tests)
#   2. benchmarks/small_m_gemm.py at 7B / 14B shapes, 1..64 rows (tile sweep at 4 and 16 rows)
#   3. tests/gpu/test_vllm_decode_gemm.py: an engine synced with the switch on = a fresh one with CUTLASS
#   4. ROWS = the largest row count up to which the Triton GEMM is no slower than CUTLASS over a 7B layer (step 2),
#      then the 7B RL-step row int8 + FP8 KV with FLASHRL_DECODE_GEMM=ROWS and (RL_AB=1) the same row with CUTLASS
#   bash scripts/gpu_job_decode_gemm.sh OUT   -> OUT/{kernels,small_m_gemm,decode_gemm_tests}.log, OUT/small_m_gemm.json,
#                                                OUT/gpu/vllm_decode_gemm.json, OUT/rl_step_7b_decode_gemm{,_cutlass}.json
set -uo pipefail
O=${1:?usage: gpu_job_decode_gemm.sh OUT}
cd "$(dirname "$0")/.." || exit 1
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES%%,*} PYTHONUNBUFFERED=1
mkdir -p "$O"
source scripts/gpu_env.sh
timeout 600 python3 -m pytest -rA -p no:cacheprovider tests/test_kernels.py > "$O/kernels.log" 2>&1
echo "tests exit $?" >> "$O/kernels.log"
timeout 900 python3 benchmarks/small_m_gemm.py --shapes 7b,14b --rows 1,4,8,16,32,64 --sweep 4,16 \
  --json "$O/small_m_gemm.json" > "$O/small_m_gemm.log" 2>&1
echo "exit $?" >> "$O/small_m_gemm.log"
FLASHRL_GPU_RESULTS=$O/gpu FLASHRL_GPU_WORK=/root/w/dg FLASHRL_GPU_JOBS=2 FLASHRL_LOGGING_LEVEL=INFO \
  timeout 900 python3 -m pytest -rA -p no:cacheprovider tests/gpu/test_vllm_decode_gemm.py > "$O/decode_gemm_tests.log" 2>&1
echo "tests exit $?" >> "$O/decode_gemm_tests.log"
ROWS=$(python3 - "$O/small_m_gemm.json" <<'PY'
import json, sys
try:
    s = [r for r in json.load(open(sys.argv[1]))["summary"] if r["shape"] == "7b" and r["bit_identical"]]
except Exception:
    s = []
best = 0
for r in sorted(s, key=lambda r: r["rows"]):
    if r["triton_us"] > r["cutlass_us"]:
        break
    best = r["rows"]
print(best)
PY
)
echo "decode GEMM rows: $ROWS" | tee "$O/rows.txt"
[ "$ROWS" -gt 0 ] || exit 0
rl() {  # rl NAME ARGS...: one rl_step.py row -> $O/NAME.json, .log (the goal rows' workload)
  local name=$1; shift
  timeout 900 python3 benchmarks/rl_step.py --shapes 7b --prompts 16 --unseeded --first-max-len 256 \
    --gpu-memory-utilization 0.85 --workdir /root/w/dg-rl "$@" --json "$O/$name.json" > "$O/$name.log" 2>&1
}
FLASHRL_DECODE_GEMM=$ROWS rl rl_step_7b_decode_gemm --configs int8+kv
[ -z "${RL_AB:-}" ] || FLASHRL_DECODE_GEMM=0 rl rl_step_7b_decode_gemm_cutlass --configs int8+kv
