"""In-flight weight updates on vLLM's AsyncLLM (asynchronous RL, issue 42; tests/probes/inflight_probe.py):
requests decoding, `pause_generation(mode, clear_cache)`, the perturbed weights pushed one tensor per
`load_weights` (collective_rpc; `-ipc=`: vLLM's CUDA-IPC engine, BF16 or trainer-quantized 8-bit, packed or
not), `resume_generation`. Cases: mode x config (`+kv`: FP8 KV cache, `moe-`:
Qwen3-MoE, `-compiled`: CUDA graphs and torch.compile, else eager). Each asserts the probe's checks: the
resume refused mid-push, a request sent during the pause waits, kept requests finish / aborted ones say
so, a request after the drain and every resubmission (prompt + partial tokens) equal a fresh engine on
the new weights bit for bit, FP8 KV scales bit-equal. Requests that ran beside kept ones are compared too
(reported: bit-equal only where the kernels do not depend on the batch). With an FP8 KV cache, keep mode
must not drain: the first token of a request sent right after the resume within 1.5x of the same config
without the FP8 KV cache, with kept requests still in flight, and the kept requests no further from a
recompute than the BF16-KV engine's stale-KV effect plus the FP8 cache's own effect on the same tokens.
vLLM's asynchronous scheduling is on (its default; recorded per case). Also: the KV-cache layout the
rescale assumes is where vLLM's own cache write puts K and V, per GPU attention backend."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpu_harness as h

KEEP = ["keep-bf16", "keep-int8", "keep-fp8", "keep-w4a16", "keep-w4a16_mix", "keep-int8+kv", "keep-moe-fp8",
        "keep-int8+kv-compiled", "keep-int8-compiled"]
# `-ipc=HOW`: the full push from the probe's GPU through vLLM's CUDA-IPC weight-transfer engine (the engine core
# in its own process): BF16, or the trainer's 8-bit tensors (`wire`: flashrl_tools.wire), packed or not
IPC = ["keep-int8-ipc=wire", "abort-int8+kv-ipc=wire-packed", "keep-fp8-ipc=bf16-packed", "keep-moe-fp8-ipc=bf16"]
# `-nccl=HOW` (two GPUs): the same through vLLM's NCCL engine, the probe the trainer on GPU 1
NCCL = ["keep-int8-nccl=wire-packed", "abort-int8+kv-nccl=wire", "keep-moe-fp8-nccl=bf16"]
TWO_GPUS = torch.cuda.device_count() >= 2
RAY = importlib.util.find_spec("ray") is not None  # vLLM 0.26's IPC weight-transfer engine imports ray at start
# `sq-int8` (FLASHRL_GPU_SQ: scripts/gpu_stage_sq.sh): the calibrated YAML (SmoothQuant checkpoint + profile on
# SmolLM2, tests/gpu/lifecycle.py make_sq); compared with the same engine synced with nothing in flight
SQ = Path(os.environ["FLASHRL_GPU_SQ"]) if os.environ.get("FLASHRL_GPU_SQ") else None
CALIBRATED = ["keep-sq-int8", "abort-sq-int8"]
CASES = KEEP + ["keepclear-int8", "keepclear-int8+kv", "abort-bf16", "abort-int8", "abort-fp8", "abort-int8+kv",
                "abort-moe-fp8", "wait-int8", "wait-int8+kv"]


def run_case(case: str, work) -> dict:
    case, _, ipc = case.partition("-ipc=")
    case, _, nccl = case.partition("-nccl=")
    mode, rest = case.split("-", 1)
    compiled = rest.endswith("-compiled")
    rest = rest.removesuffix("-compiled")
    moe = rest.startswith("moe-")
    config = rest.removeprefix("moe-")
    kv = config.endswith("+kv")
    config = config.removesuffix("+kv")
    env = {k: v for k, v in os.environ.items() if k not in ("FLASHRL_CONFIG", "FLASHRL_KV_CACHE_DTYPE")}
    calibrated = config == "sq-int8"  # serves its own checkpoint: compared with an engine synced with nothing in flight
    if calibrated:
        from lifecycle import make_sq

        orig, pert, yaml = make_sq(work, SQ)[:3]
        config = str(yaml)
    else:
        orig, pert = h.model_pair(work, "qwen3_moe" if moe else "qwen2")
        config = h.config_value(work, config)  # a YAML of gpu_harness (w4a16_mix), else the shortcut
    env.update(FLASHRL_CONFIG=config, VLLM_ALLOW_INSECURE_SERIALIZATION="1", **({"FLASHRL_KV_CACHE_DTYPE": "fp8"}
                                                                                 if kv else {}))
    engine = {**h.VLLM_ENGINE, "enforce_eager": not compiled}
    args = [sys.executable, str(h.PROBES / "inflight_probe.py"), str(orig), str(pert),
            "--mode", "keep" if mode == "keepclear" else mode, "--engine-args", json.dumps(engine),
            "--prefix", json.dumps(h.SEQS[0] * 6), "--tokens", "96", "--requests", "8", "--pause-after", "12"]
    args += ["--clear-cache"] if mode == "keepclear" else []
    args += ["--reference", "sync"] if calibrated else []
    args += ["--floor"] if kv and mode == "keep" else []
    if ipc or nccl:  # CUDA IPC needs the engine core in a process of its own (NCCL: GPU 0, the trainer GPU 1)
        args += ["--ipc", ipc] if ipc else ["--nccl", nccl]
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    res = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT")), None)
    if line is None:
        return {"error": f"exit {res.returncode}", "log_tail": (res.stdout + res.stderr)[-4000:]}
    row = json.loads(line[len("RESULT"):])
    log = res.stdout + res.stderr
    row["async_scheduling"] = h.async_scheduling(log)
    row["calibrations_with_kept_requests"] = log.count("requests kept in flight")
    row["failures"] = [k for k, ok in row["checks"].items() if not ok]
    if kv:  # the kept FP8 blocks, rescaled at the update, then read by the decode kernel
        h.expect_decode_attn(row, [h.DECODE_ATTN_LINE in log])
    return row


NO_DRAIN = ["keep-int8+kv", "keep-int8+kv-compiled"]  # each compared with its config without the FP8 KV cache


@pytest.fixture(scope="module")
def rows(request, gpu_work, gpu_jobs) -> dict:
    cases = CASES + (IPC if RAY else []) + (NCCL if TWO_GPUS else []) + (CALIBRATED if SQ else [])
    return h.module_rows(request, cases, run_case, gpu_work, gpu_jobs, "vllm_inflight",
                         needs=lambda c: c.replace("+kv", "") if c in NO_DRAIN else None)


@pytest.mark.parametrize("case", CASES)
def test_inflight_update(rows, case):
    h.assert_exact(rows[case])


@pytest.mark.skipif(SQ is None, reason="FLASHRL_GPU_SQ is not set (the staged SmoothQuant profile: scripts/gpu_stage_sq.sh)")
@pytest.mark.parametrize("case", CALIBRATED)
def test_calibrated_yaml_inflight_update(rows, case):
    h.assert_exact(rows[case])


@pytest.mark.skipif(not RAY, reason="vLLM's CUDA-IPC weight-transfer engine imports ray: stage it (scripts/GPU.md)")
@pytest.mark.parametrize("case", IPC)
def test_inflight_update_over_ipc(rows, case):
    h.assert_exact(rows[case])


@pytest.mark.skipif(not TWO_GPUS, reason="NCCL needs two GPUs (it refuses two ranks on one)")
@pytest.mark.parametrize("case", NCCL)
def test_inflight_update_over_nccl(rows, case):
    h.assert_exact(rows[case])


@pytest.mark.parametrize("case", NO_DRAIN)
def test_fp8_kv_cache_update_does_not_drain(rows, case):
    """The first-token ratio is asserted with the engine's default (compiled, CUDA graphs): eager steps of
    these tiny models are Python-bound and their first token after a resume ranged 0.03-0.075 s across
    configs without an FP8 KV cache (H100, 2026-11-25), noise larger than the ratio. At 7B:
    benchmarks/async_stream.py."""
    base = rows[case.replace("+kv", "")]
    row = rows[case]
    assert "error" not in row and "error" not in base, (row, base)
    assert row["tokens_in_flight_at_first_token"] > 0 and row["calibrations_with_kept_requests"] == 1, row
    if case.endswith("-compiled"):
        assert row["first_token_after_resume_s"] <= 1.5 * base["first_token_after_resume_s"], (row, base)
    bound = base["kept_logprob_delta_mean"] + row["fp8_kv_floor_mean"]
    assert row["kept_logprob_delta_mean"] <= bound, (row["kept_logprob_delta_mean"], bound)


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"])
def test_rescale_layout_is_where_vllm_writes_k_and_v(backend):
    """vLLM's own `do_kv_cache_update` of the backend writes keys and values with (k1, v1) into one cache
    and (k2, v2) into another; the first, rescaled through `kv_halves`, must equal the second up to one
    FP8 rounding (K and V differ 8x in size: a swapped or shifted half is far off)."""
    from types import SimpleNamespace

    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from flashrl_tools.runtime.core.kv_math import rescale_fp8_
    from flashrl_tools.runtime.vllm.kv_scales import kv_halves

    try:
        cls = AttentionBackendEnum[backend].get_class()
    except Exception as e:  # noqa: BLE001 -- not built for this host
        pytest.skip(f"{backend}: {e}")
    blocks, block, heads, d = 5, 16, 2, 128
    g = torch.Generator(device="cuda").manual_seed(2)
    tokens = 3 * block
    key = (torch.randn(tokens, heads, d, generator=g, device="cuda") * 4).to(torch.bfloat16)
    value = (torch.randn(tokens, heads, d, generator=g, device="cuda") * 0.5).to(torch.bfloat16)
    slots = torch.arange(block, block + tokens, device="cuda")
    impl = SimpleNamespace(attn_type=AttentionType.DECODER, kv_cache_dtype="fp8", head_size=d, num_kv_heads=heads,
                           kv_sharing_target_layer_name=None, is_kvcache_nvfp4=False, fp8_dtype=torch.float8_e4m3fn,
                           _is_per_token_head_quant=False)  # what the backends' cache writes read

    def written(k_scale, v_scale):
        cache = torch.zeros(cls.get_kv_cache_shape(blocks, block, heads, d, "fp8"), dtype=torch.uint8, device="cuda")
        layer = SimpleNamespace(kv_cache=cache, head_size=d, kv_cache_dtype="fp8", attn_backend=cls,
                                _k_scale=torch.tensor(k_scale, device="cuda"), _v_scale=torch.tensor(v_scale, device="cuda"),
                                _k_scale_float=k_scale, _v_scale_float=v_scale)
        cls.get_impl_cls().do_kv_cache_update(impl, layer, key, value, cache, slots)
        return layer

    (k1, v1), (k2, v2) = kv_halves(written(0.05, 0.008)), kv_halves(written(0.06, 0.006))
    rescale_fp8_(k1, 0.05, 0.06, rows=[1, 2, 3])
    rescale_fp8_(v1, 0.008, 0.006, rows=[1, 2, 3])
    for a, b, scale in ((k1, k2, 0.06), (v1, v2, 0.006)):
        a, b = a.float() * scale, b.float() * scale
        assert (a - b).abs().max() <= 0.13 * b.abs().max(), (a - b).abs().max()
        assert (a[1:4] == b[1:4]).float().mean() > 0.6
        assert a[1:4].abs().sum() > 0 and a[0].abs().sum() == 0 and a[4].abs().sum() == 0
