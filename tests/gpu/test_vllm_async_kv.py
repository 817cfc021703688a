"""vLLM's AsyncLLM (verl's async rollout server, `vllm serve`) with the FP8 KV cache, synced by a trainer
through `collective_rpc` (tests/probes/async_kv_probe.py): the first requests after a sync wait for one
recalibration; scales and outputs after syncing away and back equal the fresh engine's (bit-equal); the
weights discarded (sleep level 2) are refused in the front end, and a full push brings the outputs back.
AsyncLLM's engine core always runs in its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import gpu_harness as h

CASES = ["int8-eager", "int8-compiled", "fp8-eager", "bf16-compiled"]


def run_case(case: str, work) -> dict:
    config, mode = case.split("-")
    orig, pert = h.model_pair(work, "qwen2")
    env = {k: v for k, v in os.environ.items() if k not in ("FLASHRL_CONFIG", "FLASHRL_KV_CACHE_DTYPE")}
    env.update(FLASHRL_CONFIG=config, FLASHRL_KV_CACHE_DTYPE="fp8", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    args = [sys.executable, str(h.PROBES / "async_kv_probe.py"), str(orig), str(pert),
            "--engine-args", json.dumps(h.VLLM_ENGINE), "--prompt", json.dumps(h.SEQS[0][:6])] + \
        (["--eager"] if mode == "eager" else [])
    res = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT")), None)
    if line is None:
        return {"error": f"exit {res.returncode}", "log_tail": (res.stdout + res.stderr)[-4000:]}
    result = json.loads(line[len("RESULT"):])
    row = {"checks": result["checks"], "failures": [k for k, ok in result["checks"].items() if not ok],
           "async_scheduling": h.async_scheduling(res.stdout + res.stderr)}
    h.expect_decode_attn(row, [h.DECODE_ATTN_LINE in res.stdout + res.stderr])
    return row


@pytest.fixture(scope="module")
def rows(request, gpu_work, gpu_jobs) -> dict:
    return h.module_rows(request, CASES, run_case, gpu_work, gpu_jobs, "vllm_async_kv")


@pytest.mark.parametrize("case", CASES)
def test_async_engine_recalibrates_once_per_sync(rows, case):
    h.assert_exact(rows[case])  # every check of the probe true
