"""Decode attention over a paged KV cache: FA3 BF16, FA3 FP8 (what vLLM runs), vLLM's Triton kernel on FP8,
and flashrl's FP8 decode kernel (issue 45; `_cast`: its V tile cast inside the dot's operand read, as before issue 74;
`_fp8qk`: its opt-in transposed scores, FP8 keys straight into Hopper's warpgroup MMA with the FP8 query; `_lpt`: the
default kernel taking the sequences longest first, the argsort timed with it; `_bal`: `balanced=True`, equal runs of
the batch's key tiles over a fixed grid, `fp8_decode_attn_bal`, up to 32 sequences -- above it the default kernel).

RESULTS "The FP8 KV cache and the attention backend": FA3's FP8 decode reads the cache at about half the bandwidth
of its BF16 decode. This script times one decode step's attention for one layer at RL-step batch shapes, each
call replayed from a CUDA graph (as vLLM's decode steps run), in vLLM 0.26's cache layout (NHD: [blocks, page,
kv_heads, K|V]; `--layout hnd`: [blocks, kv_heads, page, K|V]), with random block tables and context lengths
uniform in [ctx/2, 3 ctx/2]. Bandwidth = the KV bytes the step must read / its time. Each kernel's output is
checked against a float32 reference on the same FP8 values (`fp8_decode_attn_ref.reference`, the first 16
sequences). Prints a table and writes JSON; `--sweep B,..` also times flashrl's kernel at every split count and
tile at those batch sizes and the first `--ctx` (`--sweep-grid`: the default kernel's, the FP8-score kernel's, or both;
`tail`: up to 64 splits of at least `min_split` keys each; `merge`: 1-8 query heads a merge program; `balanced`:
the balanced kernel's grid, 1-8 programs an SM; every cell of those kept in the JSON).
`--shared-prompt P`: each group of `--group` sequences (a GRPO group) reads the same
physical pages for its first P tokens' full pages, as a prefix cache gives them (the bandwidth column still counts
every sequence's reads): whether a group's prompt is read from DRAM once per sequence or hits L2.

    python benchmarks/decode_attention.py --shapes qwen3-8b,7b,14b --batches 256,128,64,16,4 --sweep 128,16 --json da.json
    python benchmarks/decode_attention.py --shapes 14b --batches 256,128 --shared-prompt 1024 --json da_shared.json
    python benchmarks/decode_attention.py --flashrl-only --shapes qwen3-8b --batches 12,16 --ctx 4000   # no vLLM
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import QWEN3, QWEN25  # noqa: E402

from flashrl_tools.quant.kernels import fp8_decode_attn, fp8_decode_attn_ref  # noqa: E402

PAGE, D = 16, 128
SWEEP = {"splits": [1, 2, 4, 8, 16], "block_n": [32, 64, 128], "num_warps": [2, 4, 8], "num_stages": [2, 3]}
SWEEP_QK = {"splits": [1, 2, 4, 8, 16], "block_n": [64, 128], "num_warps": [4, 8], "num_stages": [2, 3]}  # warpgroups
# the default tile, many splits, each of at least `min_split` keys (issue 74's tail: <= 16 running, long contexts)
SWEEP_TAIL = {"splits": [8, 16, 32, 64], "min_split": [0, 256, 512, 1024]}
# the default kernel with several query heads a merge program (the same bits: the merge's launch and loads)
SWEEP_MERGE = {"merge_heads": [1, 2, 4, 8]}


def balanced_grid() -> dict:
    """The balanced kernel's grid, 1-8 programs an SM of this GPU (the default: `fp8_decode_attn_bal.PROGRAMS_PER_SM`)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return {"programs": [k * sms for k in (1, 2, 3, 4, 6, 8)]}


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1000.0


def make_batch(q_heads: int, kv_heads: int, batch: int, ctx: int, gen: torch.Generator, layout: str = "nhd",
               shared: int = 0, group: int = 8, device: str = "cuda", equal: bool = False) -> dict:
    """One decode batch over a shuffled paged FP8 cache: lengths uniform in [ctx/2, 3 ctx/2], or (`equal`) all `ctx`
    -- a rollout whose requests started together with one prompt length decodes equal contexts."""
    lens = torch.randint(ctx // 2, 3 * ctx // 2 + 1, (batch,), generator=gen, device=device, dtype=torch.int32)
    if equal:
        lens = torch.full_like(lens, ctx)
    lens = lens.clamp(min=shared + 1)  # a group's sequences all hold its prompt
    pages = [(int(n) + PAGE - 1) // PAGE for n in lens]
    total = sum(pages)
    perm = torch.randperm(total + 1, generator=gen, device=device).to(torch.int32)[:total]
    bt = torch.zeros(batch, max(pages), dtype=torch.int32, device=device)
    off = 0
    for i, p in enumerate(pages):
        bt[i, :p] = perm[off:off + p]
        off += p
    for i in range(batch):  # the prompt's full pages: the group's first sequence's (its others' go unread)
        bt[i, :shared // PAGE] = bt[i - i % group, :shared // PAGE]
    if layout == "hnd":  # vLLM's HND cache layout (VLLM_KV_CACHE_LAYOUT=HND): a KV head's page contiguous
        raw = (torch.randn(total + 1, kv_heads, PAGE, 2 * D, generator=gen, device=device) * 2).to(
            torch.float8_e4m3fn).transpose(1, 2)
    else:
        raw = (torch.randn(total + 1, PAGE, kv_heads, 2 * D, generator=gen, device=device) * 2).to(torch.float8_e4m3fn)
    q16 = (torch.randn(batch, q_heads, D, generator=gen, device=device) * 2).to(torch.bfloat16)
    q_scale = torch.tensor([0.05], device=device)
    return {"lens": lens, "bt": bt, "raw": raw, "q16": q16, "q8": (q16.float() / q_scale).to(torch.float8_e4m3fn),
            "q_scale": q_scale, "k_scale": torch.tensor([0.03], device=device),
            "v_scale": torch.tensor([0.02], device=device),
            "qsl": torch.arange(batch + 1, dtype=torch.int32, device=device), "kv_bytes": int(lens.sum()) * kv_heads * 2 * D}


def candidates(b: dict, q_heads: int, kv_heads: int, flashrl_only: bool = False) -> dict:
    """name -> (callable, output, bytes per cache element); `flashrl_only`: flashrl's kernels alone (no vLLM needed)."""

    batch, raw = b["lens"].shape[0], b["raw"]
    k8, v8 = raw[..., :D], raw[..., D:]
    scale = D ** -0.5
    outs = {n: torch.empty(batch, q_heads, D, dtype=torch.bfloat16, device="cuda") for n in
            ("fa3_bf16", "fa3_fp8", "triton_vllm_fp8", "flashrl_fp8", "flashrl_fp8_cast", "flashrl_fp8qk",
             "flashrl_fp8_lpt", "flashrl_fp8_bal")}
    ours = _flashrl_candidates(b, k8, v8, scale, outs)
    if flashrl_only:
        return ours
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    raw16 = raw.to(torch.bfloat16)  # the BF16 cache holds the same values
    k16, v16 = raw16[..., :D], raw16[..., D:]
    max_len = int(b["lens"].max())
    shape = (batch, kv_heads)
    qs, ks, vs = (b[n].expand(shape) for n in ("q_scale", "k_scale", "v_scale"))

    def meta(dtype):
        return get_scheduler_metadata(batch, 1, max_len, q_heads, kv_heads, D, b["lens"], qkv_dtype=dtype,
                                      cu_seqlens_q=b["qsl"], page_size=PAGE, causal=True, num_splits=32)

    m16, m8 = meta(torch.bfloat16), meta(torch.float8_e4m3fn)
    common = dict(max_seqlen_q=1, cu_seqlens_q=b["qsl"], max_seqlen_k=max_len, seqused_k=b["lens"],
                  softmax_scale=scale, causal=True, block_table=b["bt"], fa_version=3, num_splits=32)
    q16_scaled = (b["q8"].float() * b["q_scale"]).to(torch.bfloat16)  # the FP8 query's values, for the BF16 rows
    k16s, v16s = k16 * b["k_scale"].to(torch.bfloat16), v16 * b["v_scale"].to(torch.bfloat16)

    def fa3_bf16():
        flash_attn_varlen_func(q=q16_scaled, k=k16s, v=v16s, out=outs["fa3_bf16"], scheduler_metadata=m16, **common)

    def fa3_fp8():
        flash_attn_varlen_func(q=b["q8"], k=k8, v=v8, out=outs["fa3_fp8"], scheduler_metadata=m8, q_descale=qs,
                               k_descale=ks, v_descale=vs, **common)

    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    from vllm.v1.kv_cache_interface import KVQuantMode

    def triton_vllm():
        unified_attention(q=b["q8"], k=k8, v=v8, out=outs["triton_vllm_fp8"], cu_seqlens_q=b["qsl"], max_seqlen_q=1,
                          seqused_k=b["lens"], max_seqlen_k=max_len, softmax_scale=scale, causal=True,
                          window_size=(-1, -1), block_table=b["bt"], softcap=0, q_descale=b["q_scale"],
                          k_descale=b["k_scale"], v_descale=b["v_scale"], kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)

    return {"fa3_bf16": (fa3_bf16, outs["fa3_bf16"], 2), "fa3_fp8": (fa3_fp8, outs["fa3_fp8"], 1),
            "triton_vllm_fp8": (triton_vllm, outs["triton_vllm_fp8"], 1), **ours}


def _flashrl_candidates(b: dict, k8, v8, scale: float, outs: dict) -> dict:
    """flashrl's kernels: the default, the plain V cast, fp8qk, longest first, balanced."""

    def flashrl(**cfg):
        fp8_decode_attn.fp8_decode_attention(b["q8"], k8, v8, outs["flashrl_fp8"], b["bt"], b["lens"], b["qsl"],
                                             scale, b["k_scale"], b["v_scale"], q_scale=b["q_scale"], **cfg)

    def flashrl_cast():  # V cast inside the dot's operand read (the kernel before issue 74)
        fp8_decode_attn.fp8_decode_attention(b["q8"], k8, v8, outs["flashrl_fp8_cast"], b["bt"], b["lens"], b["qsl"],
                                             scale, b["k_scale"], b["v_scale"], q_scale=b["q_scale"], v_f16_first=False)

    def flashrl_fp8qk():  # FLASHRL_DECODE_ATTN=fp8qk
        fp8_decode_attn.fp8_decode_attention(b["q8"], k8, v8, outs["flashrl_fp8qk"], b["bt"], b["lens"], b["qsl"],
                                             scale, b["k_scale"], b["v_scale"], q_scale=b["q_scale"], qk_fp8=True)

    def flashrl_lpt():  # the sequences taken longest first (the argsort timed with the kernel)
        fp8_decode_attn.fp8_decode_attention(b["q8"], k8, v8, outs["flashrl_fp8_lpt"], b["bt"], b["lens"], b["qsl"],
                                             scale, b["k_scale"], b["v_scale"], q_scale=b["q_scale"], longest_first=True)

    def flashrl_bal():  # balanced runs of key tiles (the default grid: SMs x 4 programs)
        fp8_decode_attn.fp8_decode_attention(b["q8"], k8, v8, outs["flashrl_fp8_bal"], b["bt"], b["lens"], b["qsl"],
                                             scale, b["k_scale"], b["v_scale"], q_scale=b["q_scale"], balanced=True)

    return {"flashrl_fp8": (flashrl, outs["flashrl_fp8"], 1), "flashrl_fp8_cast": (flashrl_cast, outs["flashrl_fp8_cast"], 1),
            "flashrl_fp8qk": (flashrl_fp8qk, outs["flashrl_fp8qk"], 1),
            "flashrl_fp8_lpt": (flashrl_lpt, outs["flashrl_fp8_lpt"], 1),
            "flashrl_fp8_bal": (flashrl_bal, outs["flashrl_fp8_bal"], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-8b,7b,14b")
    ap.add_argument("--batches", default="256,128,64,16,4")
    ap.add_argument("--ctx", default="3000", help="mean contexts, comma-separated (lengths uniform in [ctx/2, 3 ctx/2]; "
                    "e.g. 2000,4000,8000: the goal table's)")
    ap.add_argument("--sweep", default="", help="batch sizes (e.g. 128,16) at which flashrl's kernel is timed at every "
                    "split count and tile")
    ap.add_argument("--sweep-grid", default="both", choices=("default", "fp8qk", "both", "tail", "merge", "balanced"),
                    help="which kernel's tiles --sweep times: the default kernel's, the FP8-score kernel's, or both; "
                    "tail: the default kernel's splits up to 64 with a least split (`min_split`); merge: its query "
                    "heads a merge program (`merge_heads`); balanced: the balanced kernel's programs (1-8 an SM); "
                    "tail, merge and balanced record every time")
    ap.add_argument("--layout", default="nhd", choices=("nhd", "hnd"), help="vLLM's KV cache layout (default NHD)")
    ap.add_argument("--shared-prompt", type=int, default=0,
                    help="tokens of prompt each group of --group sequences reads from the same pages (prefix cache)")
    ap.add_argument("--group", type=int, default=8, help="sequences per group sharing a prompt (GRPO's samples)")
    ap.add_argument("--equal-lengths", action="store_true",
                    help="every sequence exactly --ctx tokens (a rollout whose requests started together): the launch "
                    "grid's last wave of programs is then as long as the others")
    ap.add_argument("--flashrl-only", action="store_true",
                    help="flashrl's kernels alone: no vLLM needed (a GPU host with torch and Triton)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: decode_attention.py needs a CUDA GPU with vLLM (it times FA3 against Triton kernels)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for shape in args.shapes.split(","):
        cfg = {**QWEN25, **QWEN3}[shape]
        q_heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        for ctx, batch in itertools.product((int(x) for x in args.ctx.split(",")),
                                            [int(x) for x in args.batches.split(",")]):
            b = make_batch(q_heads, kv_heads, batch, ctx, gen, args.layout, args.shared_prompt, args.group,
                           equal=args.equal_lengths)
            cands = candidates(b, q_heads, kv_heads, args.flashrl_only)
            n_ref = min(batch, 16)
            ref = fp8_decode_attn_ref.reference(b["q8"][:n_ref], b["raw"][..., :D], b["raw"][..., D:], b["bt"][:n_ref],
                                            b["lens"][:n_ref], b["qsl"][:n_ref + 1], D ** -0.5, b["k_scale"],
                                            b["v_scale"], q_scale=b["q_scale"])
            row = {"layout": args.layout, "shape": shape, "q_heads": q_heads, "kv_heads": kv_heads, "batch": batch,
                   "ctx": ctx, "shared_prompt": args.shared_prompt, "group": args.group,
                   "equal_lengths": args.equal_lengths,
                   "kv_tokens": int(b["lens"].sum()),
                   "default_splits": fp8_decode_attn.splits_for(  # as the kernel picks: per program's KV heads
                       batch, kv_heads // fp8_decode_attn.heads_per_program(q_heads, kv_heads),
                       torch.cuda.get_device_properties(0).multi_processor_count)}
            for name, (fn, out, elem) in cands.items():
                try:
                    fn()
                    torch.cuda.synchronize()
                    us = bench(fn)
                except Exception as e:  # a kernel this vLLM lacks: the row says so
                    row[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
                    continue
                err = (out[:n_ref].float() - ref).abs().max().item()
                row[name] = {"us": round(us, 2), "tb_s": round(b["kv_bytes"] * elem / us / 1e6, 2),
                             "max_abs_err": err, "ref_max": ref.abs().max().item()}
            if str(batch) in args.sweep.split(",") and str(ctx) == args.ctx.split(",")[0]:  # at the first context:
                # the default kernel's tiles, then the FP8-score kernel's
                fn, fn_out = cands["flashrl_fp8"][0], cands["flashrl_fp8"][1]
                grids = {"default": ("flashrl_best", SWEEP, {}), "fp8qk": ("flashrl_fp8qk_best", SWEEP_QK, {"qk_fp8": True}),
                         "tail": ("flashrl_tail_best", SWEEP_TAIL, {}), "merge": ("flashrl_merge_best", SWEEP_MERGE, {}),
                         "balanced": ("flashrl_balanced_best", balanced_grid(), {"balanced": True})}
                for key, grid, extra in (g for name, g in grids.items() if args.sweep_grid in (name, "both")
                                         and not (name in ("tail", "merge", "balanced") and args.sweep_grid == "both")):
                    best, timed = None, []
                    for vals in itertools.product(*grid.values()):
                        c = dict(zip(grid, vals))
                        try:
                            us = bench(lambda c=c, fn=fn, extra=extra: fn(**c, **extra))
                        except Exception as e:  # a cell that cannot run (shared memory, a refusal): kept, with why
                            timed.append({**c, "error": f"{type(e).__name__}: {e}"[:200]})
                            continue
                        err = (fn_out[:n_ref].float() - ref).abs().max().item()  # the last timed call's output
                        timed.append({**c, "us": round(us, 2), "max_abs_err": err})
                        if best is None or us < best[1]:
                            best = (c, us)
                    if key in ("flashrl_tail_best", "flashrl_merge_best", "flashrl_balanced_best"):  # every cell
                        row[key.removesuffix("_best")] = timed
                    if best:
                        row[key] = {**best[0], "us": round(best[1], 2), "tb_s": round(b["kv_bytes"] / best[1] / 1e6, 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del b, cands
            torch.cuda.empty_cache()
    dev = torch.cuda.get_device_name()
    names = ("fa3_bf16", "fa3_fp8", "triton_vllm_fp8", "flashrl_fp8", "flashrl_fp8_cast", "flashrl_fp8qk", "flashrl_fp8_lpt",
             "flashrl_fp8_bal")
    print(f"\nOne layer's decode attention, us per step (KV read TB/s), CUDA graphs ({dev}); mean contexts {args.ctx}, "
          f"{args.layout.upper()} layout" + (f"; groups of {args.group} share a {args.shared_prompt}-token prompt's pages"
                                             if args.shared_prompt else ""))
    print("| shape | context | batch | KV tokens | " + " | ".join(names) + " | flashrl / FA3 FP8 | flashrl best (cfg) | "
          "fp8qk best (cfg) | tail (splits/min_split), merge (heads) or balanced (programs) best |")
    print("| --- | --- | --- | --- | " + " | ".join("---" for _ in names) + " | --- | --- | --- | --- |")
    for r in rows:
        cells = [f"{r[n]['us']:.1f} ({r[n]['tb_s']})" if "us" in r.get(n, {}) else "error" if n in r else "-"
                 for n in names]
        ratio = (f"{r['flashrl_fp8']['us'] / r['fa3_fp8']['us']:.2f}x"
                 if "us" in r.get("flashrl_fp8", {}) and "us" in r.get("fa3_fp8", {}) else "-")
        bcells = [f"{best['us']:.1f} ({best['tb_s']}; " + "/".join(str(v) for k, v in best.items() if k not in ("us", "tb_s"))
                  + ")" if best else "-" for best in (r.get("flashrl_best"), r.get("flashrl_fp8qk_best"),
                                                      r.get("flashrl_tail_best") or r.get("flashrl_merge_best")
                                                      or r.get("flashrl_balanced_best"))]
        print(f"| {r['shape']} | {r['ctx']} | {r['batch']} | {r['kv_tokens']} | " + " | ".join(cells) + f" | {ratio} | "
              + " | ".join(bcells) + " |")
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"device": dev, "torch": torch.__version__, "rows": rows}, f, indent=1)
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
