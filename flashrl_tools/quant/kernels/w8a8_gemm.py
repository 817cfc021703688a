"""A decode-shaped W8A8 INT8 GEMM (few rows) in Triton, bit-identical to vLLM's CUTLASS kernel.

Issue 45's profiles: in the tail of an RL step (a few sequences per decode step) vLLM's CUTLASS W8A8 kernel
streams the INT8 weights at 62-69 % of the H200's bandwidth where BF16's GEMV reaches 74-78 %. This kernel
is shaped for that regime: one program per BLOCK_N output channels holding every row (M <= 64, padded to the
tensor-core tile), the K loop pipelined over the weight rows, no split-K.

Bit-identical by construction, not by tolerance: the INT8 x INT8 products accumulate in int32, which is exact
in any order (|acc| <= K * 128^2 < 2^31 for K < 131072), and the epilogue repeats CUTLASS's float operations in
its order -- `d = a_scale * (b_scale * float(acc))`, with a bias `fma(a_scale, b_scale * float(acc), bias)`
(Triton contracts `x * y + z` to one FMA, as CUTLASS's multiply_add) -- then rounds to the output dtype once.
`benchmarks/small_m_gemm.py` checks the equality against `vllm._custom_ops.cutlass_scaled_mm` on the GPU for
every shape and row count it times.

Operands as vLLM's CUTLASS kernel takes them: `a` [M, K] int8 (row-major), `b` [K, N] int8 -- the transposed
view of the [N, K] checkpoint weight vLLM keeps after loading (stride (1, K)) --, `scale_a` per token [M, 1] or
per tensor, `scale_b` per channel [N, 1] / [1, N] or per tensor, float32; `bias` [N] in the output dtype.
"""

from __future__ import annotations

import functools

import torch

MAX_ROWS = 64  # beyond this the CUTLASS kernel's tiles are the right shape (on an H200 it wins from 24 rows on)
SHARED_BYTES = 200 * 1024  # the pipelined tiles' budget (H100 / H200: 227 KiB per block; 64 x 512 x 5 did not fit)


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])  # one compiled variant per tile shape, whatever the row count
    def w8a8_rows(a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, M, N, K, stride_am, stride_bn, stride_om,
                  SA_ROWS: tl.constexpr, SB_COLS: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rm = tl.arange(0, BLOCK_M)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        mask_m, mask_n = rm < M, rn < N
        a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
        b_ptrs = b_ptr + rn[:, None].to(tl.int64) * stride_bn + rk[None, :]  # [BLOCK_N, BLOCK_K]: K contiguous
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            mask_k = rk < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0)
            b = tl.load(b_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0)
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if SB_COLS:
            sb = tl.load(sb_ptr + rn, mask=mask_n, other=0.0)[None, :]
        else:
            sb = tl.load(sb_ptr)
        if SA_ROWS:
            sa = tl.load(sa_ptr + rm, mask=mask_m, other=0.0)[:, None]
        else:
            sa = tl.load(sa_ptr)
        t = sb * acc.to(tl.float32)
        if HAS_BIAS:
            d = sa * t + tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        else:
            d = sa * t
        out_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        tl.store(out_ptrs, d.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])

    return w8a8_rows


def default_config(m: int, n: int, k: int) -> dict:
    """Tile sizes for a (rows, out, in) shape, from `benchmarks/small_m_gemm.py --sweep 4,16` on an H200
    (2026-11-27, 7B / 14B layers): long K tiles (512) and 32-64 output channels per program win at every layer,
    the widest layers (gate_up of 7B) with shorter K tiles; the long reductions (down) want deeper pipelines."""
    block_m = max(16, 1 << (max(1, m) - 1).bit_length())
    block_n, block_k = 32 if n <= 4096 else 64, 128 if n >= 32768 else 512
    stages = min(5 if k >= 8192 else 3, SHARED_BYTES // ((block_m + block_n) * block_k))  # each stage: a and b tiles
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "num_stages": max(2, stages)}


def served(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, max_rows: int = MAX_ROWS) -> bool:
    """Whether this kernel takes the call (else the caller's CUTLASS path): CUDA int8 operands, at most
    `max_rows` (<= MAX_ROWS) rows, `b` the [K, N] view of a row-major [N, K] weight, a 16-bit output."""
    return (a.is_cuda and a.dtype == torch.int8 and b.dtype == torch.int8 and a.dim() == 2 and b.dim() == 2
            and 0 < a.shape[0] <= min(max_rows, MAX_ROWS) and a.stride(1) == 1 and b.stride(0) == 1 and b.stride(1) >= b.shape[0]
            and out_dtype in (torch.bfloat16, torch.float16))


def warm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype,
         bias: torch.Tensor | None, max_rows: int) -> None:
    """Compile (and load) every tile variant `w8a8_mm` picks up to `max_rows` rows for these operands' kinds
    before a CUDA graph captures one: vLLM captures each batch size on its first call, with no warm-up run."""
    for rows in sorted({1, 17, 33} & set(range(1, min(max_rows, MAX_ROWS) + 1))):
        x = a[:1].expand(rows, -1).contiguous()
        s = scale_a[:1].expand(rows, -1).contiguous() if scale_a.numel() > 1 else scale_a
        w8a8_mm(x, b, s, scale_b, out_dtype, bias)


def w8a8_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype,
            bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """`cutlass_scaled_mm(a, b, scale_a, scale_b, out_dtype, bias)` for `served` operands, bit for bit."""
    m, k = a.shape
    n = b.shape[1]
    cfg = dict(config or default_config(m, n, k))
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    warps, stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 4)
    grid = ((n + cfg["BLOCK_N"] - 1) // cfg["BLOCK_N"],)
    _kernel()[grid](a, b, scale_a, scale_b, bias if bias is not None else out, out, m, n, k, a.stride(0), b.stride(1),
                    out.stride(0), SA_ROWS=scale_a.numel() > 1, SB_COLS=scale_b.numel() > 1, HAS_BIAS=bias is not None,
                    num_warps=warps, num_stages=stages, **cfg)
    return out
