"""8-bit weights over the wire into vLLM on the GPU (issue 43; tests/probes/wire_probe.py): the trainer (the
probe's process, new weights on the GPU) quantizes with `flashrl_tools.wire.engine_tensors` and pushes the
int8 / fp8 tensors and their scales through `load_weights` (collective_rpc, buckets) and vLLM's CUDA-IPC
weight-transfer engine, unpacked and packed, into an engine in its own process. Each path, after the
original weights were pushed back, must equal the engine-side sync of the BF16 weights bit for bit (weight
digest: every parameter, buffer and kernel-held tensor; greedy tokens; teacher-forced logprobs); BF16 over
IPC too; a scale of the wrong shape is refused in one line. Cases: dense Qwen2 and Qwen3-MoE x int8 and
per-channel FP8 (vLLM's `fp8` shortcut is its own online FP8: the trainer refuses it), and (issue 75) W4A16 --
dense, the 4/8-bit mix (`w4a16_mix`), MoE experts -- as packed codes, group scales and shapes. On two GPUs also: the
same through vLLM's NCCL engine from a trainer on GPU 1, and a TP = 2 engine sharding the 8-bit tensors and
scales it takes through load_weights (its digests, one per rank, = its engine-side sync's). With FLASHRL_GPU_SQ
(scripts/gpu_stage_sq.sh) also a calibrated YAML (`sq-int8`: SmolLM2's SmoothQuant W8A8 checkpoint and its
profile, the trainer quantizing with the profile): its checkpoint is not the profile applied to the originals,
so there the restores must equal the engine-side restore instead of the start. Each prompt is observed in a
`generate` call of its own (the multiprocess engine core batches two prompts of one call by timing, and the 4-bit
kernels' bits likely depend on the batch: wire_probe.py), and the start twice (an observation must repeat). Also recorded: bytes
on the wire vs BF16, the trainer's quantize time and each push's time (tiny models: the 7B-32B figures
are benchmarks/wire_sync.py's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpu_harness as h

CASES = ["dense-int8", "dense-fp8_channel", "moe-int8", "moe-fp8_channel",
         "dense-w4a16", "dense-w4a16_mix", "moe-w4a16"]  # issue 75: 4-bit codes + group scales + shapes, the mix
# two GPUs: `nccl-`: the trainer on GPU 1 through vLLM's NCCL engine (unpacked, packed, BF16); `tp2-`: a TP = 2
# engine takes the 8-bit tensors and scales through load_weights and shards them (where prime-rl's broke)
TWO_GPUS = torch.cuda.device_count() >= 2
TWO = ["nccl-dense-int8", "nccl-dense-fp8_channel", "nccl-moe-fp8_channel", "tp2-dense-int8",
       "tp2-dense-fp8_channel", "tp2-moe-int8"]
PATHS = {"": "load_weights,ipc,ipc-packed,ipc-bf16", "nccl": "load_weights,nccl,nccl-packed,nccl-bf16",
         "tp2": "load_weights"}
SQ = Path(os.environ["FLASHRL_GPU_SQ"]) if os.environ.get("FLASHRL_GPU_SQ") else None
CALIBRATED = ["sq-int8"]


def run_case(case: str, work) -> dict:
    sys.path.insert(0, str(h.PROBES))
    from wire_probe import differences, verdict

    how = case.split("-", 1)[0] if case.startswith(("nccl-", "tp2-")) else ""
    arch, config = case.removeprefix(f"{how}-").split("-", 1)
    engine = {**h.VLLM_ENGINE, **({"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
                                  if how == "tp2" else {})}
    if arch == "sq":  # the calibrated YAML (SmoothQuant checkpoint + profile) on SmolLM2
        from lifecycle import make_sq

        orig, pert, yaml, _, _ = make_sq(work, SQ)
        value = str(yaml)
    else:
        orig, pert = h.model_pair(work, "qwen3_moe" if arch == "moe" else "qwen2")
        value = h.config_value(work, config)
    env = {k: v for k, v in os.environ.items() if k not in ("FLASHRL_CONFIG", "FLASHRL_KV_CACHE_DTYPE")}
    env.update(FLASHRL_CONFIG=value, VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    out = work / f"wire-{case}.json"
    res = subprocess.run([sys.executable, str(h.PROBES / "wire_probe.py"), str(orig), str(pert), str(out),
                          "--paths", PATHS[how], "--engine-args", json.dumps(engine), "--one-prompt-per-call",
                          *(["--no-refusal"] if how == "tp2" or config == "w4a16" else []),  # no 8-bit tensor
                          *(["--kernel-values", "moe_quant_config"] if arch == "moe" else [])],
                         capture_output=True, text=True, env=env,
                         timeout=900)
    if res.returncode != 0 or not out.is_file():
        return {"error": f"exit {res.returncode}", "log_tail": (res.stdout + res.stderr)[-4000:]}
    result = json.loads(out.read_text())
    checks = verdict(result)
    stages = {s["tag"]: s for s in result["stages"]}
    restored = "start"
    if arch == "sq":  # the restores (originals pushed back) = the engine-side restore, not the calibrated start
        restored = "restore-engine-side"
        checks = {k: ok for k, ok in checks.items() if not k.startswith("restore-")}
        for tag in stages:
            if tag.startswith("restore-") and tag != restored:
                checks[f"{tag} = {restored}"] = not any(differences(stages[tag], stages[restored]).values())
    diffs = {tag: differences(stages[tag], stages[restored if tag.startswith("restore-") else "engine-side"])
             for tag in stages if tag not in ("start", "engine-side", restored)}
    return {"checks": checks, "failures": [k for k, ok in checks.items() if not ok], "bytes": result["bytes"],
            "differences": {t: d for t, d in diffs.items() if any(d.values())},
            # MoE: per stage and rank, the quant config's scale copies that are not the layer's scales
            "moe_config_scales_not_the_params": {s["tag"]: [sorted(n for n, v in rank.items() if not v["equals_param"])
                                                            for rank in s["kernel_values"]]
                                                 for s in result["stages"] if "kernel_values" in s},
            # ... and how many are tensors of their own per stage and rank (the rest: the parameters themselves)
            "moe_config_scale_copies": {s["tag"]: [len(rank) for rank in s["kernel_values"]]
                                        for s in result["stages"] if "kernel_values" in s},
            "async_scheduling": h.async_scheduling(res.stdout + res.stderr),
            "wire_ratio": result["bytes"]["wire"] / result["bytes"]["bf16"],
            "trainer_quantize_s": result["trainer_quantize_s"], "refusal": result.get("refusal"),
            "push_seconds": {s["tag"]: s["seconds"] for s in result["stages"] if s["seconds"] is not None}}


@pytest.fixture(scope="module")
def rows(request, gpu_work, gpu_jobs) -> dict:
    cases = CASES + (TWO if TWO_GPUS else []) + (CALIBRATED if SQ else [])
    return h.module_rows(request, cases, run_case, gpu_work, gpu_jobs, "vllm_wire",
                         engines=f"eager, multiprocess engine core, IPC weight transfer, {h.VLLM_ENGINE}")


@pytest.mark.parametrize("case", CASES)
def test_trainer_quantized_pushes_equal_an_engine_side_sync(rows, case):
    row = rows[case]
    h.assert_exact(row)
    if case.endswith("-w4a16"):  # every linear 4-bit: its wire is <= 0.28x BF16's on the quantized layers
        assert row["wire_ratio"] < 0.4, row["wire_ratio"]
    assert {"load_weights = engine-side sync", "ipc = engine-side sync", "ipc-packed = engine-side sync",
            "ipc-bf16 = engine-side sync", "the start observed twice = itself"} <= set(row["checks"]), row


@pytest.mark.skipif(not TWO_GPUS, reason="NCCL and TP = 2 need two GPUs")
@pytest.mark.parametrize("case", TWO)
def test_two_gpu_paths_equal_an_engine_side_sync(rows, case):
    row = rows[case]
    h.assert_exact(row)
    want = {"load_weights = engine-side sync"} | ({"nccl = engine-side sync", "nccl-packed = engine-side sync",
                                                   "nccl-bf16 = engine-side sync"} if case.startswith("nccl") else set())
    assert want <= set(row["checks"]), row


@pytest.mark.skipif(SQ is None, reason="FLASHRL_GPU_SQ is not set (the staged SmoothQuant profile: scripts/gpu_stage_sq.sh)")
@pytest.mark.parametrize("case", CALIBRATED)
def test_a_calibrated_yaml_over_the_wire_equals_an_engine_side_sync(rows, case):
    row = rows[case]
    h.assert_exact(row)
    assert {"load_weights = engine-side sync", "ipc = engine-side sync", "ipc-packed = engine-side sync",
            "restore-load_weights = restore-engine-side"} <= set(row["checks"]), row
