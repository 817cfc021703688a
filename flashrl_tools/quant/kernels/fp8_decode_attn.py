"""Decode attention over a paged FP8 (E4M3) KV cache with per-tensor scales, in Triton (issue 45).

Why: FA3's FP8 decode reads the cache at about half the bandwidth of its BF16 decode (RESULTS "The FP8 KV cache
and the attention backend"), so halving the cache's bytes takes ~20 % off attention, not ~50 %. This kernel is
shaped for decode only (one query token per sequence): one program per (KV head pair, sequence, split) holds the
pair's query groups packed in one 16-row tile (one tensor-core dot per head, each row keeping its own head's
scores), streams the split's pages, and keeps the online softmax in float32 (split-KV "flash decoding"; the splits
are merged by a second kernel when there is more than one). A group too wide to pair (> 8 query heads) or an odd
KV head count keeps one head a program. Measured on an H200 (RESULTS "Two KV heads a program", "Where the FP8 decode
kernel's time goes"): one head a program ~2.4 TB/s (FA3's FP8 speed); two, V cast to FP16 first (`to_f16`), 2 warps:
3.2 at 128-256 sequences, where the loads alone read 4.3. The error against float32 is ~13x smaller than FA3's.

The math, per sequence and query head: `o = sum_j softmax_j(s) * v_scale * V_j` with
`s_j = sm_scale * q_scale * k_scale * (q . K_j)`. FP8 operands are widened to FP16 (exact for E4M3), so
`q . K_j` is the exact product sum accumulated in float32, as FA3's FP8 MMA computes it. The probabilities
stay FP16 for the P.V product (FA3 rounds them to FP8 there). A BF16 query (no q_scale) is multiplied in
BF16 with the keys widened to BF16 (also exact). Deterministic: no atomics; for a given split count a
sequence's output does not depend on the other sequences of the batch.

Operands: `q` [tokens, q_heads, D] (FP8 with `q_scale` -- a tensor, or a number for a query cast to FP8 without
one, as SGLang's fa3 does (1.0) --, or BF16 / FP16 with `q_scale=None`); `k_cache`,
`v_cache` [blocks, page, kv_heads, D] FP8 views with any strides (vLLM's FA layout and SGLang's token pool
viewed with page 1 are both such views); `block_table` [seqs, max_pages] int32; `seq_lens` [seqs] int32
(0 = a padded request: nothing written); `query_start_loc` [seqs + 1] (the token of sequence i); scales float32
tensors of one element (read on the device, so recalibrated scales need no CUDA graph capture). This module: the
launch (`fp8_decode_attention`), its defaults; the Triton kernels: `fp8_decode_attn_jit`.
"""

from __future__ import annotations

import os

import torch

from flashrl_tools.quant.kernels import fp8_decode_attn_jit as jit

MAX_SPLITS = 16


def splits_for(num_seqs: int, kv_heads: int, sm_count: int, max_splits: int = MAX_SPLITS) -> int:
    """Splits per sequence: the power of 2 that brings the programs nearest ~16 per SM from below (the best split
    count of benchmarks/decode_attention.py's sweep on an H200 at 16 and 128 sequences, 4 and 8 KV heads; `kv_heads`
    is the programs per sequence and split). A function of the batch's shape only (not of its lengths), so a captured
    CUDA graph holds one launch grid."""
    want = 16 * sm_count // max(1, num_seqs * kv_heads)
    return max(1, min(max_splits, 1 << max(0, want.bit_length() - 1)))


def heads_per_program(q_heads: int, kv_heads: int) -> int:
    """2 where a pair of KV heads' query groups fits the 16-row tile and the heads pair up, else 1."""
    return 2 if kv_heads % 2 == 0 and 2 * (q_heads // kv_heads) <= 16 else 1


def fp8_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                         block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                         sm_scale: float, k_scale: torch.Tensor, v_scale: torch.Tensor,
                         q_scale: torch.Tensor | float | None = None, splits: int | None = None,
                         block_n: int | None = None, num_warps: int | None = None, num_stages: int = 2,
                         heads: int | None = None, sm_count: int | None = None,
                         v_f16_first: bool = True, qk_fp8: bool = False, longest_first: bool = False,
                         min_split: int = 0, merge_heads: int = 1, balanced: bool = False,
                         programs: int | None = None) -> torch.Tensor:
    """Write each decoding sequence's attention into `out` [tokens, q_heads, D] (module docstring). Unset, the heads
    a program holds, the keys it reads an iteration and its warps (64 and 2 for two heads, 128 and 4 for one) and the
    splits (`splits_for`, from `sm_count` or the device's) are the measured defaults (RESULTS "Where the FP8 decode
    kernel's time goes"). `v_f16_first`: an E4M3 V tile is converted to FP16 before the dot (`to_f16`: the same values,
    3-7 % faster on an H200); False: the plain cast (Triton's interpreter always). `qk_fp8`: an E4M3 query over E4M3
    keys on Hopper takes `fp8_decode_attn_qk.kernel` (FP8 warpgroup MMA for the scores); other operands keep the
    default. `longest_first`: the programs take the sequences longest first (an argsort of `seq_lens` on the device;
    the same bits), so the last wave holds short ones; opt-in (the RL step was slower). `min_split`: each split
    reads at least this many keys (a multiple of the tile), so a long sequence takes every split and a short one few
    under one grid; empty splits write nothing. `merge_heads`: query heads a merge program takes (the same bits; one
    was as fast, job merge74). `balanced`: up to 32 sequences `fp8_decode_attn_bal` -- `programs` (default: SMs x its
    programs an SM) take equal runs of the batch's key tiles (`splits`, `min_split`, `merge_heads` unused); opt-in."""
    split_kernel, merge_kernel = jit.kernels()
    num_seqs, q_heads, d = seq_lens.shape[0], q.shape[1], q.shape[2]
    kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    if q_heads % kv_heads or d & (d - 1) or k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or num_seqs > 65535:
        raise ValueError(f"fp8_decode_attention: unsupported shapes q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
    group = q_heads // kv_heads
    hpp = heads_per_program(q_heads, kv_heads) if heads is None else heads
    group_pad = max(16, 1 << (hpp * group - 1).bit_length())
    if hpp < 1 or kv_heads % hpp or (hpp > 1 and hpp * group > 16):
        raise ValueError(f"fp8_decode_attention: {hpp} KV heads a program: {kv_heads} KV heads of {group} query heads "
                         "each do not pack into a 16-row tile")
    qk_fp8 = (qk_fp8 and q.dtype == torch.float8_e4m3fn and k_cache.dtype == torch.float8_e4m3fn
              and (not q.is_cuda or torch.cuda.get_device_capability(q.device) == (9, 0)))  # Hopper's FP8 MMA
    if block_n is None:
        block_n = 64 if hpp > 1 or qk_fp8 else 128
    if num_warps is None:  # two heads a program: 2 warps (more programs an SM; 3-5 % faster from 64 sequences up)
        num_warps = 4 if qk_fp8 else 2 if hpp > 1 else 4  # qk_fp8: a warpgroup (Hopper's MMA of 64 key rows)
    if splits is None:
        sm_count = sm_count or torch.cuda.get_device_properties(q.device).multi_processor_count
        splits = splits_for(num_seqs, kv_heads // hpp, sm_count)
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"fp8_decode_attention: splits={splits}, a power of 2 is needed")
    if merge_heads < 1 or q_heads % merge_heads:
        raise ValueError(f"fp8_decode_attention: merge_heads={merge_heads} does not divide the {q_heads} query heads")
    if min_split < 0 or min_split % block_n:
        raise ValueError(f"fp8_decode_attention: min_split={min_split}, a multiple of the tile ({block_n} keys) is needed")
    q_fp8 = q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if q_fp8 != (q_scale is not None):
        raise ValueError("fp8_decode_attention: an FP8 query takes q_scale, a 16-bit one does not")
    q_scaled = isinstance(q_scale, torch.Tensor)
    if q_fp8 and not q_scaled:  # a number: folded into the softmax scale
        sm_scale, q_scale = sm_scale * float(q_scale), None
    v_asm = v_f16_first and v_cache.dtype == torch.float8_e4m3fn and q.is_cuda and not _interpreted()
    from flashrl_tools.quant.kernels import fp8_decode_attn_bal as bal

    if balanced and num_seqs <= bal.MAX_SEQS:
        if qk_fp8 or longest_first or (programs is not None and programs < 1):
            raise ValueError("fp8_decode_attention: balanced takes neither qk_fp8 nor longest_first, and >= 1 programs")
        programs = programs or bal.PROGRAMS_PER_SM[min(hpp, 2)] * (
            sm_count or torch.cuda.get_device_properties(q.device).multi_processor_count)
        return bal.attention(jit, q, k_cache, v_cache, out, block_table, seq_lens, query_start_loc,
                             sm_scale, q_scale if q_scaled else k_scale, k_scale, v_scale, group=group,
                             group_pad=group_pad, hpp=hpp, block_n=block_n, q_fp8=q_fp8, q_scaled=q_scaled, v_asm=v_asm,
                             programs=programs, num_warps=num_warps, num_stages=num_stages)
    part = lse = out
    if splits > 1:
        part = torch.empty((num_seqs * q_heads * splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((num_seqs * q_heads * splits,), dtype=torch.float32, device=q.device)
    order = torch.argsort(seq_lens, descending=True, stable=True).to(torch.int32) if longest_first else seq_lens
    args = (q, k_cache, v_cache, block_table, seq_lens, query_start_loc, q_scale if q_scaled else k_scale, k_scale,
            v_scale, out, part, lse, order, sm_scale, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
            out.stride(0), out.stride(1), q_heads)
    grid = (kv_heads // hpp, num_seqs, splits)
    if qk_fp8:
        from flashrl_tools.quant.kernels import fp8_decode_attn_qk

        qk_kernel = fp8_decode_attn_qk.kernel(jit)  # the shared jit helpers
        qk_kernel[grid](*args, GROUP=group, GROUP_PAD=group_pad, D=d, PAGE=page, BLOCK_N=block_n, SPLITS=splits,
                        Q_SCALED=q_scaled, HPP=hpp, V_ASM=v_asm, ORDERED=longest_first, WIDEN=_interpreted(),
                        MIN_SPLIT=min_split, num_warps=num_warps, num_stages=num_stages)
    else:
        split_kernel[grid](*args, GROUP=group, GROUP_PAD=group_pad, D=d, PAGE=page, BLOCK_N=block_n, SPLITS=splits,
                           Q_FP8=q_fp8, Q_SCALED=q_scaled, HPP=hpp, V_ASM=v_asm, ORDERED=longest_first,
                           MIN_SPLIT=min_split, num_warps=num_warps, num_stages=num_stages)
    if splits > 1:
        merge_kernel[(num_seqs, q_heads // merge_heads)](part, lse, seq_lens, query_start_loc, v_scale, out,
                                                         out.stride(0), out.stride(1), q_heads, D=d, SPLITS=splits,
                                                         BLOCK_N=block_n, MIN_SPLIT=min_split, HEADS=merge_heads,
                                                         num_warps=4)
    return out


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

