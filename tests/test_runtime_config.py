"""FLASHRL_CONFIG resolution and the pure weight conversion (no engine)."""

from __future__ import annotations

import pytest
import torch

from flashrl_tools.errors import FlashRLError
from flashrl_tools.profile.apply import requantize_tensor
from flashrl_tools.profile.build import build_profile
from flashrl_tools.quant.quantize import quantize
from flashrl_tools.runtime import apply
from flashrl_tools.config.resolve import resolve
from flashrl_tools.runtime.core.convert import WeightConverter
from flashrl_tools.safetensors_io import CheckpointReader
from flashrl_tools.config.schema import ConfigFn


def test_shortcuts_and_unset(monkeypatch):
    for value, fn in (("bf16", ConfigFn.bf16), ("fp8", ConfigFn.fp8), ("int8", ConfigFn.int8)):
        rc = resolve(value)
        assert rc.fn is fn and rc.entry.logprobs_mode == "processed_logprobs"
    assert resolve("fp8").entry.quantization == "fp8"
    monkeypatch.delenv("FLASHRL_CONFIG", raising=False)
    assert apply() is None  # unset: the runtime off; only the `always` hooks (vLLM-CPU's INT8 linears)
    from flashrl_tools.runtime.core.hooks import MARK
    from flashrl_tools.runtime.vllm.adapter import HOOKS

    assert {h.name for h in HOOKS if h.always} == {"cpu_int8_kernel", "cpu_int8_exact"}
    pytest.importorskip("vllm")
    from vllm import LLM
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel

    assert getattr(CPUInt8ScaledMMLinearKernel._apply_weights_onednn, MARK) == "cpu_int8_exact"
    assert not hasattr(LLM._validate_and_add_requests if hasattr(LLM, "_validate_and_add_requests")
                       else LLM._render_and_add_requests, MARK)  # the request guard: runtime only


def test_lmhead_fp32_keeps_the_callers_hf_overrides():
    """(What FLASHRL_LMHEAD_FP32 sets on each engine: tests/test_runtime_contract.py.)"""
    from types import SimpleNamespace

    from flashrl_tools.runtime.vllm.engine_args import merge_hf_overrides

    extra = {"head_dtype": "float32"}
    assert merge_hf_overrides({"rope_theta": 1.0}, extra) == {"rope_theta": 1.0, "head_dtype": "float32"}
    cfg = merge_hf_overrides(lambda c: SimpleNamespace(**vars(c), seen=True), extra)(SimpleNamespace(a=1))
    assert (cfg.a, cfg.seen, cfg.head_dtype) == (1, True, "float32")


@pytest.mark.parametrize("value,words", [
    ("int9", ["invalid FLASHRL_CONFIG='int9'", "bf16 | fp8 | int8"]),
    ("/nope/config.yaml", ["file not found"]),
    ("someone/repo/../config.yaml", ["bf16 | fp8 | int8"]),
])
def test_invalid_values_name_the_value_and_the_allowed_forms(value, words):
    with pytest.raises(FlashRLError) as e:
        resolve(value)
    for w in words:
        assert w in e.value.message


def test_yaml_with_bad_content(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("version: 1\nconfigs:\n- fn: int8\n  modle: x\n")
    with pytest.raises(FlashRLError, match="unknown key 'modle'"):
        resolve(str(cfg))
    cfg.write_text("configs:\n- fn: int8\n  model: /nope\n  profile: /nope/p.safetensors\n")
    with pytest.raises(FlashRLError, match="not a model directory"):
        resolve(str(cfg))


def test_converter_matches_offline_requantization(tiny_models, tmp_path):
    """The sync path and the offline `requantize_checkpoint` produce the same tensors."""
    src = tiny_models["qwen2-untied"]
    q = quantize(src, tmp_path / "q", "int8").out
    profile = build_profile(src, q, "int8").profile
    conv = WeightConverter(ConfigFn.int8, set(profile.meta.quantized), profile)
    online = WeightConverter.for_checkpoint(ConfigFn.int8, q, None)
    assert online.quantized == set(profile.meta.quantized)
    assert WeightConverter.expected_names(q) == set(CheckpointReader(src).names())
    for name, t in CheckpointReader(src).iter_tensors():
        t = (t.float() * 1.01).to(t.dtype)  # an "updated" weight
        got, ref, onl = conv.convert(name, t), requantize_tensor(profile, name, t), online.convert(name, t)
        assert [n for n, _ in got] == [n for n, _ in ref] == [n for n, _ in onl]
        for (_, a), (_, b) in zip(got, ref):
            assert torch.equal(a, b)
        if name in profile.meta.quantized:  # online: fresh absmax scales; profile: frozen ones
            assert onl[0][1].dtype == torch.int8 and not torch.equal(onl[1][1], got[1][1])
            # fp32 master weights (verl, TRL) convert as their BF16 checkpoint does
            for c in (conv, online):
                assert all(torch.equal(a, b) for (_, a), (_, b) in zip(c.convert(name, t.float()), c.convert(name, t)))
    assert WeightConverter(ConfigFn.bf16, set(), None).convert("x", torch.ones(2))[0][0] == "x"


def test_settings_read_the_environment_as_it_is_now(monkeypatch):
    """A library may replace `os.environ` (datasets' `Dataset.map(num_proc=...)` leaves a copy behind): the settings
    read the mapping in force, not the one of import time."""
    import copy
    import os

    from flashrl_tools.config.settings import settings

    monkeypatch.setattr(os, "environ", copy.deepcopy(os.environ))
    monkeypatch.setenv("FLASHRL_VERSION_CHECK", "0")
    assert settings().version_check is False
    monkeypatch.setenv("FLASHRL_VERSION_CHECK", "1")
    assert settings().version_check is True


def test_the_online_cache_drops_copies_of_deleted_policies(tiny_models, tmp_path, monkeypatch):
    """A quantized copy whose policy folder is gone (a run's temporary checkpoint) is removed at the next build,
    once past the grace period; one whose policy is still there, or that is recent, stays."""
    import os
    import shutil
    import time

    from flashrl_tools.quant.quantizer import QuantFn
    from flashrl_tools.runtime.core.online_cache import ensure_quantized

    monkeypatch.setenv("FLASHRL_HOME", str(tmp_path / "home"))

    def policy(name):  # config only: the cache writes the quantized config (dummy weights), no tensors
        d = tmp_path / name
        d.mkdir()
        shutil.copy(tiny_models["qwen3-untied"] / "config.json", d)
        return d

    kept, gone, recent = policy("kept"), policy("gone"), policy("recent")
    entries = {n: ensure_quantized(d, QuantFn.int8) for n, d in (("kept", kept), ("gone", gone), ("recent", recent))}
    hour_ago = time.time() - 7200
    for n in ("kept", "gone"):
        os.utime(entries[n] / "flashrl_source.json", (hour_ago, hour_ago))
    shutil.rmtree(gone)
    shutil.rmtree(recent)
    assert ensure_quantized(kept, QuantFn.int8) == entries["kept"] and entries["gone"].is_dir()  # cached: no build
    ensure_quantized(policy("new"), QuantFn.int8)
    assert not entries["gone"].exists() and entries["kept"].is_dir() and entries["recent"].is_dir()
