"""verl 0.9.1's SGLang rollout path (tests/probes/verl_sglang_probe.py: verl's HTTP server adapter and its
weight sync, hybrid mode: memory saver, weights CPU backup, dummy load) with FLASHRL_CONFIG: the original
weights pushed, the perturbed, then a sleep / wake without a push (the CPU backup keeps the synced 8-bit
weights), each vs a fresh plain engine on the offline quantization of the same weights (0.0, greedy tokens
and their decode logprobs included). `+kv`: the FP8 KV cache, recalibrated by the server after each push."""

from __future__ import annotations

import importlib.util

import pytest

import gpu_harness as h
from test_sglang import FORMAT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None or importlib.util.find_spec("verl") is None,
                                reason="SGLang and verl are not both installed")
CASES = ["int8", "fp8", "int8+kv"]


def run_case(case: str, work) -> dict:
    config, kv = case.removesuffix("+kv"), "fp8" if case.endswith("+kv") else None
    orig, pert = h.model_pair(work, "qwen3")
    env = {"FLASHRL_CONFIG": config, **({"FLASHRL_KV_CACHE_DTYPE": kv} if kv else {})}
    got = h.run_probe("verl_sglang_probe", work, f"verl-sglang-{case}", env,
                      {"original": str(orig), "perturbed": str(pert), "engine_kwargs": h.SGLANG_ENGINE})
    if "error" in got:
        return got
    fmt, fresh_config = FORMAT[config], "bf16" if kv else None
    observe = {"op": "observe", "sequences": h.SEQS, "max_tokens": 8}
    fresh = {tag: h.run_sglang(h.quantized(src, fmt, work), [observe], fresh_config, f"fresh {tag}", kv)
             for tag, src in (("original", orig), ("perturbed", pert))}
    if any(isinstance(v, str) for v in fresh.values()):
        return {"error": fresh}
    return {"original_vs_fresh": h.same(got["original"], fresh["original"][0]),
            "perturbed_vs_fresh": h.same(got["perturbed"], fresh["perturbed"][0]),
            "wake_without_push_vs_fresh": h.same(got["wake_without_push"], fresh["perturbed"][0]),
            "changed_by_sync": h.max_diff(got["original"], got["perturbed"]), "push_seconds": got["push_seconds"]}


@pytest.fixture(scope="module")
def rows(request, gpu_work, gpu_jobs) -> dict:
    cases = h.selected(request, "case", CASES)
    rows = h.run_cases(lambda c: run_case(c, gpu_work), cases, min(gpu_jobs, 3), "verl_sglang")
    return rows


@pytest.mark.parametrize("case", CASES)
def test_verls_sglang_path_equals_a_fresh_engine(rows, case):
    row = rows[case]
    assert "error" not in row, row
    assert h.failures(row) == []
