"""SGLang's `update_weights_from_distributed` (slime's and verl's NCCL path; a gloo group on one GPU:
tests/probes/sglang_distributed_probe.py) with FLASHRL_CONFIG: per tensor, the originals back as one
flattened bucket, the perturbed weights as a bucket again, each vs a fresh engine on the offline
quantization of the same weights (0.0). HF-initialised random Qwen3. `@tp2` (issue 76; two GPUs): both engines at
TP = 2, the group of the trainer and both schedulers (gloo), every rank's FP8 KV scales."""

from __future__ import annotations

import importlib.util

import pytest

import gpu_harness as h
from test_sglang import FORMAT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed")
CASES = ["int8", "fp8", "int8+kv"]
TP2 = ["int8+kv@tp2", "fp8@tp2"]


def run_case(case: str, work) -> dict:
    got, fresh = h.sglang_probe_case("sglang_distributed_probe", case, work, FORMAT)
    if "error" in got:
        return got
    return {"start_vs_fresh": h.same(got["start"], fresh["original"]),
            "per_tensor_sync_vs_fresh": h.same(got["per_tensor"], fresh["perturbed"]),
            "bucket_restore_vs_start": h.same(got["bucket_restore"], got["start"]),
            "bucket_sync_vs_fresh": h.same(got["bucket"], fresh["perturbed"]),
            "changed_by_sync": h.max_diff(got["start"], got["per_tensor"]), "push_seconds": got["push_seconds"]}


@pytest.fixture(scope="module")
def rows(request, gpu_work, gpu_jobs) -> dict:
    return h.module_rows(request, CASES + (TP2 if h.TWO_GPUS else []), run_case, gpu_work, min(gpu_jobs, 3),
                         "sglang_distributed", group_backend="gloo")


@pytest.mark.parametrize("case", CASES)
def test_update_weights_from_distributed_equals_a_fresh_engine(rows, case):
    h.assert_exact(rows[case])


@pytest.mark.skipif(not h.TWO_GPUS, reason="TP = 2 needs two GPUs")
@pytest.mark.parametrize("case", TP2)
def test_update_weights_from_distributed_equals_a_fresh_engine_at_tp2(rows, case):
    h.assert_exact(rows[case])
