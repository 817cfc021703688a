#!/usr/bin/env bash
# Issue 45, SGLang's 14B row at verl's 0.5 (0.649x against 0.60x; its FP8 decode attention ~half the 8-bit step):
# flashrl's FP8 decode kernel with the next tile's K / V loads issued before this tile's attention (the compiled
# loop waited on each load before its dot: `benchmarks/decode_attn_variants.py` hpp2_hf_up / hpp2_hf_pf; both
# slower, and the package's copy of the prefetch, which the compiled test then ran, was dropped since), a GRPO group's
# shared prompt in the kernel's read, and the page-16 SGLang GPU tests and SGLang's step profile. After
# scripts/gpu_install.sh and gpu_install_sglang.sh (FA3 library staged). On 4 GPUs (~12 minutes); on 2 the lanes
# 0 + 2 and 1 + 3 share a GPU:
#   GPU 0  decode_attn_variants.py (14B, Qwen3-8B; 256 / 128 / 16 sequences); test_kernels.py's compiled FP8 decode
#          test; decode_attention.py 14B with and without --shared-prompt 1024
#   GPU 1  test_sglang_inflight.py in_place-int8, in_place-int8+kv@fa3attn16 and its kept-entries bound
#   GPU 2  test_sglang.py dense-int8 (flashrl's GEMM under `auto` vs plain SGLang), dense-int8+kv@fa3p16
#   GPU 3  step_profile.py --engine sglang --plain, 14B int8 + FP8 KV
#   setsid nohup bash scripts/gpu_job_prefetch.sh RES > /root/job.out 2>&1 < /dev/null &
# -> RES/dav*.{json,log}, RES/kernels.log, RES/da*.{json,log}, RES/t1, RES/t2 (gpu_tests.sh), RES/prof_sglang.*,
#    RES/SESSIONDONE
set -uo pipefail
RES=${1:?usage: gpu_job_prefetch.sh RES}
cd "$(dirname "$0")/.." || exit 1
source scripts/gpu_env.sh
export PYTHONUNBUFFERED=1
unset FLASHRL_DECODE_ATTN FLASHRL_DECODE_GEMM FLASHRL_FUSED_KV_STORE
mkdir -p "$RES"
SGL="/tmp/site_sgl_tf:/tmp/site_sgl:$PYTHONPATH"
N=$(nvidia-smi -L | wc -l)
G=tests/gpu
IF=$G/test_sglang_inflight.py
INFLIGHT="$IF::test_sglang_inflight_update[in_place-int8] $IF::test_sglang_inflight_update[in_place-int8+kv@fa3attn16]"
INFLIGHT+=" $IF::test_kept_fp8_entries_are_no_further_from_a_recompute_than_stale_kv_plus_the_fp8_floor[in_place-int8+kv@fa3attn16]"
SG=$G/test_sglang.py::test_sglang_sync_equals_a_fresh_engine
DENSE="$SG[dense-int8] $SG[dense-int8+kv@fa3p16]"
run() {  # run LOG CMD...: the command's output to RES/LOG, then its exit status
  "${@:2}" > "$RES/$1" 2>&1; echo "exit $?" >> "$RES/$1"
}
lane0() {
  export CUDA_VISIBLE_DEVICES=0
  run dav_package.log timeout 400 python3 benchmarks/decode_attn_variants.py --shapes 14b,qwen3-8b --batches 256,128,16 \
    --variants package,hpp2_hf --tiles 64:4:2 --json "$RES/dav_package.json"
  run dav_loads.log timeout 600 python3 benchmarks/decode_attn_variants.py --shapes 14b,qwen3-8b --batches 256,128,16 \
    --variants hpp2_hf_up,hpp2_hf_pf --tiles 64:4:2,32:4:2,64:8:2,128:8:2 --json "$RES/dav_loads.json"
  run kernels.log timeout 300 python3 -m pytest -rA -p no:cacheprovider tests/test_kernels.py -k fp8_decode_attention
  for shared in 0 1024; do
    run "da_shared$shared.log" timeout 300 python3 benchmarks/decode_attention.py --shapes 14b --batches 256,128 \
      --shared-prompt "$shared" --json "$RES/da_shared$shared.json"
  done
}
lane1() {
  CUDA_VISIBLE_DEVICES=$1 GPU_WORK=/root/w/gpu-$1 TEST_GROUPS="inflight:3:sglang:$INFLIGHT" \
    bash scripts/gpu_tests.sh "$RES/t1"
}
lane2() {
  CUDA_VISIBLE_DEVICES=$1 GPU_WORK=/root/w/gpu-$1b TEST_GROUPS="dense:2:sglang:$DENSE" bash scripts/gpu_tests.sh "$RES/t2"
}
lane3() {
  CUDA_VISIBLE_DEVICES=$1 PYTHONPATH=$SGL run prof_sglang.log timeout 900 python3 benchmarks/step_profile.py \
    --preset gpu --shapes 14b --configs int8+kv --plain --gpu-memory-utilization 0.5 --workdir "/root/w/prof-$1" \
    --engine sglang --attention-backend fa3 --json "$RES/prof_sglang.json"
}
if [ "$N" -ge 4 ]; then
  lane0 & lane1 1 & lane2 2 & lane3 3 &
else
  (lane0; lane2 0) & (lane1 1; lane3 1) &
fi
wait
touch "$RES/SESSIONDONE"
