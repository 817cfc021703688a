"""SmoothQuant helpers of the quantizer: rounding order matches llmcompressor's in-place updates."""

from __future__ import annotations

import torch

from flashrl_tools.quant.quantizer import requantize_int8, smooth_norm, smooth_weight


def test_smooth_weight_rounds_like_inplace_bf16_updates():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 6, generator=g).to(torch.bfloat16)
    col = torch.exp(torch.randn(6, generator=g)).to(torch.bfloat16).float()
    row = torch.exp(torch.randn(8, generator=g)).to(torch.bfloat16).float()
    # llmcompressor: weight = weight * scales (fp32 math, stored bf16), then weight / scales[:, None]
    expected = (w * col.view(1, -1)).to(torch.bfloat16)
    expected = (expected / row.view(-1, 1)).to(torch.bfloat16)
    assert torch.equal(smooth_weight(w, col, row), expected)
    assert torch.equal(smooth_weight(w), w)


def test_smooth_norm_and_identity():
    n = torch.tensor([1.0, 2.0, -0.5], dtype=torch.bfloat16)
    assert torch.equal(smooth_norm(n, torch.tensor([2.0, 4.0, 0.5])), torch.tensor([0.5, 0.5, -1.0], dtype=torch.bfloat16))
    assert smooth_norm(n, None) is n


def test_requantize_with_known_factors_recovers_integers():
    # W * m / s = exact integers -> q is those integers
    w = torch.tensor([[1.0, 2.0], [-3.0, 4.0]], dtype=torch.bfloat16)
    m = torch.tensor([2.0, 0.5])
    s = torch.tensor([[0.5], [0.25]], dtype=torch.bfloat16)
    assert requantize_int8(w, s, m).tolist() == [[4, 2], [-24, 8]]
