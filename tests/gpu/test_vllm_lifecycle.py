"""Sleep mode, verl's and TRL's push orders and verl 0.9.1's own sync code, compiled engines (lifecycle.py
says what each case runs and checks). verl's code runs when verl is importable; the calibrated case when
FLASHRL_GPU_SQ points at a staged SmoothQuant profile (scripts/gpu_stage_sq.sh); `dense-int8+kv@xqa` under
FLASHRL_DECODE_ATTN=xqa with 40 sequences (their decode batches through XQA's kernel, asserted)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

import gpu_harness as h
import lifecycle

CASES = lifecycle.CASES + [f"{c}+kv" for c in lifecycle.CASES] + ["sq-int8", "dense-int8+kv@xqa"]
VERL = importlib.util.find_spec("verl") is not None
SQ = Path(os.environ["FLASHRL_GPU_SQ"]) if os.environ.get("FLASHRL_GPU_SQ") else None


@pytest.fixture(scope="module")
def rows(request, gpu_work, gpu_jobs) -> dict:
    cases = [c for c in h.selected(request, "case", CASES) if SQ is not None or not c.startswith("sq-")]
    rows = h.run_cases(lambda c: lifecycle.run_case(c, gpu_work, VERL, SQ), cases, gpu_jobs, "vllm_lifecycle",
                       engines="compiled (FULL_AND_PIECEWISE), sleep mode", verl_code=VERL)
    return rows


@pytest.mark.parametrize("case", CASES)
def test_lifecycle_stays_exact(rows, case):
    if case.startswith("sq-") and SQ is None:
        pytest.skip("FLASHRL_GPU_SQ is not set (the staged SmoothQuant profile: scripts/gpu_stage_sq.sh)")
    h.assert_exact(rows[case])
