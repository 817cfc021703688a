"""`fp8_decode_attn`'s decode attention with the work balanced over a fixed grid (issue 74's tail; opt-in until
measured): `fp8_decode_attention(balanced=True)` launches it with that call's operands and `fp8_decode_attn_jit`'s
helpers (the query load, the key loop `_attend`, the score scale), so each key tile's math is the split kernel's.

Why: with few running sequences the split kernel's grid (KV head pairs x sequences x splits, splits a power of 2 by
the batch's shape) takes a fraction of a wave more than a whole number of waves (12 sequences of Qwen3-8B: 768
programs, 1.45 waves of the H200's 528) and its splits follow each sequence's length, not the work. Up to MAX_SEQS
sequences (more: the split kernel, several waves anyway) `programs` programs (default: one wave, the SMs x the
programs an SM holds) split the batch's key tiles -- every (sequence, KV head pair) segment's tiles, in order -- into
equal runs: program p takes tiles [p T / P, (p + 1) T / P) of the T, across segment boundaries, and writes one
partial (output, log-sum-exp) per segment it touches into row `p + segment` (no two programs share a row: programs
and segments advance together). The merge takes, per query head, the programs
whose runs meet its segment (computed from the same prefix sums) in order. The grid does not depend on the lengths
(CUDA graphs keep one launch); the split points do: a sequence's output depends on the batch's other lengths within
float32 rounding, the same batch giving the same bits. Operands: as `fp8_decode_attention`.
"""

from __future__ import annotations

import functools

import torch

PROGRAMS_PER_SM = {2: 4, 1: 2}  # sm_90, by KV heads a program (the default tiles; benchmarks/kernel_resources.py)
MAX_SEQS = 32  # a program looks its segment up in every sequence's tiles: past 32 sequences its registers spill (sm_90)


@functools.lru_cache(maxsize=1)
def kernels(helpers):
    """The balanced split kernel and its merge; `helpers`: the `fp8_decode_attn_jit` module (its `kernels()` defines
    the shared jit helpers)."""
    import triton
    import triton.language as tl

    global _query, _attend, _score_scale, _tiles  # module globals: Triton resolves a kernel's callees there
    helpers.kernels()
    _query, _attend, _score_scale = helpers._query, helpers._attend, helpers._score_scale

    @triton.jit
    def _tiles(lens_ptr, qsl_ptr, num_seqs, SEQS_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
        """Per sequence: its index, its key tiles (0 for a padded request) and the tiles of the sequences before it."""
        rs = tl.arange(0, SEQS_PAD)
        live = rs < num_seqs
        lens = tl.load(lens_ptr + rs, mask=live, other=0)
        q_len = tl.load(qsl_ptr + rs + 1, mask=live, other=0) - tl.load(qsl_ptr + rs, mask=live, other=0)
        tiles = tl.where(q_len > 0, tl.cdiv(lens, BLOCK_N), 0)
        return rs, tiles, tl.cumsum(tiles, axis=0) - tiles

    @triton.jit
    def fp8_decode_attn_balanced(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, qsl_ptr, qs_ptr, ks_ptr, part_ptr, lse_ptr,
                                 sm_scale, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                                 stride_vh, stride_bt, num_seqs, programs, GROUP: tl.constexpr,
                                 GROUP_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                                 Q_FP8: tl.constexpr, Q_SCALED: tl.constexpr, HPP: tl.constexpr, V_ASM: tl.constexpr,
                                 PAIRS: tl.constexpr, SEQS_PAD: tl.constexpr):
        pid = tl.program_id(0)
        rs, tiles, before = _tiles(lens_ptr, qsl_ptr, num_seqs, SEQS_PAD, BLOCK_N)
        total = tl.sum(tiles, axis=0).to(tl.int64) * PAIRS
        t = pid.to(tl.int64) * total // programs
        t_end = (pid + 1).to(tl.int64) * total // programs
        rg = tl.arange(0, GROUP_PAD)
        rd = tl.arange(0, D)
        rn = tl.arange(0, BLOCK_N)
        gmask = rg < GROUP * HPP
        hid = rg // GROUP
        scale = _score_scale(sm_scale, qs_ptr, ks_ptr, Q_SCALED)
        while t < t_end:  # one segment (sequence, KV head pair) a turn: where tile t lies, then to its end or t_end
            rs, tiles, before = _tiles(lens_ptr, qsl_ptr, num_seqs, SEQS_PAD, BLOCK_N)  # again: no registers held
            seq = tl.sum((((before + tiles).to(tl.int64) * PAIRS) <= t).to(tl.int32), axis=0)
            n_tiles = tl.sum(tl.where(rs == seq, tiles, 0), axis=0)
            off = t - tl.sum(tl.where(rs == seq, before, 0), axis=0).to(tl.int64) * PAIRS
            pair = (off // n_tiles).to(tl.int32)
            k0 = (off - pair.to(tl.int64) * n_tiles).to(tl.int32)
            take = tl.minimum(n_tiles - k0, (t_end - t).to(tl.int32))
            kvh = pair * HPP
            q = _query(q_ptr, tl.load(qsl_ptr + seq), kvh * GROUP + rg, gmask, rd, stride_qt, stride_qh, Q_FP8)
            end = tl.minimum((k0 + take) * BLOCK_N, tl.load(lens_ptr + seq))
            m, l_sum, acc = _attend(q, k_ptr, v_ptr, bt_ptr, kvh, seq, k0 * BLOCK_N, end, scale, hid, rd, rn, stride_kb,
                                    stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, GROUP_PAD, D,
                                    PAGE, BLOCK_N, HPP, V_ASM)
            row = (pid.to(tl.int64) + seq * PAIRS + pair) * GROUP_PAD + rg
            safe = tl.where(l_sum > 0, l_sum, 1.0)
            tl.store(part_ptr + row[:, None] * D + rd[None, :], acc / safe[:, None], mask=gmask[:, None])
            tl.store(lse_ptr + row, tl.where(l_sum > 0, m + tl.log2(safe), float("-inf")), mask=gmask)
            t += take

    @triton.jit
    def fp8_decode_attn_balanced_merge(part_ptr, lse_ptr, lens_ptr, qsl_ptr, vs_ptr, out_ptr, stride_ot, stride_oh,
                                       num_seqs, programs, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                                       D: tl.constexpr, BLOCK_N: tl.constexpr, HPP: tl.constexpr, PAIRS: tl.constexpr,
                                       SEQS_PAD: tl.constexpr):
        """One query head of one sequence: the partials of the programs whose runs meet its segment, in order."""
        seq = tl.program_id(0)
        head = tl.program_id(1)
        rs, tiles, before = _tiles(lens_ptr, qsl_ptr, num_seqs, SEQS_PAD, BLOCK_N)
        n_tiles = tl.sum(tl.where(rs == seq, tiles, 0), axis=0)
        if n_tiles > 0:
            total = tl.sum(tiles, axis=0).to(tl.int64) * PAIRS
            pair = head // (GROUP * HPP)
            a = tl.sum(tl.where(rs == seq, before, 0), axis=0).to(tl.int64) * PAIRS + pair * n_tiles
            first = ((a + 1) * programs + total - 1) // total - 1  # the last program starting at or before tile a
            last = ((a + n_tiles) * programs + total - 1) // total - 1  # ... before the segment's end
            rd = tl.arange(0, D)
            m_run = tl.full([1], float("-inf"), tl.float32)
            w = tl.zeros([1], tl.float32)
            o = tl.zeros([D], tl.float32)
            for p in range(first.to(tl.int32), last.to(tl.int32) + 1):
                p64 = first * 0 + p  # (int64: a loop index is a Python int in Triton's interpreter)
                if p64 * total // programs < (p64 + 1) * total // programs:  # a program with a run of tiles
                    row = (p64 + seq * PAIRS + pair) * GROUP_PAD + head - pair * GROUP * HPP
                    lse = tl.load(lse_ptr + row + tl.zeros([1], tl.int64))
                    m_new = tl.maximum(m_run, lse)
                    c_old, c_new = tl.exp2(m_run - m_new), tl.exp2(lse - m_new)
                    o = o * c_old + tl.load(part_ptr + row * D + rd) * c_new
                    w = w * c_old + c_new
                    m_run = m_new
            tok = tl.load(qsl_ptr + seq)
            tl.store(out_ptr + tok.to(tl.int64) * stride_ot + head * stride_oh + rd,
                     (o / w * tl.load(vs_ptr)).to(out_ptr.dtype.element_ty))

    return fp8_decode_attn_balanced, fp8_decode_attn_balanced_merge


def attention(helpers, q, k_cache, v_cache, out, block_table, seq_lens, query_start_loc, sm_scale, qs, k_scale, v_scale,
              *, group: int, group_pad: int, hpp: int, block_n: int, q_fp8: bool, q_scaled: bool, v_asm: bool,
              programs: int, num_warps: int, num_stages: int) -> torch.Tensor:
    """Launch both kernels (`fp8_decode_attention` has checked the operands and chosen the tile)."""
    split, merge = kernels(helpers)
    num_seqs, q_heads, d = seq_lens.shape[0], q.shape[1], q.shape[2]
    pairs = k_cache.shape[2] // hpp
    seqs_pad = MAX_SEQS  # one variant; 16 spilled registers with the GPU host's Triton 3.6 (32: 211, none)
    rows = (programs + num_seqs * pairs) * group_pad
    part = torch.empty((rows, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((rows,), dtype=torch.float32, device=q.device)
    split[(programs,)](q, k_cache, v_cache, block_table, seq_lens, query_start_loc, qs, k_scale, part, lse, sm_scale,
                       q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                       v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0), num_seqs,
                       programs, GROUP=group, GROUP_PAD=group_pad, D=d, PAGE=k_cache.shape[1], BLOCK_N=block_n,
                       Q_FP8=q_fp8, Q_SCALED=q_scaled, HPP=hpp, V_ASM=v_asm, PAIRS=pairs, SEQS_PAD=seqs_pad,
                       num_warps=num_warps, num_stages=num_stages)
    merge[(num_seqs, q_heads)](part, lse, seq_lens, query_start_loc, v_scale, out, out.stride(0), out.stride(1),
                               num_seqs, programs, GROUP=group, GROUP_PAD=group_pad, D=d, BLOCK_N=block_n, HPP=hpp,
                               PAIRS=pairs, SEQS_PAD=seqs_pad, num_warps=4)
    return out
