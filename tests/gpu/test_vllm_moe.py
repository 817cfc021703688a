"""8-bit and 4-bit (w4a16: Marlin's WNA16 MoE) MoE experts on a GPU (vLLM): HF-initialised random Qwen3-MoE and
Mixtral models, eager engines.
Per FLASHRL_CONFIG: the perturbed BF16 weights pushed with checkpoint names (one tensor per call, GPU
tensors), with the trainer's in-memory names (transformers 5's fused expert tensors), and through vLLM's
`reload_weights`, each vs a fresh engine started on the perturbed weights with the same config (which
quantizes them at start); the original weights pushed back vs the start. All exact (0.0)."""

from __future__ import annotations

import pytest

import gpu_harness as h

CASES = [f"{arch}-{config}" for arch in ("qwen3_moe", "mixtral")
         for config in ("bf16", "int8", "fp8", "fp8_channel", "fp8_block", "w4a16")]


def run_case(case: str, work) -> dict:
    arch, config = case.split("-", 1)
    orig, pert = h.model_pair(work, arch)
    env = {"FLASHRL_CONFIG": h.config_value(work, config)}
    ekw = dict(h.VLLM_ENGINE)
    fresh = h.run_probe("sync_probe", work, f"moe-{case}-fresh", env, {"model": str(pert), "engine_kwargs": ekw})
    synced = h.run_probe("sync_probe", work, f"moe-{case}-synced", env,
                         {"model": str(orig), "push": [str(pert), str(orig)], "push_trainer": [str(pert)],
                          "reload": [str(pert)], "push_device": "cuda", "engine_kwargs": ekw})
    if "error" in fresh or "error" in synced:
        return {"error": fresh.get("error") or synced.get("error"),
                "log_tail": fresh.get("log_tail") or synced.get("log_tail")}
    f = fresh["stages"][0]
    start, pushed, restored, trainer, reloaded = synced["stages"]
    return {"checkpoint_names_vs_fresh": h.same(pushed, f), "trainer_fused_names_vs_fresh": h.same(trainer, f),
            "reload_weights_vs_fresh": h.same(reloaded, f), "restored_vs_start": h.same(restored, start),
            "changed_by_sync": h.max_diff(start, pushed), "sync_s": pushed.get("seconds"),
            "trainer_sync_s": trainer.get("seconds"), "inplace_layers": synced.get("inplace_layers")}


@pytest.fixture(scope="module")
def rows(request, gpu_work, gpu_jobs) -> dict:
    return h.module_rows(request, CASES, run_case, gpu_work, gpu_jobs, "vllm_moe", engines="eager")


@pytest.mark.parametrize("case", CASES)
def test_moe_sync_equals_a_fresh_engine(rows, case):
    h.assert_exact(rows[case])
