"""vLLM-CPU's oneDNN INT8 linears (runtime/vllm/cpu_int8.py): the exact path computes what the kernel
computes (scales, zero point, bias) within one BF16 rounding, on full-range int8 values where a host
without VNNI saturates; on such a host the kernel itself is shown off, so the fix is needed there."""

from __future__ import annotations

import types

import pytest
import torch

ops = pytest.importorskip("vllm._custom_ops")

from flashrl_tools.runtime.vllm import cpu_int8  # noqa: E402

M, K, N = 8, 256, 96


def layer_and_kernel(symmetric: bool):
    """A stand-in of vLLM's processed layer (int8 weight, per-channel scales) and its kernel."""
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)  # full range: what saturates
    w_s = torch.rand(N, 1, generator=g) * 1e-2 + 1e-3
    azp_adj = None if symmetric else w.t().sum(dim=0, keepdim=True, dtype=torch.float32) * w_s.squeeze()
    kernel = types.SimpleNamespace(config=types.SimpleNamespace(input_symmetric=symmetric),
                                   _get_layer_params=lambda layer: (None, w_s, None, None, azp_adj))
    return w, w_s, kernel


@pytest.mark.parametrize("symmetric", [True, False])
def test_exact_linear_is_the_dequantized_product(symmetric):
    w, w_s, kernel = layer_and_kernel(symmetric)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, M // 2, K, generator=g) * 3 + (0 if symmetric else 1.5)).bfloat16()
    bias = torch.randn(N, generator=g).bfloat16()
    out = cpu_int8.exact_linear(kernel, None, x, bias, w.t().float().contiguous())
    assert out.shape == (2, M // 2, N) and out.dtype == torch.bfloat16
    x_q, x_s, x_zp = ops.onednn_scaled_int8_quant(x.reshape(-1, K), None, None, symmetric)
    x_deq = (x_q.double() - (0 if x_zp is None else x_zp.double())) * x_s.double()
    ref = x_deq @ (w.double() * w_s.double()).t() + bias.double()
    err = (out.reshape(-1, N).double() - ref).abs() / ref.abs().clamp_min(1e-3)
    assert err.max() <= 2 ** -7  # one BF16 rounding of the output (2**-8) with margin; a wrong scale is >> 1


def test_the_kernel_is_patched_only_where_it_saturates():
    """On this host: either oneDNN is exact (VNNI / AMX: nothing changed) or it is measurably off
    and the exact path is taken (the saturation the fix exists for)."""
    w, w_s, kernel = layer_and_kernel(True)
    x = (torch.randn(M, K, generator=torch.Generator().manual_seed(2)) * 3).bfloat16()
    handler = ops.create_onednn_scaled_mm(w.t(), w_s, torch.bfloat16, True, False, 1)
    x_q, x_s, _ = ops.onednn_scaled_int8_quant(x, None, None, True)
    onednn = torch.empty(M, N, dtype=torch.bfloat16)
    ops.onednn_scaled_mm(handler, x_q, onednn, x_s, None, None, None)
    exact = cpu_int8.exact_linear(kernel, None, x, None, w.t().float().contiguous())
    gap = ((onednn.float() - exact.float()).abs().mean() / exact.float().abs().mean()).item()
    if cpu_int8.saturates():
        assert gap > 0.05, gap  # measured on an AVX2 host: 0.14
    else:
        assert gap < 0.01, gap

    calls = []
    kernel_with_weight = types.SimpleNamespace(**vars(kernel), _flashrl_exact_weight=w.t().float().contiguous())
    assert torch.equal(cpu_int8.apply_onednn(lambda *a: calls.append(a), kernel_with_weight, None, x), exact)
    cpu_int8.apply_onednn(lambda *a: calls.append(a), kernel, None, x)  # no weight kept: vLLM's own path
    assert len(calls) == 1
