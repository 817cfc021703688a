"""A decode-shaped W4A16 GEMM (few rows) in Triton over the checkpoint's own 4-bit layout (issue 75's tail).

Issue 75's 14B rows: at 5-16 running sequences vLLM's W4A16 GEMM (Machete on Hopper; Marlin no faster) reads the
4-bit weights no faster than flashrl's INT8 GEMM reads twice the bytes (a tail step 9.92 ms vs INT8's 9.67): the
weights, a quarter of BF16's bytes, take the time of half. This kernel is shaped for that regime as `w8a8_gemm`
is: one program per BLOCK_N output channels holding every row (M <= 64, padded to the tensor-core tile), the K
loop pipelined over the packed weight rows. `SPLIT_K` > 1 shares K among programs (layers with few output channels
fill more SMs); their float32 partials are summed in split order by a second kernel (no atomics): every split count
is a fixed summation order. Larger batches (a prefill, 65+
running sequences) tile the rows too, so one layout serves every batch size: an engine keeps no second copy.

Operands as compressed-tensors' `pack-quantized` W4A16 checkpoint stores them -- no repacking, so a sync writes
the re-quantized codes where they are: `w` [N, K / 8] int32 (eight codes a word, the first in the lowest bits,
each code + 8: `quant/packing.py`), `scale` [N, K / GROUP] in the activations' 16-bit dtype (symmetric: no zero
points), `x` [M, K] BF16 / FP16. Each weight tile is dequantized in registers, `(code - 8) * scale` rounded once
to the 16-bit dtype (as Marlin and Machete do), then multiplied on the tensor cores with float32 accumulation;
`SWAP_AB` computes out^T = W . x^T instead, the weights as the MMA's 64-row operand (Hopper's wgmma at few rows).
At 4 bits a memory-bound GEMM is close to ALU-bound on the dequantization: `MAGIC` (the default) puts each code in a
16-bit float's mantissa by bit operations (`0x4300 | n` is BF16 128 + n) and subtracts, instead of an int -> float
conversion; both give n - 8 exactly, so the same weights and outputs.
`benchmarks/small_m_gemm.py --w4a16` times it against BF16 and Machete on the GPU; the CPU test runs it through
Triton's interpreter against a float32 reference.
"""

from __future__ import annotations

import functools

import torch

from flashrl_tools.quant.packing import CODES_PER_WORD

LOG_LINE = "W4A16 linears through flashrl's Triton GEMM"  # an engine logs it once per process (the benchmarks read it)
MAX_ROWS = 64
GROUP = 128  # compressed-tensors' W4A16 group (quantizer.INT4_GROUP)
SHARED_BYTES = 200 * 1024  # the pipelined tiles' budget (H100 / H200: 227 KiB a block)


@functools.lru_cache(maxsize=1)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])  # one compiled variant per tile shape, whatever the row count
    def w4a16_rows(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, M, N, K, SPLIT_TILES, stride_xm, stride_wn, stride_sn,
                   stride_om, HAS_BIAS: tl.constexpr, GROUP_K: tl.constexpr, SWAP_AB: tl.constexpr,
                   SPLIT_K: tl.constexpr, MAGIC: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        WORDS: tl.constexpr = BLOCK_K // 8
        GROUPS: tl.constexpr = BLOCK_K // GROUP_K  # scale groups in one K tile (BLOCK_K a multiple of GROUP_K)
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        rw = tl.arange(0, WORDS)
        rg = tl.arange(0, GROUPS)
        mask_m, mask_n = rm < M, rn < N
        k0 = tl.program_id(2) * SPLIT_TILES * BLOCK_K  # this program's share of K, whole tiles (keeps 16-byte loads)
        x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + k0 + rk[None, :]
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + k0 // 8 + rw[None, :]  # [BLOCK_N, WORDS]: K contiguous
        s_ptrs = s_ptr + rn[:, None].to(tl.int64) * stride_sn + k0 // GROUP_K + rg[None, :]  # [BLOCK_N, GROUPS]
        shifts = tl.arange(0, 8) * 4
        if SWAP_AB:  # out^T = W . x^T: the weights are the MMA's row operand (64+ channels), the few rows its columns
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.minimum(SPLIT_TILES, tl.cdiv(K - k0, BLOCK_K))):
            left = K - k0 - k * BLOCK_K
            x = tl.load(x_ptrs, mask=mask_m[:, None] & (rk[None, :] < left), other=0.0)
            # masked words: code -8 times a 0 scale and 0 activations
            words = tl.load(w_ptrs, mask=mask_n[:, None] & (rw[None, :] < left // 8), other=0)
            s = tl.load(s_ptrs, mask=mask_n[:, None] & (rg[None, :] < left // GROUP_K), other=0.0)
            nibbles = (words[:, :, None] >> shifts[None, None, :]) & 0xF  # [BLOCK_N, WORDS, 8]
            if MAGIC:  # the nibble in a 16-bit float's mantissa, no int -> float conversion: 2^7 + n (BF16), 2^10 + n
                if x.dtype == tl.bfloat16:
                    codes = (nibbles | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
                else:
                    codes = (nibbles | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
            else:
                codes = (nibbles - 8).to(x.dtype)
            q = tl.reshape(codes.to(x.dtype), (BLOCK_N, GROUPS, GROUP_K))  # n - 8 exactly, either way
            w = tl.reshape(q * s[:, :, None], (BLOCK_N, BLOCK_K))  # one 16-bit rounding, as the engines' kernels
            if SWAP_AB:
                acc = tl.dot(w, tl.trans(x), acc)
            else:
                acc = tl.dot(x, tl.trans(w), acc)
            x_ptrs += BLOCK_K
            w_ptrs += WORDS
            s_ptrs += GROUPS
        if SPLIT_K > 1:  # float32 partials [SPLIT_K, M, N], summed in split order by w4a16_reduce (no atomics)
            base = ws_ptr + tl.program_id(2).to(tl.int64) * M * N
            if SWAP_AB:
                tl.store(base + rm[None, :].to(tl.int64) * N + rn[:, None], acc, mask=mask_n[:, None] & mask_m[None, :])
            else:
                tl.store(base + rm[:, None].to(tl.int64) * N + rn[None, :], acc, mask=mask_m[:, None] & mask_n[None, :])
        elif SWAP_AB:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[:, None]
            out_ptrs = out_ptr + rm[None, :].to(tl.int64) * stride_om + rn[:, None]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])
        else:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            out_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit(do_not_specialize=["M"])
    def w4a16_reduce(ws_ptr, bias_ptr, out_ptr, M, N, stride_om, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < M.to(tl.int64) * N
        acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
        for split in tl.static_range(1, SPLIT_K):
            acc += tl.load(ws_ptr + split * M.to(tl.int64) * N + offs, mask=mask, other=0.0)
        col = offs % N
        if HAS_BIAS:
            acc += tl.load(bias_ptr + col, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + (offs // N) * stride_om + col, acc.to(out_ptr.dtype.element_ty), mask=mask)

    return w4a16_rows, w4a16_reduce


def default_config(m: int, n: int, k: int) -> dict:
    """Tile sizes for a (rows, out, in) shape: up to MAX_ROWS every row in one tile, long K tiles and 32-64 output
    channels a program (the INT8 kernel's sweep); above, 64 x 128 tiles of rows x channels. A first guess:
    `benchmarks/small_m_w4a16.py --sweep` measures the rest."""
    if m > MAX_ROWS:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3}
    block_m = max(16, 1 << (max(1, m) - 1).bit_length())
    block_n, block_k = 32 if n <= 4096 else 64, 256 if n >= 32768 else 512
    tile = block_m * block_k * 2 + block_n * block_k // 2  # activations (16 bits) and packed weights a stage
    dequantized = block_n * block_k * 2  # the 16-bit weight tile the MMA reads back (once, not a stage)
    stages = min(4 if k >= 8192 else 3, (SHARED_BYTES - dequantized) // tile)
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "num_stages": max(2, stages)}


def warm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Compile (and load) every tile variant `w4a16_mm` picks for this layer's operands before a CUDA graph
    captures one: vLLM captures each batch size on its first call, with no warm-up run."""
    for rows in (1, 17, 33, MAX_ROWS + 1):
        w4a16_mm(x.new_zeros(rows, x.shape[1]), w, scale, bias)


def _layout_ok(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> bool:
    k = x.shape[1]
    return (w.dtype == torch.int32 and w.dim() == 2 and w.stride(1) == 1 and w.shape[1] * CODES_PER_WORD == k
            and k % GROUP == 0 and scale.dtype == x.dtype and scale.dim() == 2 and scale.stride(1) == 1
            and tuple(scale.shape) == (w.shape[0], k // GROUP))


def w4a16_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
             config: dict | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(w, scale).T (+ bias) -> [M, N] in x's dtype. `w` / `scale`: compressed-tensors'
    `weight_packed` / `weight_scale`; `bias` [N]. Checks the layout (any device: Triton's interpreter on CPU)."""
    if not _layout_ok(x, w, scale) or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"w4a16_mm: x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}, scale "
                         f"{tuple(scale.shape)} {scale.dtype} is not a packed W4A16 layer's layout")
    m, k = x.shape
    n = w.shape[0]
    cfg = dict(config or default_config(m, n, k))
    if m == 0:
        return x.new_empty((0, n))
    if cfg["BLOCK_K"] % GROUP:
        raise ValueError(f"w4a16_mm: BLOCK_K {cfg['BLOCK_K']} is not a multiple of the {GROUP}-column group")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    warps, stages, swap = cfg.pop("num_warps", 4), cfg.pop("num_stages", 3), cfg.pop("SWAP_AB", False)
    magic = cfg.pop("MAGIC", True)
    tiles = -(-k // cfg["BLOCK_K"])
    split = max(1, min(cfg.pop("SPLIT_K", 1), tiles))
    per_split = -(-tiles // split)  # whole K tiles a split
    split = -(-tiles // per_split)  # the splits that have tiles
    rows, reduce = _kernels()
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    grid = ((n + cfg["BLOCK_N"] - 1) // cfg["BLOCK_N"], (m + cfg["BLOCK_M"] - 1) // cfg["BLOCK_M"], split)
    bias_arg = bias if bias is not None else out
    rows[grid](x, w, scale, bias_arg, out, ws, m, n, k, per_split, x.stride(0), w.stride(0), scale.stride(0),
               out.stride(0), HAS_BIAS=bias is not None, GROUP_K=GROUP, SWAP_AB=swap, SPLIT_K=split, MAGIC=magic,
               num_warps=warps, num_stages=stages, **cfg)
    if split > 1:
        block = 1024
        reduce[(-(-m * n // block),)](ws, bias_arg, out, m, n, out.stride(0), SPLIT_K=split, HAS_BIAS=bias is not None,
                                      BLOCK=block, num_warps=4)
    return out


def reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 result the kernel approximates: x @ ((code - 8) * scale, rounded to 16 bits).T (+ bias)."""
    from flashrl_tools.quant.packing import unpack_int4

    k = x.shape[1]
    codes = unpack_int4(w, k).to(x.dtype).reshape(w.shape[0], k // GROUP, GROUP)
    deq = (codes * scale[:, :, None]).reshape(w.shape[0], k)  # 16-bit products, as the kernel's
    out = x.float() @ deq.float().T
    return out + bias.float() if bias is not None else out
