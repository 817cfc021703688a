"""FP8 power-of-two scales (issue 17, NeMo-RL style): the math, `quantize --pow2-scales`, the config
key, and the sync converter re-quantizing the same way (FP8 engines are GPU-only: no engine here)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli
from flashrl_tools.errors import FlashRLError
from flashrl_tools.quant.quantize import quantize
from flashrl_tools.quant.quantizer import FP8_MAX, QuantFn, dequantize, quantize_weight, quantize_weights
from flashrl_tools.safetensors_io import CheckpointReader

FP8 = [QuantFn.fp8_channel, QuantFn.fp8_tensor, QuantFn.fp8_block]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t  # FP8 compared bit for bit


def _is_pow2(t: torch.Tensor) -> bool:
    m, _ = torch.frexp(t)
    return bool((m == 0.5).all())


@pytest.mark.parametrize("fn", FP8)
def test_scales_are_the_next_power_of_two_and_nothing_clips(fn):
    torch.manual_seed(0)
    w = (torch.randn(300, 200) * 0.02).to(torch.bfloat16)
    w[3] = 0  # a zero row (channel) keeps a nonzero scale
    plain, p2 = quantize_weight(fn, w), quantize_weight(fn, w, pow2=True)
    assert _is_pow2(p2.weight_scale) and p2.weight_scale.dtype == torch.float32
    assert (p2.weight_scale >= plain.weight_scale).all() and (p2.weight_scale < 2 * plain.weight_scale).all()
    assert p2.weight.float().abs().max() <= FP8_MAX
    # round-to-nearest at a coarser grid: error stays of the same order
    err = lambda q: (dequantize(fn, q) - w.float()).abs().mean()  # noqa: E731
    assert err(p2) < 2 * err(plain)
    # exact powers of two stay (log2 rounding just above one is stepped up, never down)
    edge = torch.full((4, 8), FP8_MAX * 2.0 ** -7)
    assert torch.equal(quantize_weight(QuantFn.fp8_tensor, edge, pow2=True).weight_scale, torch.tensor([2.0 ** -7]))


@pytest.mark.parametrize("fn", FP8)
def test_stacked_pow2_equals_one_at_a_time(fn):
    torch.manual_seed(1)
    w = (torch.randn(3, 256, 128) * torch.tensor([0.01, 0.1, 1.0])[:, None, None]).to(torch.bfloat16)
    for one, q in zip((quantize_weight(fn, w[i], pow2=True) for i in range(3)), quantize_weights(fn, w, pow2=True)):
        assert torch.equal(_bits(one.weight), _bits(q.weight))
        assert torch.equal(one.weight_scale, q.weight_scale)


def test_int8_has_no_pow2_option(tiny_models, tmp_path):
    with pytest.raises(ValueError, match="FP8 option"):
        quantize_weight(QuantFn.int8, torch.ones(4, 4), pow2=True)
    res = run_cli("quantize", "-m", tiny_models["llama-untied"], "-o", tmp_path / "q", "--fn", "int8", "--pow2-scales")
    assert res.returncode == 2 and "power-of-two scales are an FP8 option" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "q").exists()


def test_quantize_writes_pow2_scales_and_marks_the_checkpoint(tiny_models, tmp_path):
    src = tiny_models["qwen2-untied"]
    res = run_cli("quantize", "-m", src, "-o", tmp_path / "q", "--fn", "fp8_channel", "--pow2-scales")
    assert res.returncode == 0, res.stderr
    q = CheckpointReader(tmp_path / "q")
    scales = [n for n in q.names() if n.endswith("_scale")]
    assert scales and all(_is_pow2(q.get(n)) for n in scales)
    assert json.loads((tmp_path / "q" / "config.json").read_text())["flashrl_fp8_scale_pow2"] is True
    plain = quantize(src, tmp_path / "plain", "fp8_channel")
    assert "flashrl_fp8_scale_pow2" not in json.loads((plain.out / "config.json").read_text())


def test_sync_converter_requantizes_with_pow2_scales(tiny_models, tmp_path):
    """The runtime reads the checkpoint's mark: a synced weight gets exactly the tensors `quantize
    --pow2-scales` writes (what a fresh engine on the updated weights would load)."""
    from flashrl_tools.runtime.core.convert import WeightConverter
    from flashrl_tools.config.schema import ConfigFn
    from flashrl_tools.verify.perturb import perturb

    src = tiny_models["llama-untied"]
    loaded = quantize(src, tmp_path / "q", "fp8_block", pow2=True).out
    conv = WeightConverter.for_checkpoint(ConfigFn.fp8_block, loaded, None)
    assert conv.pow2
    updated = perturb(src, tmp_path / "mp")
    ref = CheckpointReader(quantize(updated, tmp_path / "ref", "fp8_block", pow2=True).out)
    for name, tensor in CheckpointReader(updated).iter_tensors():
        for out_name, out in conv.convert(name, tensor):
            expect = ref.get(out_name)
            assert out.dtype == expect.dtype and torch.equal(_bits(out), _bits(expect)), out_name
    plain = quantize(src, tmp_path / "p", "fp8_block").out
    assert not WeightConverter.for_checkpoint(ConfigFn.fp8_block, plain, None).pow2


def test_config_key_is_for_online_fp8_formats_only(tmp_path):
    from flashrl_tools.config.schema import parse_config

    ok = parse_config({"configs": [{"fn": "fp8_channel", "fp8_scale_pow2": True}]}, "t").configs[0]
    assert ok.fp8_scale_pow2
    for bad, why in (({"fn": "int8"}, "has no FP8 scales"), ({"fn": "fp8"}, "computes its own scales"),
                     ({"fn": "fp8_block", "model": str(tmp_path)}, "quantize --pow2-scales")):
        with pytest.raises(FlashRLError, match=why):
            parse_config({"configs": [{**bad, "fp8_scale_pow2": True}]}, "t")
    res = run_cli("setup", "--fn", "int8", "-o", tmp_path / "c.yaml", "fp8_scale_pow2=true")
    assert res.returncode == 2 and "fp8_scale_pow2 needs fn" in res.stderr and not (tmp_path / "c.yaml").exists()
    res = run_cli("setup", "--fn", "fp8_channel", "-o", tmp_path / "c.yaml", "fp8_scale_pow2=true")
    assert res.returncode == 0, res.stderr
    assert "fp8_scale_pow2: true" in (tmp_path / "c.yaml").read_text()


def test_online_checkpoint_is_cached_apart_from_the_plain_one(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHRL_HOME", str(tmp_path / "home"))
    from flashrl_tools.runtime.core.online_cache import ensure_quantized

    src = tiny_models["qwen3-untied"]
    a = ensure_quantized(src, QuantFn.fp8_tensor)
    b = ensure_quantized(src, QuantFn.fp8_tensor, pow2=True)
    assert a != b and "pow2" in b.name
    assert json.loads((b / "config.json").read_text())["flashrl_fp8_scale_pow2"] is True
    scale = next(n for n in CheckpointReader(b).names() if n.endswith("_scale"))
    assert _is_pow2(CheckpointReader(b).get(scale)) and not _is_pow2(CheckpointReader(a).get(scale))


def test_tune_starts_from_pow2_rtn_and_refuses_it_for_int8(tmp_path):
    from flashrl_tools.tune.run import base_entry

    assert base_entry(QuantFn.fp8_block, None, pow2=True).fp8_scale_pow2
    with pytest.raises(FlashRLError, match="fp8_scale_pow2 needs fn"):
        base_entry(QuantFn.int8, None, pow2=True)
