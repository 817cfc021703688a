"""FLASHRL_DECODE_ATTN=fp8qk's split kernel (issue 74; opt-in): `fp8_decode_attn`'s decode attention with the scores
computed transposed, so Hopper's FP8 warpgroup MMA takes the FP8 keys as stored. Launched by
`fp8_decode_attn.fp8_decode_attention(qk_fp8=True)` (the same operands, splits and merge kernel), which hands it its
jit helpers (`fp8_decode_attn_jit`: bounds, score scale, page rows, `to_f16`): this module imports neither."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def kernel(helpers):
    """The split kernel with the scores computed transposed, S^T = K . Q^T: keys as the MMA's first operand (64+
    rows: Hopper's warpgroup MMA) take FP8 straight from shared memory with the FP8 query (no conversion of K; the
    products are the same exact FP8 x FP8 products the FP16 path forms, summed by the tensor core), then
    O^T = V^T . P^T in FP16 (V converted by `to_f16`). Opt-in (`qk_fp8=True`, FLASHRL_DECODE_ATTN=fp8qk) until it is
    measured against the default on a GPU. `helpers`: the module whose `kernels()` defines the shared jit helpers
    (`fp8_decode_attn_jit`)."""
    import triton
    import triton.language as tl

    global to_f16, _bounds, _score_scale, _page_rows, _program_seq  # module globals: Triton resolves callees there
    helpers.kernels()  # defines them
    to_f16, _bounds, _score_scale, _page_rows = helpers.to_f16, helpers._bounds, helpers._score_scale, helpers._page_rows
    _program_seq = helpers._program_seq

    @triton.jit
    def fp8_decode_attn_split_fp8qk(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, qsl_ptr, qs_ptr, ks_ptr, vs_ptr, out_ptr,
                                    part_ptr, lse_ptr, order_ptr, sm_scale, stride_qt, stride_qh, stride_kb,
                                    stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, stride_ot,
                                    stride_oh, q_heads, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
                                    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                                    Q_SCALED: tl.constexpr, HPP: tl.constexpr, V_ASM: tl.constexpr,
                                    ORDERED: tl.constexpr, WIDEN: tl.constexpr, MIN_SPLIT: tl.constexpr):
        kvh = tl.program_id(0) * HPP
        seq = _program_seq(order_ptr, ORDERED)
        split = tl.program_id(2)
        seq_len, tok, q_len, start, end = _bounds(lens_ptr, qsl_ptr, seq, split, SPLITS, BLOCK_N, MIN_SPLIT)
        if (q_len > 0) & (start < seq_len):
            rg = tl.arange(0, GROUP_PAD)
            rd = tl.arange(0, D)
            rn = tl.arange(0, BLOCK_N)
            heads = kvh * GROUP + rg
            gmask = rg < GROUP * HPP
            hid = rg // GROUP
            q = tl.load(q_ptr + tok.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + rd[None, :],
                        mask=gmask[:, None], other=0.0)
            if WIDEN:  # Triton's interpreter: the same exact products in FP16
                q = q.to(tl.float16)
            scale = _score_scale(sm_scale, qs_ptr, ks_ptr, Q_SCALED)
            m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
            l_sum = tl.zeros([GROUP_PAD], tl.float32)
            acc = tl.zeros([D, GROUP_PAD], tl.float32)  # O^T
            bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
            k_head = k_ptr + kvh * stride_kh
            v_head = v_ptr + kvh * stride_vh
            for n in range(start, end, BLOCK_N):
                valid, rows_k, rows_v = _page_rows(bt_row, n + rn, end, rd, stride_kb, stride_ks, stride_vb, stride_vs,
                                                   PAGE)
                s = tl.zeros([BLOCK_N, GROUP_PAD], tl.float32)  # S^T: a column per query row
                for h in tl.static_range(HPP):
                    k = tl.load(k_head + h * stride_kh + rows_k, mask=valid[:, None], other=0.0)
                    if WIDEN:
                        k = k.to(tl.float16)
                    s = tl.where(hid[None, :] == h, tl.dot(k, tl.trans(q)), s)
                s = tl.where(valid[:, None], s * scale, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=0))
                alpha = tl.exp2(m - m_new)
                p = tl.exp2(s - m_new[None, :])
                l_sum = l_sum * alpha + tl.sum(p, axis=0)
                acc = acc * alpha[None, :]
                for h in tl.static_range(HPP):
                    v = tl.load(v_head + h * stride_vh + rows_v, mask=valid[:, None], other=0.0)
                    acc += tl.dot(tl.trans(to_f16(v, V_ASM)), tl.where(hid[None, :] == h, p, 0.0).to(tl.float16))
                m = m_new
            if SPLITS == 1:
                o = acc / l_sum[None, :] * tl.load(vs_ptr)
                tl.store(out_ptr + tok.to(tl.int64) * stride_ot + heads[None, :] * stride_oh + rd[:, None],
                         o.to(out_ptr.dtype.element_ty), mask=gmask[None, :])
            else:
                row = (seq.to(tl.int64) * q_heads + heads) * SPLITS + split
                safe = tl.where(l_sum > 0, l_sum, 1.0)
                tl.store(part_ptr + row[None, :] * D + rd[:, None], acc / safe[None, :], mask=gmask[None, :])
                lse = tl.where(l_sum > 0, m + tl.log2(safe), float("-inf"))
                tl.store(lse_ptr + row, lse, mask=gmask)

    return fp8_decode_attn_split_fp8qk
