#!/usr/bin/env bash
# The GPU tests (tests/gpu/) on the lent offline host, after scripts/gpu_install.sh (and, for SGLang,
# scripts/gpu_install_sglang.sh), in groups side by side, each its own pytest process (SGLang needs its
# pinned transformers first on the path; vLLM keeps the host's):
#   setsid nohup bash scripts/gpu_tests.sh /root/res > /root/res/tests.out 2>&1 < /dev/null &
# -> RES/gpu/*.json (results, rewritten as each case finishes), RES/<group>.log (pytest -rA),
#    RES/session.log, RES/SESSIONDONE. TEST_GROUPS: "name:jobs:sglang|vllm:node ids ..." per line (below).
set -uo pipefail
RES=${1:?usage: gpu_tests.sh RES}
cd "$(dirname "$0")/.." || exit 1
source scripts/gpu_env.sh
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=2 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
  FLASHRL_GPU_RESULTS=$RES/gpu FLASHRL_GPU_WORK=${GPU_WORK:-/root/w/gpu}
mkdir -p "$RES/gpu" "$FLASHRL_GPU_WORK"
T0=$(date +%s); log() { echo "[$(( $(date +%s) - T0 ))s] $*" >> "$RES/session.log"; }
G=tests/gpu
TEST_GROUPS=${TEST_GROUPS:-"lifecycle:6:vllm:$G/test_vllm_lifecycle.py
vllm:4:vllm:$G/test_vllm_runtime.py $G/test_vllm_moe.py $G/test_vllm_async_kv.py
sglang:3:sglang:$G/test_sglang.py
sglang-paths:2:sglang:$G/test_sglang_distributed.py $G/test_verl_sglang.py"}
# models once, before the groups start side by side
python3 -c "import sys; sys.path.insert(0, '$G'); import gpu_harness as h; from pathlib import Path
for a in ('qwen2', 'qwen3', 'qwen3_moe', 'mixtral'): h.model_pair(Path('$FLASHRL_GPU_WORK'), a)" >> "$RES/session.log" 2>&1
pids=()
while IFS=: read -r name jobs engine tests; do
  [ -n "$name" ] || continue
  path=$PYTHONPATH; [ "$engine" = sglang ] && path=/tmp/site_sgl_tf:/tmp/site_sgl:$PYTHONPATH
  log "start $name: $tests"
  # shellcheck disable=SC2086
  (PYTHONPATH=$path FLASHRL_GPU_JOBS=$jobs python3 -m pytest -rA -n 0 -p no:cacheprovider $tests > "$RES/$name.log" 2>&1
   log "end $name rc=$?") &
  pids+=($!)
done <<< "$TEST_GROUPS"
wait "${pids[@]}"
log "all done"; touch "$RES/SESSIONDONE"
