# ruff: noqa  (an experiment; its results: benchmarks/results/decode_attention/where_time_goes.json)
"""Experiment (issue 74): does reading whole pages (every KV head of a page, 16 KB contiguous in vLLM's NHD cache)
lift the FP8 decode read toward 3.6 TB/s? Load-only probes (per-row 128-byte gathers vs whole pages) and an
all-heads attention kernel (one program per sequence and split, batched per-head dots), against the package's kernel.
Writes JSON to argv[1]."""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from flashrl_tools.quant.kernels import fp8_decode_attn  # noqa: E402

PAGE, D = 16, 128


@triton.jit
def load_rows(k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, stride_kb, stride_ks, stride_bt, H: tl.constexpr,
              D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    """One KV head a program, [BLOCK_N, D] row gathers (the package's addressing)."""
    h = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    n_len = tl.load(lens_ptr + seq)
    per = tl.cdiv(tl.cdiv(n_len, SPLITS), BLOCK_N) * BLOCK_N
    start = split * per
    end = tl.minimum(start + per, n_len)
    rn = tl.arange(0, BLOCK_N)
    rd = tl.arange(0, D)
    acc = tl.zeros([BLOCK_N, D], tl.float16)
    for n in range(start, end, BLOCK_N):
        t = n + rn
        valid = t < end
        blk = tl.load(bt_ptr + seq.to(tl.int64) * stride_bt + t // PAGE, mask=valid, other=0).to(tl.int64)
        off = blk[:, None] * stride_kb + (t % PAGE)[:, None] * stride_ks + h * D + rd[None, :]
        k = tl.load(k_ptr + off, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + off, mask=valid[:, None], other=0.0)
        acc = tl.maximum(acc, k.to(tl.float16) + v.to(tl.float16))
    tl.store(out_ptr + ((seq * H + h) * SPLITS + split) * D + rd, tl.max(acc, axis=0))


@triton.jit
def load_pages(k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, stride_kb, stride_bt, H: tl.constexpr, D: tl.constexpr,
               PAGE: tl.constexpr, PAGES: tl.constexpr, SPLITS: tl.constexpr):
    """Every KV head a program: PAGES whole pages ([PAGES * PAGE, H * D], 16 KB contiguous each) an iteration."""
    seq = tl.program_id(0)
    split = tl.program_id(1)
    n_len = tl.load(lens_ptr + seq)
    BLOCK_N: tl.constexpr = PAGES * PAGE
    per = tl.cdiv(tl.cdiv(n_len, SPLITS), BLOCK_N) * BLOCK_N
    start = split * per
    end = tl.minimum(start + per, n_len)
    rn = tl.arange(0, BLOCK_N)
    rhd = tl.arange(0, H * D)
    acc = tl.zeros([BLOCK_N, H * D], tl.float16)
    for n in range(start, end, BLOCK_N):
        t = n + rn
        valid = t < end
        blk = tl.load(bt_ptr + seq.to(tl.int64) * stride_bt + t // PAGE, mask=valid, other=0).to(tl.int64)
        off = blk[:, None] * stride_kb + (t % PAGE)[:, None] * (H * D) + rhd[None, :]
        k = tl.load(k_ptr + off, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + off, mask=valid[:, None], other=0.0)
        acc = tl.maximum(acc, k.to(tl.float16) + v.to(tl.float16))
    tl.store(out_ptr + (seq * SPLITS + split) * H * D + rhd, tl.max(acc, axis=0))


@triton.jit
def attn_pages(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, ks_ptr, vs_ptr, qs_ptr, out_ptr, part_ptr, lse_ptr, sm_scale,
               stride_qt, stride_kb, stride_bt, q_heads, H: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
               D: tl.constexpr, PAGE: tl.constexpr, PAGES: tl.constexpr, SPLITS: tl.constexpr):
    """Every KV head a program: K / V tiles of whole pages [BLOCK_N, H * D] viewed [H, BLOCK_N, D]; each head's
    query group padded to G_PAD rows; batched per-head FP16 dots, float32 online softmax; FP8 query with q_scale."""
    seq = tl.program_id(0)
    split = tl.program_id(1)
    n_len = tl.load(lens_ptr + seq)
    BLOCK_N: tl.constexpr = PAGES * PAGE
    per = tl.cdiv(tl.cdiv(n_len, SPLITS), BLOCK_N) * BLOCK_N
    start = split * per
    end = tl.minimum(start + per, n_len)
    rh = tl.arange(0, H)
    rg = tl.arange(0, G_PAD)
    rd = tl.arange(0, D)
    rn = tl.arange(0, BLOCK_N)
    rhd = tl.arange(0, H * D)
    heads = rh[:, None] * GROUP + rg[None, :]  # [H, G_PAD]
    gmask = rg[None, :] < GROUP
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + heads[:, :, None] * D + rd[None, None, :],
                mask=gmask[:, :, None], other=0.0).to(tl.float16)  # [H, G_PAD, D]
    scale = sm_scale * tl.load(qs_ptr) * tl.load(ks_ptr) * 1.4426950408889634
    m = tl.full([H, G_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([H, G_PAD], tl.float32)
    acc = tl.zeros([H, G_PAD, D], tl.float32)
    for n in range(start, end, BLOCK_N):
        t = n + rn
        valid = t < end
        blk = tl.load(bt_ptr + seq.to(tl.int64) * stride_bt + t // PAGE, mask=valid, other=0).to(tl.int64)
        off = blk[:, None] * stride_kb + (t % PAGE)[:, None] * (H * D) + rhd[None, :]
        k = tl.load(k_ptr + off, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + off, mask=valid[:, None], other=0.0)
        k3 = tl.permute(tl.reshape(k, [BLOCK_N, H, D]), (1, 2, 0)).to(tl.float16)  # [H, D, BLOCK_N]
        v3 = tl.permute(tl.reshape(v, [BLOCK_N, H, D]), (1, 0, 2)).to(tl.float16)  # [H, BLOCK_N, D]
        s = tl.dot(q, k3)  # [H, G_PAD, BLOCK_N]
        s = tl.where(valid[None, None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=2))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, :, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=2)
        acc = acc * alpha[:, :, None] + tl.dot(p.to(tl.float16), v3)
        m = m_new
    if SPLITS == 1:
        o = acc / l_sum[:, :, None] * tl.load(vs_ptr)
        tl.store(out_ptr + seq.to(tl.int64) * stride_qt + heads[:, :, None] * D + rd[None, None, :],
                 o.to(out_ptr.dtype.element_ty), mask=gmask[:, :, None])
    else:
        row = (seq.to(tl.int64) * q_heads + heads) * SPLITS + split  # [H, G_PAD]
        safe = tl.where(l_sum > 0, l_sum, 1.0)
        tl.store(part_ptr + row[:, :, None] * D + rd[None, None, :], acc / safe[:, :, None], mask=gmask[:, :, None])
        tl.store(lse_ptr + row, tl.where(l_sum > 0, m + tl.log2(safe), float("-inf")), mask=gmask)


def attn_pages_call(q8, kc, vc, out, bt, lens, qsl, sm_scale, ks, vs, qs, pages=1, splits=1, num_warps=8,
                    num_stages=3):
    _, merge = fp8_decode_attn._kernels()
    nseq, q_heads = lens.shape[0], q8.shape[1]
    H = kc.shape[2]
    group = q_heads // H
    part = lse = out
    if splits > 1:
        part = torch.empty((nseq * q_heads * splits, D), dtype=torch.float32, device=q8.device)
        lse = torch.empty((nseq * q_heads * splits,), dtype=torch.float32, device=q8.device)
    attn_pages[(nseq, splits)](q8, kc, vc, bt, lens, ks, vs, qs, out, part, lse, sm_scale, q8.stride(0),
                               kc.stride(0), bt.stride(0), q_heads, H=H, GROUP=group, G_PAD=16, D=D, PAGE=PAGE,
                               PAGES=pages, SPLITS=splits, num_warps=num_warps, num_stages=num_stages)
    if splits > 1:
        merge[(nseq, q_heads)](part, lse, lens, qsl, vs, out, out.stride(0), out.stride(1), q_heads, D=D,
                               SPLITS=splits, num_warps=4)
    return out


def make(q_heads, kv_heads, batch, ctx, gen, device):
    lens = torch.randint(ctx // 2, 3 * ctx // 2 + 1, (batch,), generator=gen, device=device, dtype=torch.int32)
    pages = [(int(n) + PAGE - 1) // PAGE for n in lens]
    total = sum(pages)
    perm = torch.randperm(total + 1, generator=gen, device=device).to(torch.int32)[:total]
    bt = torch.zeros(batch, max(pages), dtype=torch.int32, device=device)
    off = 0
    for i, p in enumerate(pages):
        bt[i, :p] = perm[off:off + p]
        off += p
    kv = (torch.randn(2, total + 1, PAGE, kv_heads, D, generator=gen, device=device) * 2).to(torch.float8_e4m3fn)
    q16 = torch.randn(batch, q_heads, D, generator=gen, device=device) * 2
    qs = torch.tensor([0.05], device=device)
    return dict(lens=lens, bt=bt, k=kv[0], v=kv[1], q8=(q16 / qs).to(torch.float8_e4m3fn), qs=qs,
                ks=torch.tensor([0.03], device=device), vs=torch.tensor([0.02], device=device),
                qsl=torch.arange(batch + 1, dtype=torch.int32, device=device),
                kv_bytes=int(lens.sum()) * kv_heads * 2 * D)


def check(device="cpu"):
    """Interpreter / GPU check of attn_pages against the float32 reference."""
    gen = torch.Generator(device=device).manual_seed(0)
    for qh, kvh, batch, ctx, splits, pages in ((32, 8, 3, 70, 1, 1), (28, 4, 2, 90, 2, 2), (40, 8, 2, 40, 4, 1)):
        b = make(qh, kvh, batch, ctx, gen, device)
        out = torch.zeros(batch, qh, D, dtype=torch.bfloat16, device=device)
        attn_pages_call(b["q8"], b["k"], b["v"], out, b["bt"], b["lens"], b["qsl"], D ** -0.5, b["ks"], b["vs"],
                        b["qs"], pages=pages, splits=splits)
        ref = fp8_decode_attn.reference(b["q8"], b["k"], b["v"], b["bt"], b["lens"], b["qsl"], D ** -0.5, b["ks"],
                                        b["vs"], q_scale=b["qs"])
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        print("check", qh, kvh, batch, ctx, splits, pages, f"rel err {err:.4f}", flush=True)
        assert err < 0.01, err


def main(path):
    check("cuda")
    bench = lambda fn: triton.testing.do_bench_cudagraph(fn, rep=50) * 1000.0  # noqa: E731
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    shapes = {"qwen3-8b": (32, 8), "14b": (40, 8), "7b": (28, 4)}
    for shape, (qh, kvh) in shapes.items():
        for batch in (256, 128, 64, 16):
            for ctx in ((3000, 8000) if batch in (256, 64) and shape != "7b" else (3000,)):
                b = make(qh, kvh, batch, ctx, gen, "cuda")
                out = torch.empty(batch, qh, D, dtype=torch.bfloat16, device="cuda")
                sink = torch.empty(batch * kvh * 16 * D * 16, dtype=torch.float16, device="cuda")
                ref = fp8_decode_attn.reference(b["q8"][:8], b["k"], b["v"], b["bt"][:8], b["lens"][:8],
                                                b["qsl"][:9], D ** -0.5, b["ks"], b["vs"], q_scale=b["qs"])
                cands = {}
                for sp in (1, 2, 4):
                    cands[f"package/s{sp}"] = lambda sp=sp: fp8_decode_attn.fp8_decode_attention(
                        b["q8"], b["k"], b["v"], out, b["bt"], b["lens"], b["qsl"], D ** -0.5, b["ks"], b["vs"],
                        q_scale=b["qs"], splits=sp)
                cands["package/default"] = lambda: fp8_decode_attn.fp8_decode_attention(
                    b["q8"], b["k"], b["v"], out, b["bt"], b["lens"], b["qsl"], D ** -0.5, b["ks"], b["vs"],
                    q_scale=b["qs"])
                for bn, sp in ((64, 2), (128, 2), (128, 1)):
                    cands[f"load_rows/{bn}/s{sp}"] = lambda bn=bn, sp=sp: load_rows[(kvh, batch, sp)](
                        b["k"], b["v"], b["bt"], b["lens"], sink, b["k"].stride(0), b["k"].stride(1),
                        b["bt"].stride(0), H=kvh, D=D, PAGE=PAGE, BLOCK_N=bn, SPLITS=sp, num_warps=4, num_stages=2)
                for pg, sp, nw, ns in ((1, 4, 8, 3), (1, 8, 8, 3), (2, 4, 8, 3), (1, 4, 4, 4), (1, 8, 8, 4),
                                       (2, 8, 8, 2)):
                    if pg * kvh > 16 and nw == 4:
                        continue
                    cands[f"load_pages/{pg}/s{sp}/w{nw}/st{ns}"] = lambda pg=pg, sp=sp, nw=nw, ns=ns: load_pages[
                        (batch, sp)](b["k"], b["v"], b["bt"], b["lens"], sink, b["k"].stride(0), b["bt"].stride(0),
                                     H=kvh, D=D, PAGE=PAGE, PAGES=pg, SPLITS=sp, num_warps=nw, num_stages=ns)
                for pg, sp, nw, ns in ((1, 4, 8, 3), (1, 8, 8, 3), (1, 16, 8, 3), (1, 8, 8, 4), (1, 8, 4, 3),
                                       (2, 8, 8, 3), (1, 8, 8, 2)):
                    cands[f"attn_pages/{pg}/s{sp}/w{nw}/st{ns}"] = lambda pg=pg, sp=sp, nw=nw, ns=ns: attn_pages_call(
                        b["q8"], b["k"], b["v"], out, b["bt"], b["lens"], b["qsl"], D ** -0.5, b["ks"], b["vs"],
                        b["qs"], pages=pg, splits=sp, num_warps=nw, num_stages=ns)
                for name, fn in cands.items():
                    row = {"shape": shape, "batch": batch, "ctx": ctx, "variant": name}
                    try:
                        fn()
                        torch.cuda.synchronize()
                        us = bench(fn)
                        row.update(us=round(us, 2), tb_s=round(b["kv_bytes"] / us / 1e6, 3))
                        if not name.startswith("load"):
                            row["err"] = ((out[:8].float() - ref).abs().max() / ref.abs().max()).item()
                    except Exception as e:  # noqa: BLE001
                        row["error"] = f"{type(e).__name__}: {e}"[:300]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                del b
                torch.cuda.empty_cache()
                with open(path + ".tmp", "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "triton": triton.__version__, "rows": rows}, f, indent=1)
                os.replace(path + ".tmp", path)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "check":
        check()
    else:
        main(sys.argv[1])
