"""The quantization math: formats, shapes, zero rows, and round-trip error bounds.

Bounds (in units of the scale s of the element's channel/tensor/block):
- int8: |w - q*s| <= 0.75 s. Round to nearest gives 0.5 s; the quotient w/s is computed in bf16
  (as llmcompressor does, for bit-exactness), and near |w/s| = 127 bf16 spacing is 0.5, which
  adds up to 0.25 s.
- fp8 e4m3: 3 mantissa bits, so |x - fp8(x)| <= |x| * 2^-4 for normal x, and <= 2^-10 (half
  the subnormal spacing 2^-9) below the normal range; x = w/s is never clipped because the scale
  is absmax/448 in fp32.
"""

from __future__ import annotations

import pytest
import torch

from flashrl_tools.quant.quantizer import (
    FP8_DTYPE,
    QuantFn,
    dequantize,
    output_specs,
    quantize_weight,
    quantize_weights,
)
from flashrl_tools.safetensors_io import CheckpointReader

EIGHT_BIT = [f for f in QuantFn if not f.packed]  # 4-bit (groups of 128 columns): tests/test_w4a16.py


def _scale_per_element(fn: QuantFn, scale: torch.Tensor, shape) -> torch.Tensor:
    out, inp = shape
    if fn is QuantFn.fp8_block:
        return scale.float().repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)[:, :inp]
    return scale.float().expand(out, inp)


def assert_within_bound(fn: QuantFn, w: torch.Tensor) -> float:
    q = quantize_weight(fn, w)
    spec = output_specs(fn, tuple(w.shape), w.dtype)
    assert tuple(q.weight.shape) == spec["weight"].shape and q.weight.dtype == spec["weight"].dtype
    assert tuple(q.weight_scale.shape) == spec["weight_scale"].shape
    assert q.weight_scale.dtype == spec["weight_scale"].dtype
    err = (w.float() - dequantize(fn, q)).abs()
    s = _scale_per_element(fn, q.weight_scale, w.shape)
    if fn is QuantFn.int8:
        bound = 0.75 * s
    else:
        bound = torch.maximum(w.float().abs() * 2**-4, 2**-10 * s)
    excess = (err - bound * (1 + 1e-6)).max().item()
    assert excess <= 0, f"{fn.value}: error exceeds bound by {excess}"
    return (err / w.float().abs().amax().clamp_min(1e-30)).max().item()


@pytest.mark.parametrize("fn", EIGHT_BIT)
@pytest.mark.parametrize("shape", [(64, 128), (200, 300), (129, 257), (1, 7)])
def test_round_trip_random(fn, shape):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    w[0, 0] = 0.5  # an outlier
    assert_within_bound(fn, w)


@pytest.mark.parametrize("fn", EIGHT_BIT)
def test_round_trip_real_weights(fn, default_model):
    """Every linear weight of the first two decoder layers of SmolLM2 meets the bound."""
    reader = CheckpointReader(default_model)
    names = [n for n in reader.names() if n.startswith(("model.layers.0.", "model.layers.1."))
             and n.endswith("proj.weight")]
    assert len(names) == 14
    for name in names:
        assert_within_bound(fn, reader.get(name))


@pytest.mark.parametrize("fn", EIGHT_BIT)
def test_zero_rows_and_tensors_stay_zero(fn):
    w = torch.zeros(130, 140, dtype=torch.bfloat16)
    q = quantize_weight(fn, w)
    assert torch.all(q.weight_scale > 0), "a zero scale would divide by zero in the engine"
    assert torch.all(dequantize(fn, q) == 0)


def test_int8_values_and_scale_layout():
    w = torch.tensor([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0], [-2.0, 1.0, 0.0]], dtype=torch.bfloat16)
    q = quantize_weight(QuantFn.int8, w)
    assert q.weight.dtype == torch.int8 and q.weight_scale.shape == (3, 1)
    assert q.weight_scale.dtype == torch.bfloat16
    # Row 0: 1/127.5 = 0.00784314 lies between bf16 neighbours 2^-7 and 2^-7 * 1.0078125 and is
    # nearer the upper one, so s = 0.00787354; 1/s = 127.007 -> 127, -0.5/s = -63.5 (half to
    # even) -> -64, 0.25/s = 31.75 -> 32.
    assert q.weight_scale[0].item() == 2**-7 * 1.0078125
    assert q.weight[0].tolist() == [127, -64, 32]
    assert q.weight[1].tolist() == [0, 0, 0]
    # Row 2: s = 2^-6 * 1.0078125; -2/s = -127.007 -> -127 (not -128), 1/s = 63.5 -> 64.
    assert q.weight_scale[2].item() == 2**-6 * 1.0078125
    assert q.weight[2].tolist() == [-127, 64, 0]


def test_fp8_formats_scale_shapes():
    w = torch.randn(300, 260, dtype=torch.bfloat16)
    assert quantize_weight(QuantFn.fp8_channel, w).weight_scale.shape == (300, 1)
    assert quantize_weight(QuantFn.fp8_tensor, w).weight_scale.shape == (1,)
    blk = quantize_weight(QuantFn.fp8_block, w)
    assert blk.weight_scale.shape == (3, 3) and blk.weight.dtype == FP8_DTYPE
    # the largest |w| of each block maps exactly to the fp8 max
    assert torch.all(blk.weight.float().abs().amax() == 448.0)


def test_rejects_non_2d():
    with pytest.raises(ValueError, match="2-D"):
        quantize_weight(QuantFn.int8, torch.zeros(4))


@pytest.mark.parametrize("fn", EIGHT_BIT)
@pytest.mark.parametrize("shape", [(5, 256, 300), (3, 129, 257), (2, 1, 7)])
def test_stacked_weights_quantize_like_one_at_a_time(fn, shape):
    """What the runtime does with a fused MoE tensor (stack of expert weights) is bit-identical
    with quantizing each expert weight alone, zero slices included."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    w[0, 0, 0] = 0.5
    w[-1] = 0
    for i, q in enumerate(quantize_weights(fn, w)):
        ref = quantize_weight(fn, w[i])
        assert torch.equal(q.weight.view(torch.uint8), ref.weight.view(torch.uint8)), (fn, i)
        assert q.weight_scale.shape == ref.weight_scale.shape and torch.equal(q.weight_scale, ref.weight_scale)
