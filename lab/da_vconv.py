# ruff: noqa  (an experiment; its results: benchmarks/results/decode_attention/where_time_goes.json)
"""Experiment (issue 74): where the package's FP8 decode kernel spends the time the loads alone do not (H200: loads
4.3 TB/s, kernel 3.0), and whether converting K / V to FP16 in the loaded (blocked) layout, before the dot's
operand layout (8-bit V has no transposing ldmatrix), lifts it. A copy of the split kernel with switches:
K_MODE / V_MODE 0 = as the package, 1 = inline-asm cvt.rn.f16x2.e4m3x2 (pure), 2 = the same not pure (Triton cannot
move it), 3 = skipped (diagnostic, wrong output); RANGE_STAGES > 0: tl.range(num_stages=...). JSON to argv[1]."""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flashrl_tools.quant.kernels import fp8_decode_attn  # noqa: E402
from da_pages import make, D, PAGE  # noqa: E402

ASM: tl.constexpr = tl.constexpr("{ .reg .b16 lo, hi;\n mov.b32 {lo, hi}, $2;\n cvt.rn.f16x2.e4m3x2 $0, lo;\n"
       " cvt.rn.f16x2.e4m3x2 $1, hi; }")



@triton.jit
def _to16(x, MODE: tl.constexpr):
    if MODE == 1:
        return tl.inline_asm_elementwise(ASM, "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16,
                                         is_pure=True, pack=4)
    elif MODE == 2:
        return tl.inline_asm_elementwise(ASM, "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16,
                                         is_pure=False, pack=4)
    else:
        return x.to(tl.float16)


@triton.jit
def split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, qsl_ptr, qs_ptr, ks_ptr, vs_ptr, out_ptr, part_ptr, lse_ptr,
                 sm_scale, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                 stride_bt, stride_ot, stride_oh, q_heads, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                 D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, HPP: tl.constexpr,
                 K_MODE: tl.constexpr, V_MODE: tl.constexpr, RANGE_STAGES: tl.constexpr):
    kvh = tl.program_id(0) * HPP
    seq = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq)
    tok = tl.load(qsl_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    rg = tl.arange(0, GROUP_PAD)
    rd = tl.arange(0, D)
    rn = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + rg
    gmask = rg < GROUP * HPP
    hid = rg // GROUP
    q = tl.load(q_ptr + tok.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + rd[None, :],
                mask=gmask[:, None], other=0.0).to(tl.float16)
    scale = sm_scale * tl.load(qs_ptr) * tl.load(ks_ptr) * 1.4426950408889634
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_ptr + kvh * stride_kh
    v_head = v_ptr + kvh * stride_vh
    for n in tl.range(start, end, BLOCK_N, num_stages=RANGE_STAGES if RANGE_STAGES > 0 else None):
        t = n + rn
        valid = t < end
        blk = tl.load(bt_row + t // PAGE, mask=valid, other=0).to(tl.int64)
        slot = t % PAGE
        rows_k = blk[:, None] * stride_kb + slot[:, None] * stride_ks + rd[None, :]
        rows_v = blk[:, None] * stride_vb + slot[:, None] * stride_vs + rd[None, :]
        s = tl.zeros([GROUP_PAD, BLOCK_N], tl.float32)
        if K_MODE != 3:
            for h in tl.static_range(HPP):
                k = _to16(tl.load(k_head + h * stride_kh + rows_k, mask=valid[:, None], other=0.0), K_MODE)
                s = tl.where(hid[:, None] == h, tl.dot(q, tl.trans(k)), s)
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if V_MODE != 3:
            for h in tl.static_range(HPP):
                v = _to16(tl.load(v_head + h * stride_vh + rows_v, mask=valid[:, None], other=0.0), V_MODE)
                acc += tl.dot(tl.where(hid[:, None] == h, p, 0.0).to(tl.float16), v)
        m = m_new
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


def call(q, kc, vc, out, bt, lens, qsl, sm_scale, ks, vs, qs, splits, k_mode=0, v_mode=0, range_stages=0,
         block_n=64, num_warps=4, num_stages=2, hpp=None):
    _, merge = fp8_decode_attn._kernels()
    nseq, q_heads = lens.shape[0], q.shape[1]
    kvh = kc.shape[2]
    group = q_heads // kvh
    hpp = hpp or fp8_decode_attn.heads_per_program(q_heads, kvh)
    gpad = max(16, 1 << (hpp * group - 1).bit_length())
    part = lse = out
    if splits > 1:
        part = torch.empty((nseq * q_heads * splits, D), dtype=torch.float32, device=q.device)
        lse = torch.empty((nseq * q_heads * splits,), dtype=torch.float32, device=q.device)
    split_kernel[(kvh // hpp, nseq, splits)](
        q, kc, vc, bt, lens, qsl, qs, ks, vs, out, part, lse, sm_scale, q.stride(0), q.stride(1), kc.stride(0),
        kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2), bt.stride(0), out.stride(0),
        out.stride(1), q_heads, GROUP=group, GROUP_PAD=gpad, D=D, PAGE=PAGE, BLOCK_N=block_n, SPLITS=splits, HPP=hpp,
        K_MODE=k_mode, V_MODE=v_mode, RANGE_STAGES=range_stages, num_warps=num_warps, num_stages=num_stages)
    if splits > 1:
        merge[(nseq, q_heads)](part, lse, lens, qsl, vs, out, out.stride(0), out.stride(1), q_heads, D=D,
                               SPLITS=splits, num_warps=4)
    return out


VARIANTS = {  # name: (k_mode, v_mode, range_stages, block_n, num_warps, num_stages)
    "copy": (0, 0, 0, 64, 4, 2), "v_asm_np": (0, 2, 0, 64, 4, 2),
    "kv_asm_np": (2, 2, 0, 64, 4, 2), "v_asm_np_r3": (0, 2, 3, 64, 4, 2), "kv_asm_np_r3": (2, 2, 3, 64, 4, 2),
    "v_asm_np_128w8": (0, 2, 0, 128, 8, 2), "v_asm_np_r3_128w8": (0, 2, 3, 128, 8, 2),
    "v_asm_np_w8": (0, 2, 0, 64, 8, 2),
}


def main(path):
    gen = torch.Generator(device="cuda").manual_seed(0)
    bench = lambda fn: triton.testing.do_bench_cudagraph(fn, rep=50) * 1000.0  # noqa: E731
    rows = []
    for shape, (qh, kvh) in {"qwen3-8b": (32, 8), "14b": (40, 8), "7b": (28, 4)}.items():
        for batch in (256, 128, 64, 16):
            b = make(qh, kvh, batch, 3000, gen, "cuda")
            out = torch.empty(batch, qh, D, dtype=torch.bfloat16, device="cuda")
            ref = fp8_decode_attn.reference(b["q8"][:8], b["k"], b["v"], b["bt"][:8], b["lens"][:8], b["qsl"][:9],
                                            D ** -0.5, b["ks"], b["vs"], q_scale=b["qs"])
            dflt = fp8_decode_attn.splits_for(batch, kvh // fp8_decode_attn.heads_per_program(qh, kvh), 132)
            cands = {"package": lambda: fp8_decode_attn.fp8_decode_attention(
                b["q8"], b["k"], b["v"], out, b["bt"], b["lens"], b["qsl"], D ** -0.5, b["ks"], b["vs"],
                q_scale=b["qs"])}
            for name, (km, vm, rs, bn, nw, ns) in VARIANTS.items():
                for sp in sorted({dflt, max(1, dflt // 2), dflt * 2}):
                    cands[f"{name}/s{sp}"] = lambda km=km, vm=vm, rs=rs, bn=bn, nw=nw, ns=ns, sp=sp: call(
                        b["q8"], b["k"], b["v"], out, b["bt"], b["lens"], b["qsl"], D ** -0.5, b["ks"], b["vs"],
                        b["qs"], sp, km, vm, rs, bn, nw, ns)
            for name, fn in cands.items():
                row = {"shape": shape, "batch": batch, "ctx": 3000, "variant": name}
                try:
                    out.zero_()
                    fn()
                    torch.cuda.synchronize()
                    row["err"] = ((out[:8].float() - ref).abs().max() / ref.abs().max()).item()
                    us = bench(fn)
                    row.update(us=round(us, 2), tb_s=round(b["kv_bytes"] / us / 1e6, 3))
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"[-700:]
                rows.append(row)
                print(json.dumps(row), flush=True)
            del b
            torch.cuda.empty_cache()
            with open(path + ".tmp", "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "triton": triton.__version__, "rows": rows}, f, indent=1)
            os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main(sys.argv[1])
