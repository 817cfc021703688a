#!/usr/bin/env bash
# Issues 42 + 43 on the lent GPU host (two GPUs for the NCCL / TP = 2 cases; one GPU runs the rest): the vLLM
# wire paths (load_weights, CUDA IPC, NCCL, TP = 2), vLLM in-flight updates through IPC / NCCL, SGLang's pause
# modes and its 8-bit update paths. After scripts/gpu_install.sh and gpu_install_sglang.sh:
#   setsid nohup bash scripts/gpu_job_wire_inflight.sh /root/res > /root/res/job.out 2>&1 < /dev/null &
set -uo pipefail
RES=${1:?usage: gpu_job_wire_inflight.sh RES}
G=tests/gpu
I="$G/test_vllm_inflight.py::test_inflight_update"
TEST_GROUPS="vwire:4:vllm:$G/test_vllm_wire.py
vinflight:4:vllm:$I[keep-int8-ipc=wire] $I[abort-int8+kv-ipc=wire-packed] $I[keep-fp8-ipc=bf16-packed] $I[keep-moe-fp8-ipc=bf16] $G/test_vllm_inflight.py::test_inflight_update_over_nccl
sinflight:3:sglang:$G/test_sglang_inflight.py
swire:2:sglang:$G/test_sglang_wire.py" bash "$(dirname "$0")/gpu_tests.sh" "$RES"
