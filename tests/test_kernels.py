"""The fused Triton INT8 kernel is bit-identical to the reference quantizer math (GPU only)."""

from __future__ import annotations

import pytest
import torch

from flashrl_tools.quant.quantizer import int8_scale, quantize_int8_with_scale

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton)")


def _reference(w):
    s = int8_scale(w)
    return quantize_int8_with_scale(w, s), s


@cuda
@pytest.mark.parametrize("shape", [(1, 1), (7, 1000), (256, 4096), (3584, 18944), (129, 5121)])
def test_triton_int8_bit_identical(shape):
    from flashrl_tools.quant.kernels import int8_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(shape, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    w[0, 0] = 3.0  # an outlier: most of its row rounds to 0
    if shape[0] > 2:
        w[1].zero_()  # zero row: scale = bf16 eps
        w[2] = torch.arange(shape[1], device="cuda") % 9 - 4  # exact quotients and .5 ties
    assert int8_triton.available(w)
    q, s = int8_triton.int8_channel(w)
    q_ref, s_ref = _reference(w)
    assert torch.equal(s, s_ref)
    assert torch.equal(q, q_ref)
    # a strided view (a slice of a fused qkv weight) too
    v = w[:, : max(1, shape[1] // 2)]
    assert all(torch.equal(a, b) for a, b in zip(int8_triton.int8_channel(v), _reference(v)))


def test_off_switch_and_cpu_fallback(monkeypatch):
    from flashrl_tools.quant.kernels import int8_triton

    assert not int8_triton.available(torch.zeros(2, 2, dtype=torch.bfloat16))  # CPU tensor
    monkeypatch.setenv("FLASHRL_TRITON", "0")
    if torch.cuda.is_available():
        assert not int8_triton.available(torch.zeros(2, 2, dtype=torch.bfloat16, device="cuda"))
