"""8-bit weights over the wire into SGLang (issue 43): the trainer's `flashrl_tools.wire.engine_tensors(...,
engine="sglang")` of the perturbed weights (int8, or per-channel FP8: what SGLang serves for `fp8`) pushed
through `update_weights_from_tensor` one tensor per call (a weight and its scale in separate calls), as
one flattened bucket after the originals were pushed back (BF16 beside them), and through
`update_weights_from_distributed` (int8 only: the probe's group is gloo, which has no FP8 type;
tests/probes/sglang_distributed_probe.py), per tensor and as a bucket. Each must equal a fresh engine on the
offline quantization of the perturbed weights (0.0: greedy tokens and teacher-forced logprobs; the
engine-side BF16 sync equals the same fresh engine, tests/gpu/test_sglang.py). With FLASHRL_GPU_SQ
(scripts/gpu_stage_sq.sh) also the calibrated YAML (`sq-int8`: SmolLM2's SmoothQuant W8A8 checkpoint + its
profile; the trainer converts with the profile behind `flashrl.converted`): per tensor and as a bucket it must
equal the same engine's engine-side sync of the BF16 weights (a calibrated engine serves its own checkpoint,
so there is no fresh engine on the perturbed weights to compare with)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

import gpu_harness as h
from test_sglang import FORMAT, observe

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed")
CASES = ["dense-int8", "dense-fp8", "moe-fp8"]
SQ = Path(os.environ["FLASHRL_GPU_SQ"]) if os.environ.get("FLASHRL_GPU_SQ") else None
CALIBRATED = ["sq-int8"]


def wire_checkpoint(work, orig, pert, config: str, tag: str | None = None):
    """The trainer's tensors for this config, saved as a checkpoint the probes push tensor by tensor (a calibrated
    config's `flashrl.converted` marker first: float32, it leads safetensors' order)."""
    from safetensors.torch import save_file

    from flashrl_tools.safetensors_io import CheckpointReader
    from flashrl_tools.wire import engine_tensors, wire_bytes

    out = work / f"{pert.name}-wire-{tag or config}"
    buckets = list(engine_tensors(CheckpointReader(pert).iter_tensors(), orig, config, engine="sglang"))
    if not (out / "model.safetensors").is_file():
        out.mkdir(parents=True, exist_ok=True)
        save_file({n: t.contiguous() for b in buckets for n, t in b}, str(out / "model.safetensors"))
    bf16 = sum(t.numel() * t.element_size() for _, t in CheckpointReader(pert).iter_tensors())
    return out, wire_bytes(buckets) / bf16


def run_calibrated(work) -> dict:
    from lifecycle import make_sq

    orig, pert, yaml = make_sq(work, SQ)[:3]
    wire, ratio = wire_checkpoint(work, orig, pert, str(yaml), tag="sq-int8")
    push = [{"op": "push", "path": str(p), "cuda": True, **({"bucket": True} if bucket else {})}
            for p, bucket in ((pert, False), (orig, False), (wire, False), (orig, False), (wire, True))]
    steps = [observe()] + [x for step in push for x in (step, observe())]
    synced = h.run_sglang(orig, steps, str(yaml), "wire sq-int8")
    if isinstance(synced, str):
        return {"error": synced}
    # one result per step: 0 start, 2 after the BF16 sync (engine-side), 4 restored, 6 the 8-bit push per tensor,
    # 8 restored again, 10 the 8-bit push as one bucket
    return {"wire_ratio": ratio, "changed_by_sync": h.max_diff(synced[0], synced[2]),
            "per_tensor_wire_vs_engine_side": h.same(synced[6], synced[2]),
            "bucket_wire_vs_engine_side": h.same(synced[10], synced[2]),
            "restore_vs_restore": h.same(synced[8], synced[4])}


def run_case(case: str, work) -> dict:
    if case in CALIBRATED:
        return run_calibrated(work)
    arch, config = case.split("-", 1)
    orig, pert = h.model_pair(work, "qwen3_moe" if arch == "moe" else "qwen3")
    wire, ratio = wire_checkpoint(work, orig, pert, config)
    steps = [observe(), {"op": "push", "path": str(wire), "cuda": True}, observe(),
             {"op": "push", "path": str(orig), "cuda": True, "bucket": True}, observe(),
             {"op": "push", "path": str(wire), "cuda": True, "bucket": True}, observe()]
    synced = h.run_sglang(orig, steps, config, f"wire {case}")
    if isinstance(synced, str):
        return {"error": synced}
    fresh = h.fresh_sglang(orig, pert, FORMAT[config], None, work)
    if "error" in fresh:
        return fresh
    row = {"wire_ratio": ratio, "start_vs_fresh": h.same(synced[0], fresh["original"]),
           "per_tensor_wire_vs_fresh": h.same(synced[2], fresh["perturbed"]),
           "bf16_bucket_restore_vs_start": h.same(synced[4], synced[0]),
           "bucket_wire_vs_fresh": h.same(synced[6], fresh["perturbed"]),
           "changed_by_sync": h.max_diff(synced[0], synced[2])}
    if case == "dense-int8":  # update_weights_from_distributed: the probe's group is gloo (one GPU), which has no
        # FP8 type ("Invalid scalar type", H200 2026-11-25); the probe serves the dense Qwen3
        got = h.run_probe("sglang_distributed_probe", work, f"wire-dist-{case}", {"FLASHRL_CONFIG": config},
                          {"original": str(orig), "perturbed": str(wire), "engine_kwargs": h.SGLANG_ENGINE})
        if "error" in got:
            return got
        row.update(distributed_per_tensor_vs_fresh=h.same(got["per_tensor"], fresh["perturbed"]),
                   distributed_bucket_vs_fresh=h.same(got["bucket"], fresh["perturbed"]))
    return row


@pytest.fixture(scope="module")
def rows(request, gpu_work, gpu_jobs) -> dict:
    return h.module_rows(request, CASES + (CALIBRATED if SQ else []), run_case, gpu_work, min(gpu_jobs, 3),
                         "sglang_wire")


@pytest.mark.parametrize("case", CASES)
def test_trainer_quantized_updates_equal_a_fresh_engine(rows, case):
    h.assert_exact(rows[case])


@pytest.mark.skipif(SQ is None, reason="FLASHRL_GPU_SQ is not set (the staged SmoothQuant profile: scripts/gpu_stage_sq.sh)")
@pytest.mark.parametrize("case", CALIBRATED)
def test_a_calibrated_yaml_over_the_wire_equals_an_engine_side_sync(rows, case):
    h.assert_exact(rows[case])
