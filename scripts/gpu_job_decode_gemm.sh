#!/usr/bin/env bash
# Issue 45's few-rows INT8 GEMM (quant/kernels/w8a8_gemm.py, FLASHRL_DECODE_GEMM) on one GPU (CUDA_VISIBLE_DEVICES),
# after scripts/gpu_install.sh:
#   1. tests/test_kernels.py: the Triton GEMM = vLLM's CUTLASS kernel bit for bit (and the INT8 quantizer's tests)
#   2. benchmarks/small_m_gemm.py at SHAPE (default 7b), 1..32 rows, the engine's tiles (no sweep)
#   3. tests/gpu/test_vllm_decode_gemm.py (NO_ENGINE_TEST=1 skips it): an engine synced with the switch on = a
#      fresh vLLM engine on the INT8 checkpoint
#   4. ROWS = the largest row count up to which the Triton GEMM is no slower than CUTLASS over a SHAPE layer (step 2),
#      then the RL-step rows at SHAPE, each its own process, on this GPU: int8 + FP8 KV with FLASHRL_DECODE_GEMM=ROWS,
#      the same with CUTLASS, then BF16 (the A/B first: a session that ends early keeps it)
#   ROWS=N skips steps 2 and the row pick (N from an earlier sweep); NO_KERNEL_TESTS=1 skips step 1; REPEAT=1 runs
#   the int8 + FP8 KV pair a second time after BF16 (in the other order: the run-to-run spread beside the A/B)
#   SHAPE=14b bash scripts/gpu_job_decode_gemm.sh OUT -> OUT/{kernels,small_m_gemm_SHAPE,decode_gemm_tests}.log,
#        OUT/small_m_gemm_SHAPE.json, OUT/gpu/vllm_decode_gemm.json, OUT/rl_step_SHAPE_{decode_gemm,cutlass,bf16}.json
set -uo pipefail
O=${1:?usage: gpu_job_decode_gemm.sh OUT}
SHAPE=${SHAPE:-7b}
cd "$(dirname "$0")/.." || exit 1
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES%%,*} PYTHONUNBUFFERED=1
mkdir -p "$O"
source scripts/gpu_env.sh
if [ -z "${NO_KERNEL_TESTS:-}" ]; then
  timeout 600 python3 -m pytest -rA -p no:cacheprovider tests/test_kernels.py > "$O/kernels_$SHAPE.log" 2>&1
  echo "tests exit $?" >> "$O/kernels_$SHAPE.log"
fi
if [ -z "${ROWS:-}" ]; then
  timeout 900 python3 benchmarks/small_m_gemm.py --shapes "$SHAPE" --rows 1,2,4,8,16,24,32 \
    --json "$O/small_m_gemm_$SHAPE.json" > "$O/small_m_gemm_$SHAPE.log" 2>&1
  echo "exit $?" >> "$O/small_m_gemm_$SHAPE.log"
fi
if [ -z "${NO_ENGINE_TEST:-}" ]; then
  FLASHRL_GPU_RESULTS=$O/gpu FLASHRL_GPU_WORK=/root/w/dg-$SHAPE FLASHRL_GPU_JOBS=2 FLASHRL_LOGGING_LEVEL=INFO \
    timeout 900 python3 -m pytest -rA -p no:cacheprovider tests/gpu/test_vllm_decode_gemm.py > "$O/decode_gemm_tests.log" 2>&1
  echo "tests exit $?" >> "$O/decode_gemm_tests.log"
fi
[ -n "${ROWS:-}" ] || ROWS=$(python3 - "$O/small_m_gemm_$SHAPE.json" <<'PY'
import json, sys
try:
    s = [r for r in json.load(open(sys.argv[1]))["summary"] if r["bit_identical"]]
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
echo "decode GEMM rows at $SHAPE: $ROWS" | tee "$O/rows_$SHAPE.txt"
[ "$ROWS" -gt 0 ] || exit 0
rl() {  # rl NAME ARGS...: one rl_step.py row -> $O/NAME.json, .log (the goal rows' workload)
  local name=$1; shift
  timeout 1500 python3 benchmarks/rl_step.py --shapes "$SHAPE" --prompts 16 --unseeded --first-max-len 256 \
    --gpu-memory-utilization 0.85 --workdir "/root/w/dg-rl-$SHAPE" "$@" --json "$O/$name.json" > "$O/$name.log" 2>&1
}
FLASHRL_DECODE_GEMM=$ROWS rl "rl_step_${SHAPE}_decode_gemm" --configs int8+kv
FLASHRL_DECODE_GEMM=0 rl "rl_step_${SHAPE}_cutlass" --configs int8+kv
rl "rl_step_${SHAPE}_bf16" --configs bf16
if [ -n "${REPEAT:-}" ]; then
  FLASHRL_DECODE_GEMM=0 rl "rl_step_${SHAPE}_cutlass_2" --configs int8+kv
  FLASHRL_DECODE_GEMM=$ROWS rl "rl_step_${SHAPE}_decode_gemm_2" --configs int8+kv
fi
