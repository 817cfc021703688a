"""`fp8_decode_attn`'s Triton kernels (issue 45; the math and the operands: that module's docstring): the split kernel,
the merge, and the jit helpers the FP8-score (`fp8_decode_attn_qk`) and balanced (`fp8_decode_attn_bal`) kernels
share with them -- the split's bounds, the score scale, a tile's page rows, the query load, the key loop `_attend`,
`to_f16` (FP8 E4M3 -> FP16 in registers). `fp8_decode_attn.fp8_decode_attention` launches them."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def kernels():
    """The split kernel and the merge kernel; defines the jit helpers `fp8_decode_attn_qk` and `fp8_decode_attn_bal`
    take from this module."""
    import triton
    import triton.language as tl

    global to_f16  # a module global: Triton's interpreter resolves a kernel's callees there, not in this closure

    @triton.jit
    def to_f16(x, ASM: tl.constexpr):
        """FP8 E4M3 -> FP16 (exact). ASM: through `cvt.rn.f16x2.e4m3x2` in an asm block Triton may not move, so the
        conversion runs in the loaded layout and the FP16 tile reaches the dot through shared memory and a transposing
        ldmatrix; a plain cast is hoisted after the dot operand's shared-memory read, which reads 8-bit V a byte at a
        time (no transposing ldmatrix for 8 bits)."""
        if ASM:
            return tl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
                "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)
        else:
            return x.to(tl.float16)

    global _bounds, _per_split, _score_scale, _page_rows, _program_seq, _query, _attend  # shared parts (as to_f16)

    @triton.jit
    def _program_seq(order_ptr, ORDERED: tl.constexpr):
        """The sequence a program takes: its grid row, or (ORDERED) that row's entry of `order` (longest first, so
        the long sequences start in the first wave and the short ones fill the last; each sequence's math unchanged)."""
        if ORDERED:
            return tl.load(order_ptr + tl.program_id(1))
        else:
            return tl.program_id(1)

    @triton.jit
    def _per_split(seq_len, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr):
        """A split's keys: the length over SPLITS in whole tiles, at least MIN_SPLIT (then the splits past the
        sequence's end are empty: a long sequence takes them all, a short one few, under one launch grid)."""
        per_split = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
        if MIN_SPLIT > 0:
            per_split = tl.maximum(per_split, MIN_SPLIT)
        return per_split

    @triton.jit
    def _bounds(lens_ptr, qsl_ptr, seq, split, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr):
        """(the sequence's length, its query token, its query tokens, this split's first and last key + 1)."""
        seq_len = tl.load(lens_ptr + seq)
        tok = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - tok
        per_split = _per_split(seq_len, SPLITS, BLOCK_N, MIN_SPLIT)
        start = split * per_split
        return seq_len, tok, q_len, start, tl.minimum(start + per_split, seq_len)

    @triton.jit
    def _score_scale(sm_scale, qs_ptr, ks_ptr, Q_SCALED: tl.constexpr):
        """The scores' scale in base 2 (exp2): softmax scale x query scale (a tensor's) x key scale x log2(e)."""
        if Q_SCALED:
            return sm_scale * tl.load(qs_ptr) * tl.load(ks_ptr) * 1.4426950408889634
        else:
            return sm_scale * tl.load(ks_ptr) * 1.4426950408889634

    @triton.jit
    def _page_rows(bt_row, t, end, rd, stride_kb, stride_ks, stride_vb, stride_vs, PAGE: tl.constexpr):
        """For keys `t`: (which are the split's, their K rows' and V rows' offsets through the block table)."""
        valid = t < end
        blk = tl.load(bt_row + t // PAGE, mask=valid, other=0).to(tl.int64)
        slot = t % PAGE
        return (valid, blk[:, None] * stride_kb + slot[:, None] * stride_ks + rd[None, :],
                blk[:, None] * stride_vb + slot[:, None] * stride_vs + rd[None, :])

    @triton.jit
    def _query(q_ptr, tok, heads, gmask, rd, stride_qt, stride_qh, Q_FP8: tl.constexpr):
        """A program's query rows (its KV heads' query heads), FP8 widened to FP16 (exact)."""
        q = tl.load(q_ptr + tok.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + rd[None, :], mask=gmask[:, None],
                    other=0.0)
        if Q_FP8:
            q = q.to(tl.float16)
        return q

    @triton.jit
    def _attend(q, k_ptr, v_ptr, bt_ptr, kvh, seq, start, end, scale, hid, rd, rn, stride_kb, stride_ks, stride_kh,
                stride_vb, stride_vs, stride_vh, stride_bt, GROUP_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                BLOCK_N: tl.constexpr, HPP: tl.constexpr, V_ASM: tl.constexpr):
        """Keys [start, end) of sequence `seq` against the query rows of KV heads kvh.. (`hid`: each row's of the
        HPP): the online softmax's running max, sum and unnormalised output, float32 in base 2."""
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D], tl.float32)
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        k_head = k_ptr + kvh * stride_kh
        v_head = v_ptr + kvh * stride_vh
        for n in range(start, end, BLOCK_N):
            valid, rows_k, rows_v = _page_rows(bt_row, n + rn, end, rd, stride_kb, stride_ks, stride_vb, stride_vs, PAGE)
            if HPP == 1:
                k = tl.load(k_head + rows_k, mask=valid[:, None], other=0.0)
                v = tl.load(v_head + rows_v, mask=valid[:, None], other=0.0)
                s = tl.dot(q, tl.trans(k.to(q.dtype)))
            else:  # each row keeps the scores against its own KV head
                s = tl.zeros([GROUP_PAD, BLOCK_N], tl.float32)
                for h in tl.static_range(HPP):
                    k = tl.load(k_head + h * stride_kh + rows_k, mask=valid[:, None], other=0.0)
                    s = tl.where(hid[:, None] == h, tl.dot(q, tl.trans(k.to(q.dtype))), s)
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None]
            if HPP == 1:
                acc += tl.dot(p.to(tl.float16), to_f16(v, V_ASM))
            else:  # each row's probabilities against its own KV head's values
                for h in tl.static_range(HPP):
                    v = tl.load(v_head + h * stride_vh + rows_v, mask=valid[:, None], other=0.0)
                    acc += tl.dot(tl.where(hid[:, None] == h, p, 0.0).to(tl.float16), to_f16(v, V_ASM))
            m = m_new
        return m, l_sum, acc

    @triton.jit
    def fp8_decode_attn_split(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, qsl_ptr, qs_ptr, ks_ptr, vs_ptr, out_ptr,
                              part_ptr, lse_ptr, order_ptr, sm_scale, stride_qt, stride_qh, stride_kb, stride_ks,
                              stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, stride_ot, stride_oh, q_heads,
                              GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                              BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, Q_FP8: tl.constexpr,
                              Q_SCALED: tl.constexpr, HPP: tl.constexpr, V_ASM: tl.constexpr, ORDERED: tl.constexpr,
                              MIN_SPLIT: tl.constexpr):
        kvh = tl.program_id(0) * HPP  # the program's first KV head; it holds HPP of them
        seq = _program_seq(order_ptr, ORDERED)
        split = tl.program_id(2)
        seq_len, tok, q_len, start, end = _bounds(lens_ptr, qsl_ptr, seq, split, SPLITS, BLOCK_N, MIN_SPLIT)
        if (q_len > 0) & (start < seq_len):  # an empty split writes nothing (the merge reads only the others)
            rg = tl.arange(0, GROUP_PAD)
            rd = tl.arange(0, D)
            rn = tl.arange(0, BLOCK_N)
            heads = kvh * GROUP + rg
            gmask = rg < GROUP * HPP
            hid = rg // GROUP  # which of the program's KV heads a query row belongs to
            q = _query(q_ptr, tok, heads, gmask, rd, stride_qt, stride_qh, Q_FP8)
            scale = _score_scale(sm_scale, qs_ptr, ks_ptr, Q_SCALED)
            m, l_sum, acc = _attend(q, k_ptr, v_ptr, bt_ptr, kvh, seq, start, end, scale, hid, rd, rn, stride_kb,
                                    stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, GROUP_PAD, D, PAGE,
                                    BLOCK_N, HPP, V_ASM)
            if SPLITS == 1:
                o = acc / l_sum[:, None] * tl.load(vs_ptr)
                tl.store(out_ptr + tok.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + rd[None, :],
                         o.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
            else:
                row = (seq.to(tl.int64) * q_heads + heads) * SPLITS + split
                safe = tl.where(l_sum > 0, l_sum, 1.0)
                tl.store(part_ptr + row[:, None] * D + rd[None, :], acc / safe[:, None], mask=gmask[:, None])
                lse = tl.where(l_sum > 0, m + tl.log2(safe), float("-inf"))
                tl.store(lse_ptr + row, lse, mask=gmask)

    @triton.jit
    def fp8_decode_attn_merge(part_ptr, lse_ptr, lens_ptr, qsl_ptr, vs_ptr, out_ptr, stride_ot, stride_oh, q_heads,
                              D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
                              HEADS: tl.constexpr):
        """HEADS query heads of a sequence, one after another, each as one head a program computes it (same bits)."""
        seq = tl.program_id(0)
        tok = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - tok
        seq_len = tl.load(lens_ptr + seq)
        if (q_len > 0) & (seq_len > 0):
            rs = tl.arange(0, SPLITS)
            rd = tl.arange(0, D)
            live = rs < tl.cdiv(seq_len, _per_split(seq_len, SPLITS, BLOCK_N, MIN_SPLIT))  # the splits with keys
            v_scale = tl.load(vs_ptr)
            for i in tl.static_range(HEADS):
                head = tl.program_id(1) * HEADS + i
                row = (seq.to(tl.int64) * q_heads + head) * SPLITS
                lse = tl.load(lse_ptr + row + rs, mask=live, other=float("-inf"))
                w = tl.exp2(lse - tl.max(lse, axis=0))
                part = tl.load(part_ptr + (row + rs)[:, None] * D + rd[None, :], mask=live[:, None], other=0.0)
                o = tl.sum(part * w[:, None], axis=0) / tl.sum(w, axis=0) * v_scale
                tl.store(out_ptr + tok.to(tl.int64) * stride_ot + head * stride_oh + rd, o.to(out_ptr.dtype.element_ty))

    return fp8_decode_attn_split, fp8_decode_attn_merge  # the names a profiler shows
