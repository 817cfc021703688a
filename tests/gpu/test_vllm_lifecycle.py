"""Sleep mode, verl's and TRL's push orders and verl 0.9.1's own sync code, compiled engines (lifecycle.py
says what each case runs and checks). verl's code runs when verl is importable; the calibrated case when
FLASHRL_GPU_SQ points at a staged SmoothQuant profile (scripts/gpu_stage_sq.sh); `dense-int8+kv@xqa` under
FLASHRL_DECODE_ATTN=xqa with 40 sequences (their decode batches through XQA's kernel, asserted). `@tp2` (issue 76;
two GPUs): both engines tensor-parallel over two GPUs (MoE: experts parallel), verl's own code a trainer per rank;
every rank's digest and FP8 KV scales compared."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

import gpu_harness as h
import lifecycle

CASES = lifecycle.CASES + [f"{c}+kv" for c in lifecycle.CASES] + ["sq-int8", "dense-int8+kv@xqa"]
TP2 = ["dense-int8+kv@tp2", "dense-fp8+kv@tp2", "dense-fp8_block+kv@tp2", "moe-int8@tp2", "moe-fp8@tp2"]
VERL = importlib.util.find_spec("verl") is not None
SQ = Path(os.environ["FLASHRL_GPU_SQ"]) if os.environ.get("FLASHRL_GPU_SQ") else None


@pytest.fixture(scope="module")
def rows(request, gpu_work, gpu_jobs) -> dict:
    cases = [c for c in h.selected(request, "case", CASES + TP2) if (SQ is not None or not c.startswith("sq-"))
             and (h.TWO_GPUS or not c.endswith("@tp2"))]
    rows = h.run_cases(lambda c: lifecycle.run_case(c, gpu_work, VERL, SQ), cases, gpu_jobs, "vllm_lifecycle",
                       engines="compiled (FULL_AND_PIECEWISE), sleep mode", verl_code=VERL)
    return rows


@pytest.mark.parametrize("case", CASES)
def test_lifecycle_stays_exact(rows, case):
    if case.startswith("sq-") and SQ is None:
        pytest.skip("FLASHRL_GPU_SQ is not set (the staged SmoothQuant profile: scripts/gpu_stage_sq.sh)")
    h.assert_exact(rows[case])


@pytest.mark.skipif(not h.TWO_GPUS, reason="TP = 2 needs two GPUs")
@pytest.mark.parametrize("case", TP2)
def test_lifecycle_stays_exact_at_tp2(rows, case):
    row = rows[case]
    h.assert_exact(row)
    assert row["tensor_parallel_size"] == [2, 2]
