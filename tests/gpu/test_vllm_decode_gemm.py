"""Issue 45's few-rows INT8 GEMM inside vLLM (runtime/vllm/decode_gemm.py), HF-initialised random Qwen2, one process
per engine (tests/probes/sync_probe.py), eager and compiled (CUDA graphs; vLLM's asynchronous scheduling at its
default, on): with FLASHRL_DECODE_GEMM=64, and with it unset (compiled: `auto`, 16 rows on Hopper, off elsewhere),
an engine synced to the perturbed weights equals a fresh vLLM engine on their INT8 checkpoint (CUTLASS for every
batch), greedy tokens and logprobs 0.0; the engine's log says whether the Triton path ran, as the switch and the GPU
say it must."""

from __future__ import annotations

import pytest
import torch

import gpu_harness as h

CASES = ["eager", "compiled", "default"]
HOPPER = (9, 0)


def run_case(case: str, work) -> dict:
    orig, pert = h.model_pair(work, "qwen2")
    ekw = {**h.VLLM_ENGINE, "enforce_eager": case == "eager"}
    env = {"FLASHRL_CONFIG": "int8", "FLASHRL_LOGGING_LEVEL": "INFO",
           "FLASHRL_DECODE_GEMM": "" if case == "default" else "64"}
    fresh = h.run_probe("sync_probe", work, f"dg-{case}-fresh", {},  # vLLM alone on the INT8 checkpoint: CUTLASS
                        {"model": str(h.quantized(pert, "int8", work)), "engine_kwargs": ekw})
    synced = h.run_probe("sync_probe", work, f"dg-{case}-synced", env,
                         {"model": str(orig), "push": [str(pert)], "push_device": "cuda", "engine_kwargs": ekw})
    if "error" in fresh or "error" in synced:
        return {"error": fresh.get("error") or synced.get("error"),
                "log_tail": fresh.get("log_tail") or synced.get("log_tail")}
    log = (work / f"dg-{case}-synced.log").read_text(errors="replace")
    start, pushed = synced["stages"][:2]
    return {"push_vs_fresh_cutlass": h.same(pushed, fresh["stages"][0]), "changed_by_sync": h.max_diff(start, pushed),
            "triton_path_ran": "through flashrl's Triton GEMM" in log, "async_scheduling": synced.get("async_scheduling"),
            "triton_path_expected": case != "default" or torch.cuda.get_device_capability() == HOPPER,
            "capability": list(torch.cuda.get_device_capability())}


@pytest.fixture(scope="module")
def rows(request, gpu_work, gpu_jobs) -> dict:
    return h.module_rows(request, CASES, run_case, gpu_work, gpu_jobs, "vllm_decode_gemm")


@pytest.mark.parametrize("case", CASES)
def test_decode_gemm_equals_cutlass_engine(rows, case):
    h.assert_exact(rows[case])
    assert rows[case]["triton_path_ran"] == rows[case]["triton_path_expected"], rows[case]
