#!/usr/bin/env bash
# On the lent GPU host (device tool), after install-vllm-bundle.sh unpacked vLLM 0.26 to /tmp/site:
# register flashrl_tools' vLLM and SGLang plugins without pip (a stub dist-info with its entry point).
# Usage: source scripts/gpu_env.sh   (from the repository root)
mkdir -p /tmp/site/flashrl_tools-0.1.0.dist-info
printf 'Metadata-Version: 2.1\nName: flashrl_tools\nVersion: 0.1.0\n' > /tmp/site/flashrl_tools-0.1.0.dist-info/METADATA
printf '[vllm.general_plugins]\nflashrl = flashrl_tools.runtime.vllm.plugin:register\n\n[sglang.srt.plugins]\nflashrl = flashrl_tools.runtime.sglang.plugin:register\n' \
  > /tmp/site/flashrl_tools-0.1.0.dist-info/entry_points.txt
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 FLASHRL_HOME=/tmp/flashrl_home
# NVLink multicast stays off (the lent hosts' rule; kept where a test builds its own environment from this one)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# With multicast off, vLLM 0.26's compiled TP = 2 engines faulted here (2 x H200, 2026-11-30: "illegal memory access"
# in the first forward of every fresh one; eager TP = 2 engines had run before). Both of its multicast-capable choices
# are turned off -- the torch symmetric-memory all-reduce and FlashInfer's auto-picked `mnnvl` backend of the all-reduce
# + RMSNorm fusion (which one faulted was not isolated) -- and the IPC-based ones (`trtllm`, vLLM's custom) ran.
export VLLM_ALLREDUCE_USE_SYMM_MEM=0 VLLM_FLASHINFER_ALLREDUCE_BACKEND=trtllm
