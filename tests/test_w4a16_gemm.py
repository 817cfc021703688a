"""flashrl's few-rows W4A16 GEMM (`quant/kernels/w4a16_gemm.py`, issue 75's tail): the float32 product of the
same dequantized weights to the output's 16-bit step, on the checkpoint's own packed layout, for tiles that do not
divide the layer (rows, output channels, a last K tile of fewer groups) and a bias; its refusals. On CPU through
Triton's interpreter (its own process: Triton reads TRITON_INTERPRET at import); on a GPU the compiled kernel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashrl_tools.quant import quantizer
from flashrl_tools.quant.formats import QuantFn
from flashrl_tools.quant.kernels import w4a16_gemm
from flashrl_tools.quant.packing import pack_int4

REPO = Path(__file__).resolve().parents[1]
CASES = [  # rows, out, in, bias, tiles (None: default_config's)
    (1, 64, 256, False, None),
    (5, 96, 384, True, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 2}),
    (16, 40, 512, False, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2}),
    (33, 32, 256, True, None),
]


def _layer(n: int, k: int, dtype: torch.dtype, device: str, seed: int):
    """A W4A16 layer as the package's quantizer makes it: packed codes, group scales (and its BF16 source)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = (torch.randn(n, k, generator=g, device=device) * 0.02).to(dtype)
    q = quantizer.quantize_weight(QuantFn.w4a16, w)
    return w, pack_int4(q.weight), q.weight_scale.contiguous(), q


def _check(dtype: torch.dtype, device: str) -> None:
    for i, (m, n, k, has_bias, cfg) in enumerate(CASES):
        w, packed, scale, q = _layer(n, k, dtype, device, i)
        x = torch.randn(m, k, device=device).to(dtype)
        bias = (torch.randn(n, device=device) * 0.1).to(dtype) if has_bias else None
        out = w4a16_gemm.w4a16_mm(x, packed, scale, bias, cfg)
        ref = w4a16_gemm.reference(x, packed, scale, bias)
        step = 2.0 ** -(10 if dtype == torch.float16 else 7)  # one 16-bit step of the largest output
        assert out.dtype == dtype and out.shape == (m, n)
        assert float((out.float() - ref).abs().max()) <= step * float(ref.abs().max()), (m, n, k, has_bias)
        # the reference is the quantizer's own dequantization (up to the 16-bit rounding of code x scale)
        deq = quantizer.dequantize(QuantFn.w4a16, q).float()
        direct = x.float() @ deq.T + (bias.float() if has_bias else 0)
        assert float((direct - ref).abs().max()) <= step * float(ref.abs().max())
        assert torch.equal(out, w4a16_gemm.w4a16_mm(x, packed, scale, bias, cfg))  # one summation order


def _interpreted_check() -> None:
    """Run inside a process started with TRITON_INTERPRET=1: FP16 (the interpreter multiplies BF16 as integers;
    the GPU test covers BF16)."""
    _check(torch.float16, "cpu")


def test_w4a16_few_rows_matches_the_float32_reference():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU: test_w4a16_few_rows_compiled_matches_the_reference runs the kernel itself")
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from test_w4a16_gemm import "
            "_interpreted_check; _interpreted_check()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the compiled kernel)")
def test_w4a16_few_rows_compiled_matches_the_reference():
    _check(torch.bfloat16, "cuda")
    _check(torch.float16, "cuda")


def test_w4a16_few_rows_takes_only_packed_layers():
    """A layout that is not a packed W4A16 layer's is refused in one line; `served` says no off a GPU."""
    _, packed, scale, _ = _layer(32, 256, torch.float16, "cpu", 0)
    x = torch.randn(2, 256).half()
    assert not w4a16_gemm.served(x, packed, scale)  # CPU operands: the engine's own kernel
    for args in [(torch.randn(2, 384).half(), packed, scale),  # K does not match the codes
                 (x, packed, scale.float()),  # scales of another dtype than the activations
                 (x, packed.to(torch.int64), scale),
                 (x, packed, scale[:, :1])]:
        with pytest.raises(ValueError, match="not a packed W4A16 layer's layout"):
            w4a16_gemm.w4a16_mm(*args)
    with pytest.raises(ValueError, match="not a multiple of the 128-column group"):
        w4a16_gemm.w4a16_mm(x, packed, scale, None, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64})


def test_small_m_w4a16_benchmark_refuses_without_a_hopper_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU: the benchmark runs there")
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "small_m_w4a16.py"), "--shapes", "7b"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "needs a Hopper GPU" in r.stderr and "Traceback" not in r.stderr
