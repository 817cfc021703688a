"""Decode-shaped W8A8 INT8 GEMM: vLLM's CUTLASS kernel vs flashrl's few-rows Triton kernel vs BF16 (issue 45).

For each model shape (benchmarks/shapes.py) and linear layer (qkv with Qwen2.5's bias, o, gate_up, down) and
each row count (the sequences of a decode step), times under a CUDA graph: the BF16 GEMM (`F.linear`, what a
BF16 engine runs), vLLM's `cutlass_scaled_mm` on INT8 operands, `flashrl_tools.quant.kernels.w8a8_gemm` on the
same operands, and vLLM's per-token activation quantization (`scaled_int8_quant`, the INT8 path's other cost);
checks the Triton output bit for bit against CUTLASS's. Prints a table (per shape: the sums over one layer,
the weight-read bandwidth) and writes JSON. `--sweep 4,16` times every tile
configuration at those row counts and reports the best.

    python benchmarks/small_m_gemm.py --shapes 7b,14b --rows 1,4,8,16,32,64 --sweep 4,16 --json small_m_gemm.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import QWEN3, QWEN25  # noqa: E402

from flashrl_tools.quant.kernels import w8a8_gemm  # noqa: E402

SWEEP = {"BLOCK_N": [16, 32, 64], "BLOCK_K": [128, 256, 512], "num_warps": [4], "num_stages": [3, 4, 5]}


def layers(shape: str) -> list[tuple[str, int, int, bool]]:
    """(name, out N, in K, bias) of one decoder layer's linears."""
    cfg = {**QWEN25, **QWEN3}[shape]
    h, i, heads, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", h // heads)
    bias = shape in QWEN25
    return [("qkv", (heads + 2 * kv) * hd, h, bias), ("o", h, heads * hd, False), ("gate_up", 2 * i, h, False),
            ("down", h, i, False)]


def bench(fn) -> float:
    """Microseconds per call, replayed from a CUDA graph (as vLLM's decode steps run)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1000.0


def measure(ops, w, w_s, b, bias, m: int, sweep: bool) -> dict:
    """One linear at m rows: the four timings, the Triton tiles used, and the bit-for-bit check."""
    x = torch.randn(m, w.shape[1], device="cuda").to(torch.bfloat16)
    x_q, x_s, _ = ops.scaled_int8_quant(x)
    ref = ops.cutlass_scaled_mm(x_q, b, scale_a=x_s, scale_b=w_s, out_dtype=torch.bfloat16, bias=bias)

    def triton_mm(cfg):
        return w8a8_gemm.w8a8_mm(x_q, b, x_s, w_s, torch.bfloat16, bias, cfg)

    default = w8a8_gemm.default_config(m, *w.shape)
    best, t_best = default, bench(lambda: triton_mm(default))
    t_default = t_best
    for vals in itertools.product(*SWEEP.values()) if sweep else ():
        cfg = {**default, **dict(zip(SWEEP, vals))}
        try:
            t = bench(lambda c=cfg: triton_mm(c))
        except Exception:  # a tile the shared memory cannot hold
            continue
        if t < t_best:
            best, t_best = cfg, t
    return {"bf16_us": bench(lambda: F.linear(x, w, bias)),
            "cutlass_us": bench(lambda: ops.cutlass_scaled_mm(x_q, b, scale_a=x_s, scale_b=w_s,
                                                              out_dtype=torch.bfloat16, bias=bias)),
            "triton_us": t_best, "triton_default_us": t_default, "quant_us": bench(lambda: ops.scaled_int8_quant(x)),
            "bit_identical": torch.equal(triton_mm(best), ref) and torch.equal(triton_mm(default), ref),
            "config": best}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="7b,14b")
    ap.add_argument("--rows", default="1,4,8,16,32,64")
    ap.add_argument("--sweep", default="", help="row counts (e.g. 4,16) at which every tile configuration is timed")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: small_m_gemm.py needs a CUDA GPU (it times vLLM's CUTLASS kernel against a Triton one)")
    from vllm import _custom_ops as ops

    rows_list = [int(r) for r in args.rows.split(",")]
    bad = [r for r in rows_list if not 0 < r <= w8a8_gemm.MAX_ROWS]
    if bad:
        sys.exit(f"error: --rows {bad}: the Triton kernel takes 1..{w8a8_gemm.MAX_ROWS} rows")
    torch.manual_seed(0)
    rows = []
    for shape in args.shapes.split(","):
        for name, n, k, has_bias in layers(shape):
            w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
            w_s = (w.float().abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-8)
            b = (w.float() / w_s).round().clamp(-128, 127).to(torch.int8).t()  # vLLM's layout: [K, N], stride (1, K)
            bias = (torch.randn(n, device="cuda") * 0.1).to(torch.bfloat16) if has_bias else None
            for m in rows_list:
                row = measure(ops, w, w_s, b, bias, m, str(m) in args.sweep.split(","))
                rows.append({"shape": shape, "layer": name, "n": n, "k": k, "bias": has_bias, "rows": m, **row})
                print(f"{shape} {name} M={m}: bf16 {row['bf16_us']:.1f} us, cutlass {row['cutlass_us']:.1f}, triton "
                      f"{row['triton_us']:.1f} (default {row['triton_default_us']:.1f}), quant {row['quant_us']:.1f}, "
                      f"equal {row['bit_identical']}", flush=True)
            del w, w_s, b, bias
            torch.cuda.empty_cache()
    dev = torch.cuda.get_device_name()
    print(f"\nOne decoder layer's linears, us per decode step, CUDA graphs ({dev}); INT8 = vLLM's per-token quant + GEMM")
    print("| shape | rows | BF16 | CUTLASS | Triton | quant | INT8 CUTLASS / BF16 | INT8 Triton / BF16 | bit-identical |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    summary = []
    for shape in args.shapes.split(","):
        for m in rows_list:
            sel = [r for r in rows if r["shape"] == shape and r["rows"] == m]
            tot = {key: sum(r[key] for r in sel) for key in ("bf16_us", "cutlass_us", "triton_us", "quant_us")}
            w_bytes = sum(r["n"] * r["k"] for r in sel)
            s = {"shape": shape, "rows": m, **{k2: round(v, 2) for k2, v in tot.items()},
                 "int8_cutlass_vs_bf16": round((tot["cutlass_us"] + tot["quant_us"]) / tot["bf16_us"], 3),
                 "int8_triton_vs_bf16": round((tot["triton_us"] + tot["quant_us"]) / tot["bf16_us"], 3),
                 "bf16_tb_s": round(2 * w_bytes / tot["bf16_us"] / 1e6, 2),
                 "cutlass_tb_s": round(w_bytes / tot["cutlass_us"] / 1e6, 2),
                 "triton_tb_s": round(w_bytes / tot["triton_us"] / 1e6, 2),
                 "bit_identical": all(r["bit_identical"] for r in sel)}
            summary.append(s)
            print(f"| {shape} | {m} | {s['bf16_us']:.1f} ({s['bf16_tb_s']} TB/s) | {s['cutlass_us']:.1f} "
                  f"({s['cutlass_tb_s']} TB/s) | {s['triton_us']:.1f} ({s['triton_tb_s']} TB/s) | {s['quant_us']:.1f} | "
                  f"{s['int8_cutlass_vs_bf16']:.2f}x | {s['int8_triton_vs_bf16']:.2f}x | {s['bit_identical']} |")
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"device": dev, "torch": torch.__version__, "sweep_rows": args.sweep, "summary": summary,
                       "rows": rows}, f, indent=1)
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
