"""SGLang's `update_weights_from_distributed` (slime's and verl's NCCL path; a gloo group on one GPU:
tests/probes/sglang_distributed_probe.py) with FLASHRL_CONFIG: per tensor, the originals back as one
flattened bucket, the perturbed weights as a bucket again, each vs a fresh engine on the offline
quantization of the same weights (0.0). HF-initialised random Qwen3."""

from __future__ import annotations

import importlib.util

import pytest

import gpu_harness as h
from test_sglang import FORMAT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed")
CASES = ["int8", "fp8", "int8+kv"]


def run_case(case: str, work) -> dict:
    config, kv = case.removesuffix("+kv"), "fp8" if case.endswith("+kv") else None
    orig, pert = h.model_pair(work, "qwen3")
    env = {"FLASHRL_CONFIG": config, **({"FLASHRL_KV_CACHE_DTYPE": kv} if kv else {})}
    got = h.run_probe("sglang_distributed_probe", work, f"dist-{case}", env,
                      {"original": str(orig), "perturbed": str(pert), "engine_kwargs": h.SGLANG_ENGINE})
    if "error" in got:
        return got
    fmt, fresh_config = FORMAT[config], "bf16" if kv else None
    fresh = {tag: h.run_sglang(h.quantized(src, fmt, work), [{"op": "observe", "sequences": h.SEQS, "max_tokens": 8}],
                               fresh_config, f"fresh {tag}", kv)
             for tag, src in (("original", orig), ("perturbed", pert))}
    if any(isinstance(v, str) for v in fresh.values()):
        return {"error": fresh}
    return {"start_vs_fresh": h.same(got["start"], fresh["original"][0]),
            "per_tensor_sync_vs_fresh": h.same(got["per_tensor"], fresh["perturbed"][0]),
            "bucket_restore_vs_start": h.same(got["bucket_restore"], got["start"]),
            "bucket_sync_vs_fresh": h.same(got["bucket"], fresh["perturbed"][0]),
            "changed_by_sync": h.max_diff(got["start"], got["per_tensor"]), "push_seconds": got["push_seconds"]}


@pytest.fixture(scope="module")
def rows(request, gpu_work, gpu_jobs) -> dict:
    cases = h.selected(request, "case", CASES)
    rows = h.run_cases(lambda c: run_case(c, gpu_work), cases, min(gpu_jobs, 3), "sglang_distributed", group_backend="gloo")
    return rows


@pytest.mark.parametrize("case", CASES)
def test_update_weights_from_distributed_equals_a_fresh_engine(rows, case):
    row = rows[case]
    assert "error" not in row, row
    assert h.failures(row) == []
