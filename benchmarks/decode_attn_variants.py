"""What limits flashrl's FP8 decode attention (issue 45's open lever): variants of its split kernel, and the same
gather without the attention, timed on one layer's decode step (torch + Triton only: no vLLM needed).

With one KV head a program flashrl's kernel (`quant/kernels/fp8_decode_attn.py`) read an FP8 cache at ~2.4 TB/s where
FA3 reads a BF16 one at ~4.2 (RESULTS "flashrl's FP8 decode attention"); two heads a program (`hpp2_hf`, the package's
default since) 2.6-2.9 on an H200 (RESULTS "What limits flashrl's FP8 decode attention"). Rows, each at the split
counts around its default (`splits_for` of its programs per sequence):
  package         the package's kernel at its defaults (two KV heads a program where they pair: hpp2_hf, 64 keys)
  shipped         the kernel as shipped until 2026-11-28: one KV head a program (FP8 Q, K, V widened to FP16)
  qk_fp8          Q.K^T as an FP8 x FP8 product (no widening of K; exact products, float32 sums), P.V as shipped
  qk_pv_fp8       also P.V in FP8 (P rounded to FP8, as FA3 does: more error)
  *_cg            the cache's loads bypass L1 and are evicted first (it is read once)
  *_paged         one block-table load per page (PAGE rows affine in it) instead of one per token
  tma, *_tma      one page per iteration through a tensor descriptor (TMA on Hopper; BLOCK_N is PAGE there)
  heads_fast, *_hf  the launch grid's fastest axis is the KV head (programs running together read whole token rows)
  hpp2, hpp4      2 or 4 KV heads per program, their query groups packed in the 16-row tile (one dot per head)
  hpp2_hf_up      hpp2_hf with a tile's four K / V loads issued first (shipped: each load waits on the dot before it)
  hpp2_hf_pf      also the next tile's four loads issued before this tile's attention (registers double-buffered)
  hpp2_wide_hf    one [keys, 2 x D] load per tile for the pair's keys, one for its values; the query rows zero outside
                  their head's columns, so one dot per product serves both heads (each row keeps its own head's sums)
  group_hpp2_hf   with --shared-prompt P --group G (a GRPO group's sequences on the same prompt pages, as a prefix
                  cache gives them): one program per KV head and group reads the prompt's pages once for all G
                  sequences' query rows, hpp2_hf reads each sequence's own pages, the merge joins them by LSE
  hpp2_swap_hf, swap_hf  transposed products (S^T = K.Q^T, O^T = V^T.P^T: the keys / values the M side of a Hopper
                  warpgroup MMA from registers, the query rows its N side), two / one KV heads a program
--tiles BLOCK_N:WARPS:STAGES,.. times each variant at those tiles too (default the shipped 128:4:2); --splits S,..
the split counts to time (default each variant's default, half and double it, up to 16).
  read_only       the same loop's loads and address math, no attention (a sum of the tiles): the gather's own speed
  shipped_bf16    the shipped kernel over a BF16 cache (BF16 query): the structure's speed at 2 bytes an element
  read_only_bf16  the gather alone over the BF16 cache
The variants are switches on a copy of the kernel's split loop (tests/test_benchmarks.py checks `shipped` and the
two-head ones bit-equal to the package kernel's outputs, in Triton's interpreter). The hpp2_hf_up / _pf / wide rows
were all slower on an H200 (RESULTS "where the FP8 decode kernel's loads wait"), the swap rows too (RESULTS "XQA's
Hopper FP8 decode"). Bandwidth = the KV bytes
a step must read / its time (CUDA-graph replays). Error = max |out - float32 reference| / max |out| on the first 8
sequences.

    python benchmarks/decode_attn_variants.py --batches 256,128,16 --json dav.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_attention import D, PAGE, bench, make_batch  # noqa: E402

from flashrl_tools.quant.kernels import fp8_decode_attn  # noqa: E402

VARIANTS = ("package", "shipped", "shipped_cg", "qk_fp8", "qk_fp8_cg", "qk_pv_fp8", "read_only", "shipped_bf16", "read_only_bf16",
            "shipped_paged", "read_only_paged", "tma", "read_only_tma", "tma_bf16", "heads_fast", "read_only_hf",
            "hpp2", "hpp4", "hpp2_hf", "hpp4_hf", "hpp2_hf_up", "hpp2_hf_pf", "hpp2_wide_hf", "group_hpp2_hf", "hpp2_swap_hf",
            "swap_hf")
SHAPES = {"qwen3-8b": (32, 8), "7b": (28, 4), "14b": (40, 8)}


def _kernel():
    global pair_tile, softmax_step  # module names: Triton (and its interpreter) resolve a kernel's callees there
    import triton
    import triton.language as tl

    @triton.jit
    def softmax_step(s, m, l_sum):
        """One tile of the online softmax: its probabilities against the new running max, the factor that rescales
        what came before, the new max and row sums."""
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        return p, alpha, m_new, l_sum * alpha + tl.sum(p, axis=1)

    @triton.jit
    def pair_tile(bt_row, t, end, k_head, v_head, strides, rd, PAGE: tl.constexpr):
        """Two KV heads' keys and values at tokens `t` (those from `end` on masked): four [tokens, D] loads."""
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh = strides
        ok = t < end
        bk = tl.load(bt_row + t // PAGE, mask=ok, other=0).to(tl.int64)
        rk = (bk * stride_kb + (t % PAGE) * stride_ks)[:, None] + rd[None, :]
        rv = (bk * stride_vb + (t % PAGE) * stride_vs)[:, None] + rd[None, :]
        return (tl.load(k_head + rk, mask=ok[:, None], other=0.0),
                tl.load(k_head + stride_kh + rk, mask=ok[:, None], other=0.0),
                tl.load(v_head + rv, mask=ok[:, None], other=0.0),
                tl.load(v_head + stride_vh + rv, mask=ok[:, None], other=0.0))

    @triton.jit
    def split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, qs_ptr, ks_ptr, part_ptr, lse_ptr, sm_scale,
                     stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                     q_heads, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                     BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, MODE: tl.constexpr, BF16: tl.constexpr,
                     STREAM: tl.constexpr, PAGED: tl.constexpr, HF: tl.constexpr, HPP: tl.constexpr,
                     TOTAL: tl.constexpr, LOADS: tl.constexpr = 0, off_ptr=None, SLOT0: tl.constexpr = 0):
        # MODE 0: shipped math (FP16 products; BF16: a BF16 cache, BF16 products), 1: Q.K in FP8, 2: Q.K and P.V in
        # FP8, 3: loads only. HF: grid (kv head groups, seqs, splits). HPP > 1: KV heads kvh..kvh+HPP-1 (MODE 0, FP8).
        # LOADS (HPP 2): 0 each head's K / V load just before its dot (as shipped), 1 the tile's four loads first, 2
        # also the next tile's four loads issued before this tile's attention (kept in registers across the iteration)
        # 3: one [BLOCK_N, 2D] load for the two heads' keys and one for their values; each query row holds its query
        # in its own head's D columns (zeros in the other's), so one dot gives every row its own head's scores, and
        # one P.V dot gives every row both heads' sums, of which it keeps its own head's
        # off_ptr: each sequence's attention starts at its token off_ptr[seq] (the group variant's own pages), its
        # partials written to slots SLOT0.. of TOTAL per row
        if HF:
            seq = tl.program_id(1)
            kvh = tl.program_id(0) * HPP
        else:
            seq = tl.program_id(0)
            kvh = tl.program_id(1) * HPP
        split = tl.program_id(2)
        seq_len = tl.load(lens_ptr + seq)
        base = 0
        if off_ptr is not None:
            base = tl.load(off_ptr + seq)
        per_split = tl.cdiv(tl.cdiv(seq_len - base, SPLITS), BLOCK_N) * BLOCK_N
        start = base + split * per_split
        end = tl.minimum(start + per_split, seq_len)
        rg = tl.arange(0, GROUP_PAD)
        rd = tl.arange(0, D)
        rn = tl.arange(0, BLOCK_N)
        heads = kvh * GROUP + rg
        gmask = rg < GROUP * HPP
        hid = rg // GROUP  # the program's KV head each query row belongs to (HPP > 1)
        q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + rd[None, :],
                    mask=gmask[:, None], other=0.0)
        scale = sm_scale * tl.load(qs_ptr) * tl.load(ks_ptr) * 1.4426950408889634
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D], tl.float32)
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        k_head = k_ptr + kvh * stride_kh
        v_head = v_ptr + kvh * stride_vh
        if LOADS == 1 or LOADS == 2:  # two KV heads a program, the loads issued before the dots (the LOADS note)
            q16 = q.to(tl.float16)
            strides = (stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh)
            k0, k1, v0, v1 = pair_tile(bt_row, start + rn, end, k_head, v_head, strides, rd, PAGE)
            for n in range(start, end, BLOCK_N):
                ok = n + rn < end
                # LOADS 1: this tile's four loads; 2: the next tile's, in flight during this tile's attention
                k0n, k1n, v0n, v1n = pair_tile(bt_row, n + (LOADS - 1) * BLOCK_N + rn, end, k_head, v_head, strides,
                                               rd, PAGE)
                if LOADS == 1:
                    k0, k1, v0, v1 = k0n, k1n, v0n, v1n
                s = tl.where(hid[:, None] == 0, tl.dot(q16, tl.trans(k0.to(tl.float16))),
                             tl.dot(q16, tl.trans(k1.to(tl.float16))))
                s = tl.where(ok[None, :], s * scale, float("-inf"))
                p, alpha, m_new, l_sum = softmax_step(s, m, l_sum)
                acc = acc * alpha[:, None]
                acc += tl.dot(tl.where(hid[:, None] == 0, p, 0.0).to(tl.float16), v0.to(tl.float16))
                acc += tl.dot(tl.where(hid[:, None] == 1, p, 0.0).to(tl.float16), v1.to(tl.float16))
                m = m_new
                k0, k1, v0, v1 = k0n, k1n, v0n, v1n
        if LOADS == 3:
            r2 = tl.arange(0, 2 * D)
            hk = r2 // D  # which of the two heads a column belongs to
            q2 = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + (r2 % D)[None, :],
                         mask=gmask[:, None] & (hk[None, :] == hid[:, None]), other=0.0).to(tl.float16)
            ck = hk * stride_kh + r2 % D
            cv = hk * stride_vh + r2 % D
            acc2 = tl.zeros([GROUP_PAD, 2 * D], tl.float32)
            for n in range(start, end, BLOCK_N):
                t = n + rn
                ok = t < end
                bk = tl.load(bt_row + t // PAGE, mask=ok, other=0).to(tl.int64)
                k2 = tl.load(k_head + (bk * stride_kb + (t % PAGE) * stride_ks)[:, None] + ck[None, :],
                             mask=ok[:, None], other=0.0)
                v2 = tl.load(v_head + (bk * stride_vb + (t % PAGE) * stride_vs)[:, None] + cv[None, :],
                             mask=ok[:, None], other=0.0)
                s = tl.dot(q2, tl.trans(k2.to(tl.float16)))
                s = tl.where(ok[None, :], s * scale, float("-inf"))
                p, alpha, m_new, l_sum = softmax_step(s, m, l_sum)
                acc2 = acc2 * alpha[:, None] + tl.dot(p.to(tl.float16), v2.to(tl.float16))
                m = m_new
            acc3 = tl.reshape(acc2, [GROUP_PAD, 2, D])
            acc = tl.sum(tl.where(tl.arange(0, 2)[None, :, None] == hid[:, None, None], acc3, 0.0), axis=1)
        if LOADS == 4:  # transposed products: S^T = K.Q^T and O^T = V^T.P^T, so the keys / values are the dot's
            # M side (64+ rows: a Hopper warpgroup MMA taking them from registers after widening) and the 16 query
            # rows its N side, where the other variants pad the query rows to M = 16 (Ampere's mma.sync)
            qt = tl.trans(q.to(tl.float16))
            acct = tl.zeros([D, GROUP_PAD], tl.float32)
            for n in range(start, end, BLOCK_N):
                t = n + rn
                ok = t < end
                bk = tl.load(bt_row + t // PAGE, mask=ok, other=0).to(tl.int64)
                rk = bk * stride_kb + (t % PAGE) * stride_ks
                rv = bk * stride_vb + (t % PAGE) * stride_vs
                st = tl.zeros([BLOCK_N, GROUP_PAD], tl.float32)
                for h in tl.static_range(HPP):
                    kh = tl.load(k_head + h * stride_kh + rk[:, None] + rd[None, :], mask=ok[:, None], other=0.0)
                    st = tl.where(hid[None, :] == h, tl.dot(kh.to(tl.float16), qt), st)
                st = tl.where(ok[:, None], st * scale, float("-inf"))
                m_new = tl.maximum(m, tl.max(st, axis=0))
                alpha = tl.exp2(m - m_new)
                pt = tl.exp2(st - m_new[None, :])
                l_sum = l_sum * alpha + tl.sum(pt, axis=0)
                acct = acct * alpha[None, :]
                for h in tl.static_range(HPP):
                    vh = tl.load(v_head + h * stride_vh + rv[:, None] + rd[None, :], mask=ok[:, None], other=0.0)
                    acct += tl.dot(tl.trans(vh.to(tl.float16)), tl.where(hid[None, :] == h, pt, 0.0).to(tl.float16))
                m = m_new
            acc = tl.trans(acct)
        for n in range(start, end if LOADS == 0 else start, BLOCK_N):
            t = n + rn
            valid = t < end
            if PAGED:  # one block-table entry per page, its PAGE rows affine in it
                NP: tl.constexpr = BLOCK_N // PAGE
                rp = n // PAGE + tl.arange(0, NP)
                pg = tl.load(bt_row + rp, mask=rp * PAGE < end, other=0).to(tl.int64)
                rows_k = tl.reshape(pg[:, None] * stride_kb + (tl.arange(0, PAGE) * stride_ks)[None, :], [BLOCK_N])
                rows_v = tl.reshape(pg[:, None] * stride_vb + (tl.arange(0, PAGE) * stride_vs)[None, :], [BLOCK_N])
            else:
                blk = tl.load(bt_row + t // PAGE, mask=valid, other=0).to(tl.int64)
                slot = t % PAGE
                rows_k = blk * stride_kb + slot * stride_ks
                rows_v = blk * stride_vb + slot * stride_vs
            if HPP > 1:  # one dot per KV head on the packed tile, each row keeping its own head's scores / values
                q16 = q.to(tl.float16)
                s = tl.zeros([GROUP_PAD, BLOCK_N], tl.float32)
                for h in tl.static_range(HPP):
                    kh = tl.load(k_head + h * stride_kh + rows_k[:, None] + rd[None, :], mask=valid[:, None],
                                 other=0.0)
                    s = tl.where(hid[:, None] == h, tl.dot(q16, tl.trans(kh.to(tl.float16))), s)
                s = tl.where(valid[None, :], s * scale, float("-inf"))
                p, alpha, m_new, l_sum = softmax_step(s, m, l_sum)
                acc = acc * alpha[:, None]
                for h in tl.static_range(HPP):
                    vh = tl.load(v_head + h * stride_vh + rows_v[:, None] + rd[None, :], mask=valid[:, None],
                                 other=0.0)
                    acc += tl.dot(tl.where(hid[:, None] == h, p, 0.0).to(tl.float16), vh.to(tl.float16))
                m = m_new
            elif STREAM:  # the cache read once: bypass L1, evict first
                k = tl.load(k_head + rows_k[:, None] + rd[None, :], mask=valid[:, None], other=0.0,
                            cache_modifier=".cg", eviction_policy="evict_first")
                v = tl.load(v_head + rows_v[:, None] + rd[None, :], mask=valid[:, None], other=0.0,
                            cache_modifier=".cg", eviction_policy="evict_first")
            else:
                k = tl.load(k_head + rows_k[:, None] + rd[None, :], mask=valid[:, None], other=0.0)
                v = tl.load(v_head + rows_v[:, None] + rd[None, :], mask=valid[:, None], other=0.0)
            if HPP > 1:
                pass
            elif MODE == 3:
                acc += tl.sum(k.to(tl.float32), axis=0)[None, :] + tl.sum(v.to(tl.float32), axis=0)[None, :]
            else:
                if MODE == 0 and not BF16:
                    s = tl.dot(q.to(tl.float16), tl.trans(k.to(tl.float16))) * scale
                else:  # FP8 x FP8, or BF16 x BF16
                    s = tl.dot(q, tl.trans(k)) * scale
                s = tl.where(valid[None, :], s, float("-inf"))
                p, alpha, m_new, l_sum = softmax_step(s, m, l_sum)
                if MODE == 2 or BF16:
                    pv = tl.dot(p.to(v.dtype), v)
                else:
                    pv = tl.dot(p.to(tl.float16), v.to(tl.float16))
                acc = acc * alpha[:, None] + pv
                m = m_new
        row = (seq.to(tl.int64) * q_heads + heads) * TOTAL + SLOT0 + split
        safe = tl.where(l_sum > 0, l_sum, 1.0)
        tl.store(part_ptr + row[:, None] * D + rd[None, :], acc / safe[:, None], mask=gmask[:, None])
        tl.store(lse_ptr + row, tl.where(l_sum > 0, m + tl.log2(safe), float("-inf")), mask=gmask)

    @triton.jit
    def prefix_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, plen_ptr, qs_ptr, ks_ptr, part_ptr, lse_ptr, sm_scale, stride_qt,
                      stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, q_heads,
                      GROUP: tl.constexpr, GSEQ: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                      PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, TOTAL: tl.constexpr):
        # the group variant's shared prompt: one program per (KV head, GRPO group of GSEQ consecutive sequences,
        # split) reads the group's first sequence's prompt pages once, for the query rows of all GSEQ sequences
        kvh = tl.program_id(0)
        grp = tl.program_id(1)
        split = tl.program_id(2)
        lead = grp * GSEQ
        plen = tl.load(plen_ptr + lead)
        per_split = tl.cdiv(tl.cdiv(plen, SPLITS), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, plen)
        r = tl.arange(0, ROWS)
        rd = tl.arange(0, D)
        rn = tl.arange(0, BLOCK_N)
        live = r < GSEQ * GROUP
        seq = lead + r // GROUP
        head = kvh * GROUP + r % GROUP
        q = tl.load(q_ptr + seq.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + rd[None, :],
                    mask=live[:, None], other=0.0).to(tl.float16)
        scale = sm_scale * tl.load(qs_ptr) * tl.load(ks_ptr) * 1.4426950408889634
        m = tl.full([ROWS], float("-inf"), tl.float32)
        l_sum = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D], tl.float32)
        bt_row = bt_ptr + lead.to(tl.int64) * stride_bt
        for n in range(start, end, BLOCK_N):
            t = n + rn
            ok = t < end
            bk = tl.load(bt_row + t // PAGE, mask=ok, other=0).to(tl.int64)
            k = tl.load(k_ptr + kvh * stride_kh + (bk * stride_kb + (t % PAGE) * stride_ks)[:, None] + rd[None, :],
                        mask=ok[:, None], other=0.0)
            v = tl.load(v_ptr + kvh * stride_vh + (bk * stride_vb + (t % PAGE) * stride_vs)[:, None] + rd[None, :],
                        mask=ok[:, None], other=0.0)
            s = tl.where(ok[None, :], tl.dot(q, tl.trans(k.to(tl.float16))) * scale, float("-inf"))
            p, alpha, m, l_sum = softmax_step(s, m, l_sum)
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))
        row = (seq.to(tl.int64) * q_heads + head) * TOTAL + split
        safe = tl.where(l_sum > 0, l_sum, 1.0)
        tl.store(part_ptr + row[:, None] * D + rd[None, :], acc / safe[:, None], mask=live[:, None])
        tl.store(lse_ptr + row, tl.where(l_sum > 0, m + tl.log2(safe), float("-inf")), mask=live)

    @triton.jit
    def merge_kernel(part_ptr, lse_ptr, vs_ptr, out_ptr, stride_ot, stride_oh, q_heads, D: tl.constexpr,
                     SPLITS: tl.constexpr):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        rs = tl.arange(0, SPLITS)
        rd = tl.arange(0, D)
        row = (seq.to(tl.int64) * q_heads + head) * SPLITS
        lse = tl.load(lse_ptr + row + rs)
        w = tl.exp2(lse - tl.max(lse, axis=0))
        part = tl.load(part_ptr + (row + rs)[:, None] * D + rd[None, :])
        o = tl.sum(part * w[:, None], axis=0) / tl.sum(w, axis=0) * tl.load(vs_ptr)
        tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + rd, o.to(out_ptr.dtype.element_ty))

    @triton.jit
    def tma_kernel(q_ptr, k_desc, v_desc, bt_ptr, lens_ptr, qs_ptr, ks_ptr, part_ptr, lse_ptr, sm_scale, stride_qt,
                   stride_qh, stride_bt, k_col0, v_col0, col_step, q_heads, GROUP: tl.constexpr,
                   GROUP_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, SPLITS: tl.constexpr,
                   MODE: tl.constexpr, BF16: tl.constexpr):
        # one page (PAGE rows of one KV head: a [PAGE, D] box) per iteration through a tensor descriptor (TMA on
        # Hopper) over the cache viewed as [slots, kv_heads * row]; MODE 0: attention as shipped, 3: loads only
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(lens_ptr + seq)
        n_pages = tl.cdiv(seq_len, PAGE)
        per_split = tl.cdiv(n_pages, SPLITS)
        p0 = split * per_split
        p1 = tl.minimum(p0 + per_split, n_pages)
        rg = tl.arange(0, GROUP_PAD)
        rd = tl.arange(0, D)
        heads = kvh * GROUP + rg
        gmask = rg < GROUP
        q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + rd[None, :],
                    mask=gmask[:, None], other=0.0)
        if not BF16:
            q = q.to(tl.float16)
        scale = sm_scale * tl.load(qs_ptr) * tl.load(ks_ptr) * 1.4426950408889634
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D], tl.float32)
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        kcol = k_col0 + kvh * col_step
        vcol = v_col0 + kvh * col_step
        for pg in range(p0, p1):
            row = tl.load(bt_row + pg) * PAGE
            k = k_desc.load([row, kcol])
            v = v_desc.load([row, vcol])
            if MODE == 3:
                acc += tl.sum(k.to(tl.float32), axis=0)[None, :] + tl.sum(v.to(tl.float32), axis=0)[None, :]
            else:
                valid = pg * PAGE + tl.arange(0, PAGE) < seq_len
                s = tl.dot(q, tl.trans(k.to(q.dtype))) * scale
                s = tl.where(valid[None, :], s, float("-inf"))
                p, alpha, m_new, l_sum = softmax_step(s, m, l_sum)
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
                m = m_new
        out_row = (seq.to(tl.int64) * q_heads + heads) * SPLITS + split
        safe = tl.where(l_sum > 0, l_sum, 1.0)
        tl.store(part_ptr + out_row[:, None] * D + rd[None, :], acc / safe[:, None], mask=gmask[:, None])
        tl.store(lse_ptr + out_row, tl.where(l_sum > 0, m + tl.log2(safe), float("-inf")), mask=gmask)

    return split_kernel, merge_kernel, tma_kernel, prefix_kernel


def tma_fn(name: str, b: dict, q_heads: int, kv_heads: int, splits: int, out: torch.Tensor, num_warps: int,
           num_stages: int, part: torch.Tensor, lse: torch.Tensor, raw: torch.Tensor, q: torch.Tensor,
           qs: torch.Tensor, bf16: bool):
    """The `tma` variants: the cache ([blocks, page, kv_heads, K|V], contiguous) as a 2-D tensor of slots, K and V
    one [PAGE, D] box per page and head."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    _, merge_kernel, tma_kernel, _ = _kernel()
    slots = raw.view(-1, raw.shape[2] * raw.shape[3])
    desc = TensorDescriptor(slots, list(slots.shape), list(slots.stride()), [PAGE, D])
    group = q_heads // kv_heads

    def run():
        tma_kernel[(b["lens"].shape[0], kv_heads, splits)](
            q, desc, desc, b["bt"], b["lens"], qs, b["k_scale"], part, lse, D ** -0.5, q.stride(0), q.stride(1),
            b["bt"].stride(0), 0, D, 2 * D, q_heads, GROUP=group, GROUP_PAD=max(16, 1 << (group - 1).bit_length()),
            D=D, PAGE=PAGE, SPLITS=splits, MODE=3 if name.startswith("read_only") else 0, BF16=bf16,
            num_warps=num_warps, num_stages=num_stages)
        merge_kernel[(b["lens"].shape[0], q_heads)](part, lse, b["v_scale"], out, out.stride(0), out.stride(1),
                                                    q_heads, D=D, SPLITS=splits, num_warps=4)
    return run


def programs_heads(name: str, q_heads: int, kv_heads: int) -> int:
    """The KV heads one program of `name` holds (the default splits count programs per sequence)."""
    if name == "package":
        return fp8_decode_attn.heads_per_program(q_heads, kv_heads)
    return 4 if "hpp4" in name else 2 if "hpp2" in name else 1


def variant_fn(name: str, b: dict, q_heads: int, kv_heads: int, splits: int, block_n: int, out: torch.Tensor,
               num_warps: int = 4, num_stages: int = 2):
    split_kernel, merge_kernel, _, prefix_kernel = _kernel()
    batch, raw = b["lens"].shape[0], b["raw"]
    bf16 = name.endswith("_bf16")
    if bf16:
        raw = b.setdefault("raw16", raw.to(torch.bfloat16))
    k, v = raw[..., :D], raw[..., D:]
    q = b["q16"] if bf16 else b["q8"]
    qs = torch.ones(1, device=b["lens"].device) if bf16 else b["q_scale"]
    mode = 3 if name.startswith("read_only") else 2 if name.startswith("qk_pv_fp8") else 1 if name.startswith("qk_fp8") \
        else 0
    group = q_heads // kv_heads
    hpp = programs_heads(name, q_heads, kv_heads)
    if kv_heads % hpp or group * hpp > max(16, 1 << (group - 1).bit_length()):
        raise ValueError(f"{name}: {kv_heads} KV heads of {group} query heads do not pack {hpp} to a 16-row tile")
    hf = name == "heads_fast" or name.endswith("_hf") or "_hf_" in name
    loads = 4 if "swap" in name else 3 if "wide" in name else 2 if name.endswith("_pf") else 1 if name.endswith("_up") \
        else 0
    grid = (kv_heads // hpp, batch, splits) if hf else (batch, kv_heads // hpp, splits)
    grouped = name.startswith("group_")  # the group's shared prompt in `splits` slots, each sequence's own in `splits`
    total = 2 * splits if grouped else splits
    part = torch.empty((batch * q_heads * total, D), dtype=torch.float32, device=b["lens"].device)
    lse = torch.empty((batch * q_heads * total,), dtype=torch.float32, device=b["lens"].device)
    off = None
    if grouped:
        gseq, shared = b.get("group", 0), b.get("shared", 0) // PAGE * PAGE
        if not shared or batch % gseq:
            raise ValueError(f"{name}: needs --shared-prompt of a page or more and a batch of whole groups")
        off = torch.full((batch,), shared, dtype=torch.int32, device=b["lens"].device)
    if name == "package":
        return lambda: fp8_decode_attn.fp8_decode_attention(q, k, v, out, b["bt"], b["lens"], b["qsl"], D ** -0.5,
                                                            b["k_scale"], b["v_scale"], q_scale=qs, splits=splits)
    if "tma" in name:
        return tma_fn(name, b, q_heads, kv_heads, splits, out, num_warps, num_stages, part, lse, raw, q, qs, bf16)

    def run():
        if grouped:
            prefix_kernel[(kv_heads, batch // gseq, splits)](
                q, k, v, b["bt"], off, qs, b["k_scale"], part, lse, D ** -0.5, q.stride(0), q.stride(1), k.stride(0),
                k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), b["bt"].stride(0), q_heads,
                GROUP=group, GSEQ=gseq, ROWS=max(16, 1 << (gseq * group - 1).bit_length()), D=D, PAGE=PAGE,
                BLOCK_N=block_n, SPLITS=splits, TOTAL=total, num_warps=num_warps, num_stages=num_stages)
        split_kernel[grid](
            q, k, v, b["bt"], b["lens"], qs, b["k_scale"], part, lse, D ** -0.5, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), b["bt"].stride(0), q_heads,
            GROUP=group, GROUP_PAD=max(16, 1 << (group - 1).bit_length()), D=D, PAGE=PAGE, BLOCK_N=block_n,
            SPLITS=splits, MODE=mode, BF16=bf16, STREAM=name.endswith("_cg"),
            PAGED="paged" in name, HF=hf, HPP=hpp, TOTAL=total, LOADS=loads, off_ptr=off, SLOT0=total - splits,
            num_warps=num_warps, num_stages=num_stages)
        merge_kernel[(batch, q_heads)](part, lse, b["v_scale"], out, out.stride(0), out.stride(1), q_heads, D=D,
                                       SPLITS=total, num_warps=4)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3-8b")
    ap.add_argument("--batches", default="256,128,16")
    ap.add_argument("--ctx", type=int, default=3000)
    ap.add_argument("--tiles", default="128:4:2", help="BLOCK_N:WARPS:STAGES,...")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--shared-prompt", type=int, default=0, help="tokens of a prompt each --group of sequences shares")
    ap.add_argument("--group", type=int, default=8, help="sequences per GRPO group (with --shared-prompt)")
    ap.add_argument("--splits", default="", help="split counts to time (default: each variant's default, half and "
                    "double it, up to 16)")
    ap.add_argument("--json")
    args = ap.parse_args()
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        sys.exit(f"error: --variants {','.join(unknown)}: unknown (use some of {','.join(VARIANTS)})")
    if not torch.cuda.is_available():
        sys.exit("error: decode_attn_variants.py needs a CUDA GPU (it times Triton kernels on the device); on CPU "
                 "tests/test_benchmarks.py checks its variants through Triton's interpreter")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    print(f"{torch.cuda.get_device_name(0)}: one layer's decode attention, us (TB/s), contexts "
          f"{args.ctx // 2}..{3 * args.ctx // 2}; error vs float32")
    tiles = [tuple(int(x) for x in t.split(":")) for t in args.tiles.split(",")]
    for shape in args.shapes.split(","):
        q_heads, kv_heads = SHAPES[shape]
        for batch in (int(x) for x in args.batches.split(",")):
            b = make_batch(q_heads, kv_heads, batch, args.ctx, torch.Generator(device="cuda").manual_seed(0),
                           shared=args.shared_prompt, group=args.group)
            b.update(shared=args.shared_prompt, group=args.group)
            n = min(8, batch)
            ref = fp8_decode_attn.reference(b["q8"][:n], b["raw"][..., :D], b["raw"][..., D:], b["bt"][:n],
                                            b["lens"][:n], b["qsl"][:n + 1], D ** -0.5, b["k_scale"], b["v_scale"],
                                            q_scale=b["q_scale"])
            for name, (block_n, warps, stages) in ((v, t) for v in args.variants.split(",") for t in tiles):
                default = fp8_decode_attn.splits_for(batch, kv_heads // programs_heads(name, q_heads, kv_heads), sms)
                chosen = [int(x) for x in args.splits.split(",")] if args.splits else \
                    sorted({max(1, default // 2), default, min(16, default * 2)})
                for splits in chosen:
                    out = torch.zeros(batch, q_heads, D, dtype=torch.bfloat16, device=b["lens"].device)
                    row = {"shape": shape, "batch": batch, "variant": name, "splits": splits,
                           "default_splits": splits == default, "block_n": block_n, "num_warps": warps,
                           "num_stages": stages}
                    try:
                        fn = variant_fn(name, b, q_heads, kv_heads, splits, block_n, out, warps, stages)
                        fn()
                        torch.cuda.synchronize()
                        us = bench(fn)
                        bytes_ = b["kv_bytes"] * (2 if name.endswith("_bf16") else 1)
                        row.update(us=us, tb_s=bytes_ / us / 1e6)
                        if not name.startswith("read_only"):
                            row["error"] = float((out[:n].float() - ref).abs().max() / ref.abs().max())
                    except Exception as e:  # noqa: BLE001 -- a variant that does not compile is a row too
                        row["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                    rows.append(row)
                    print(f"{shape:9} {batch:4} {name:20} {block_n:3}:{warps}:{stages} splits {splits:2}"
                          f"{'*' if splits == default else ' '} "
                          + (f"{row['us']:9.1f} ({row['tb_s']:.2f})" if "us" in row else row["failed"])
                          + (f"  err {row['error']:.4f}" if "error" in row else ""), flush=True)
                    if args.json:  # rewritten after every row: a run cut short keeps what it timed
                        tmp = args.json + ".tmp"
                        with open(tmp, "w") as f:
                            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                       "ctx": args.ctx, "shared_prompt": args.shared_prompt, "group": args.group,
                                       "rows": rows}, f, indent=1)
                        os.replace(tmp, args.json)
            del b


if __name__ == "__main__":
    main()
