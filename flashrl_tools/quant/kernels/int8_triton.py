"""Per-channel INT8 round-to-nearest of a BF16 weight in one fused Triton kernel.

Bit-identical to `quantizer._int8_channel` (the reference; tests/test_kernels.py checks it on
the GPU): scale = bf16(absmax_row(float(w)) / 127.5) (bf16 eps for zero rows),
q = clamp(rint(bf16(float(w) / float(scale))), -128, 127). The torch version makes an fp32 copy
of the weight, an absmax, a bf16 quotient and a rounded copy: four passes and two temporaries
of the weight's size; this kernel reads each row twice and writes the int8 row once.
Used on CUDA tensors of dtype bf16 when Triton is importable; `FLASHRL_TRITON=0` turns it off.
"""

from __future__ import annotations

import functools

import torch

BF16_EPS = torch.finfo(torch.bfloat16).eps


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    try:
        from triton.language.extra.cuda.libdevice import rint
    except ImportError:  # older layout
        from triton.language.extra.libdevice import rint

    @triton.jit
    def int8_rows(w_ptr, q_ptr, s_ptr, n_cols, stride_w, stride_q, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        w_row = w_ptr + row * stride_w
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(w_row + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.div_rn(tl.max(amax, axis=0), 127.5).to(tl.bfloat16)
        scale = tl.where(scale == 0, eps.to(tl.bfloat16), scale)
        tl.store(s_ptr + row, scale)
        sf = scale.to(tl.float32)
        for start in range(0, n_cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n_cols
            x = tl.load(w_row + offs, mask=m, other=0.0).to(tl.float32)
            quot = tl.div_rn(x, sf).to(tl.bfloat16).to(tl.float32)
            q = tl.minimum(tl.maximum(rint(quot), -128.0), 127.0)
            tl.store(q_ptr + row * stride_q + offs, q.to(tl.int8), mask=m)

    return int8_rows


def available(w: torch.Tensor) -> bool:
    from flashrl_tools.config.settings import settings

    if not settings().triton or not w.is_cuda or w.dtype != torch.bfloat16 or w.dim() != 2:
        return False
    try:
        _kernel()
    except Exception:  # no Triton, or no backend for this device
        return False
    return True


def int8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [out, in], scale bf16 [out, 1]) of a 2-D bf16 CUDA tensor."""
    if w.stride(1) != 1:
        w = w.contiguous()
    rows, cols = w.shape
    q = torch.empty((rows, cols), dtype=torch.int8, device=w.device)
    scale = torch.empty((rows, 1), dtype=torch.bfloat16, device=w.device)
    if rows:  # on the weight's GPU: a TP rank can be handed another GPU's tensor (SGLang's CUDA IPC buckets)
        with torch.cuda.device(w.device):
            _kernel()[(rows,)](w, q, scale, cols, w.stride(0), q.stride(0), BF16_EPS, BLOCK=1024)
    return q, scale
