"""Issue 45's few-rows INT8 GEMM inside vLLM (runtime/vllm/decode_gemm.py), HF-initialised random Qwen2, one process
per engine (tests/probes/sync_probe.py), eager and compiled (CUDA graphs; vLLM's asynchronous scheduling at its
default, on): with FLASHRL_DECODE_GEMM=64, and with it unset (compiled: `auto`, 16 rows on Hopper, off elsewhere),
an engine synced to the perturbed weights equals a fresh vLLM engine on their INT8 checkpoint (CUTLASS for every
batch), greedy tokens and logprobs 0.0; the engine's log says whether the Triton path ran, as the switch and the GPU
say it must. `fused` (compiled, FLASHRL_FUSE_ACT_QUANT=1: activations quantized by torch ops that Inductor fuses):
the synced engine equals a fresh engine with the same switch on the INT8 checkpoint (0.0); its distance from vLLM's
own quantization is recorded."""

from __future__ import annotations

import pytest
import torch

import gpu_harness as h

CASES = ["eager", "compiled", "default", "fused"]
HOPPER = (9, 0)


def run_case(case: str, work) -> dict:
    orig, pert = h.model_pair(work, "qwen2")
    ekw = {**h.VLLM_ENGINE, "enforce_eager": case == "eager"}
    fused = {"FLASHRL_FUSE_ACT_QUANT": "1"} if case == "fused" else {}
    env = {"FLASHRL_CONFIG": "int8", "FLASHRL_LOGGING_LEVEL": "INFO",
           "FLASHRL_DECODE_GEMM": "" if case in ("default", "fused") else "64", **fused}
    checkpoint = {"model": str(h.quantized(pert, "int8", work)), "engine_kwargs": ekw}
    fresh = h.run_probe("sync_probe", work, f"dg-{case}-fresh", {}, checkpoint)  # vLLM alone: CUTLASS, its quant
    synced = h.run_probe("sync_probe", work, f"dg-{case}-synced", env,
                         {"model": str(orig), "push": [str(pert)], "push_device": "cuda", "engine_kwargs": ekw})
    same_switch = h.run_probe("sync_probe", work, f"dg-{case}-fresh-switch", {"FLASHRL_CONFIG": "bf16", **fused},
                              checkpoint) if fused else fresh  # bf16: the runtime serves the checkpoint unchanged
    if any("error" in r for r in (fresh, synced, same_switch)):
        bad = next(r for r in (fresh, synced, same_switch) if "error" in r)
        return {"error": bad["error"], "log_tail": bad.get("log_tail")}
    log = (work / f"dg-{case}-synced.log").read_text(errors="replace")
    start, pushed = synced["stages"][:2]
    row = {"push_vs_fresh": h.same(pushed, same_switch["stages"][0]), "changed_by_sync": h.max_diff(start, pushed),
           "triton_path_ran": "through flashrl's Triton GEMM" in log, "async_scheduling": synced.get("async_scheduling"),
           "triton_path_expected": case not in ("default", "fused") or torch.cuda.get_device_capability() == HOPPER,
           "capability": list(torch.cuda.get_device_capability())}
    if fused:
        row["fused_quant_ran"] = "quantized by torch ops" in log
        row["fused_vs_vllm_quant_max_logprob_diff"] = h.max_diff(pushed, fresh["stages"][0])
    return row


@pytest.fixture(scope="module")
def rows(request, gpu_work, gpu_jobs) -> dict:
    return h.module_rows(request, CASES, run_case, gpu_work, gpu_jobs, "vllm_decode_gemm")


@pytest.mark.parametrize("case", CASES)
def test_decode_gemm_equals_cutlass_engine(rows, case):
    h.assert_exact(rows[case])
    assert rows[case]["triton_path_ran"] == rows[case]["triton_path_expected"], rows[case]
    assert rows[case].get("fused_quant_ran", True), rows[case]  # the fused case: the torch-ops quantization ran
