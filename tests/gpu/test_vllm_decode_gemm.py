"""Issue 45's few-rows INT8 GEMM inside vLLM (FLASHRL_DECODE_GEMM=64, runtime/vllm/decode_gemm.py), HF-initialised
random Qwen2, one process per engine (tests/probes/sync_probe.py), eager and compiled (CUDA graphs; vLLM's
asynchronous scheduling at its default, on): with the switch on, an engine synced to the perturbed weights
equals a fresh vLLM engine on their INT8 checkpoint (CUTLASS for every batch), greedy tokens and logprobs 0.0;
the engine's log says the Triton path ran."""

from __future__ import annotations

import pytest

import gpu_harness as h

CASES = ["eager", "compiled"]


def run_case(case: str, work) -> dict:
    orig, pert = h.model_pair(work, "qwen2")
    ekw = {**h.VLLM_ENGINE, "enforce_eager": case == "eager"}
    env = {"FLASHRL_CONFIG": "int8"}
    fresh = h.run_probe("sync_probe", work, f"dg-{case}-fresh", {},  # vLLM alone on the INT8 checkpoint: CUTLASS
                        {"model": str(h.quantized(pert, "int8", work)), "engine_kwargs": ekw})
    synced = h.run_probe("sync_probe", work, f"dg-{case}-synced", {**env, "FLASHRL_DECODE_GEMM": "64"},
                         {"model": str(orig), "push": [str(pert)], "push_device": "cuda", "engine_kwargs": ekw})
    if "error" in fresh or "error" in synced:
        return {"error": fresh.get("error") or synced.get("error"),
                "log_tail": fresh.get("log_tail") or synced.get("log_tail")}
    log = (work / f"dg-{case}-synced.log").read_text(errors="replace")
    start, pushed = synced["stages"][:2]
    return {"push_vs_fresh_cutlass": h.same(pushed, fresh["stages"][0]), "changed_by_sync": h.max_diff(start, pushed),
            "triton_path_ran": "through flashrl's Triton GEMM" in log, "async_scheduling": synced.get("async_scheduling")}


@pytest.fixture(scope="module")
def rows(request, gpu_work, gpu_jobs) -> dict:
    return h.module_rows(request, CASES, run_case, gpu_work, gpu_jobs, "vllm_decode_gemm")


@pytest.mark.parametrize("case", CASES)
def test_decode_gemm_equals_cutlass_engine(rows, case):
    h.assert_exact(rows[case])
    assert rows[case]["triton_path_ran"], rows[case]
