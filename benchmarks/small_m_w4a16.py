"""Decode-shaped W4A16 GEMM: vLLM's Machete against BF16 and INT8 by row count (issue 75's tail).

For each model shape (benchmarks/shapes.py) and linear layer (qkv, o, gate_up, down) and each row count (the tail's
few rows up to 65+), times under a CUDA graph: the BF16 GEMM (`F.linear`), vLLM's W4A16 GEMM on Hopper (`machete_mm`
on `machete_prepack_B`'s layout, what `FLASHRL_CONFIG=w4a16` runs) and flashrl's INT8 path (vLLM's per-token
quantization + `w8a8_gemm` up to FLASHRL_DECODE_GEMM's 16 rows, CUTLASS above: the 8-bit tail's kernels). The weights
are quantized by the package's quantizer (`flashrl_tools.quant.quantizer`, W4A16 / INT8); Machete is checked against
the float32 product of the same dequantized weights (max |error| / max |reference|). Prints a table per shape (sums
over one layer, the weight bytes each path reads per us) and writes JSON (after every layer: a run cut short keeps it).

    python benchmarks/small_m_w4a16.py --shapes 7b,14b --rows 1,4,8,16,32,64,128,256 --json small_m_w4a16.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from small_m_gemm import bench, layers  # noqa: E402

from flashrl_tools.quant import quantizer  # noqa: E402
from flashrl_tools.quant.formats import QuantFn  # noqa: E402
from flashrl_tools.quant.kernels import w8a8_gemm  # noqa: E402
from flashrl_tools.quant.packing import pack_int4, unpack_int4  # noqa: E402

GROUP = 128  # compressed-tensors' W4A16 group (quantizer.INT4_GROUP)
INT8_TRITON_ROWS = 16  # FLASHRL_DECODE_GEMM's default on Hopper


def machete(ops, packed: torch.Tensor, scale: torch.Tensor):
    """vLLM's Machete operands as its MacheteLinearKernel makes them: [K / 8, N] packed codes, column-major, then
    prepacked; [K / 128, N] scales. Returns the GEMM as a function of the activations."""
    from vllm.scalar_type import scalar_types

    b_q = ops.machete_prepack_B(packed.t(), a_type=torch.bfloat16, b_type=scalar_types.uint4b8,  # [K / 8, N], stride (1, K / 8)
                                group_scales_type=torch.bfloat16)
    s = scale.t().contiguous()
    return lambda x: ops.machete_mm(a=x, b_q=b_q, b_type=scalar_types.uint4b8, b_group_scales=s,
                                    b_group_size=GROUP)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 product Machete approximates: x @ ((code - 8) * scale, rounded to 16 bits).T."""
    k = x.shape[1]
    codes = unpack_int4(packed, k).to(x.dtype).reshape(packed.shape[0], k // GROUP, GROUP)
    return x.float() @ (codes * scale[:, :, None]).reshape(packed.shape[0], k).float().T


def measure(ops, w, bias, m: int) -> dict:
    """One linear at m rows: the timings and Machete's error."""
    q4 = quantizer.quantize_weight(QuantFn.w4a16, w)
    packed, scale = pack_int4(q4.weight), q4.weight_scale.contiguous()
    q8 = quantizer.quantize_weight(QuantFn.int8, w)
    b8, s8 = q8.weight.t(), q8.weight_scale.float().reshape(-1, 1)  # vLLM's [K, N] view, per-channel scales
    x = torch.randn(m, w.shape[1], device="cuda").to(torch.bfloat16)
    mach = machete(ops, packed, scale)

    def int8_path():  # what the INT8 engine runs: flashrl's GEMM up to FLASHRL_DECODE_GEMM's 16 rows, then CUTLASS
        x_q, x_s, _ = ops.scaled_int8_quant(x)
        if m <= INT8_TRITON_ROWS:
            return w8a8_gemm.w8a8_mm(x_q, b8, x_s, s8, torch.bfloat16, None)
        return ops.cutlass_scaled_mm(x_q, b8, scale_a=x_s, scale_b=s8, out_dtype=torch.bfloat16)

    return {"bf16_us": bench(lambda: F.linear(x, w, bias)), "machete_us": bench(lambda: mach(x)),
            "int8_us": bench(int8_path), "machete_err": rel_err(mach(x), reference(x, packed, scale))}


def summarize(rows: list[dict], shape: str, m: int) -> dict:
    sel = [r for r in rows if r["shape"] == shape and r["rows"] == m]
    tot = {key: sum(r[key] for r in sel) for key in ("bf16_us", "machete_us", "int8_us")}
    params = sum(r["n"] * r["k"] for r in sel)
    return {"shape": shape, "rows": m, **{k: round(v, 2) for k, v in tot.items()},
            "machete_vs_bf16": round(tot["machete_us"] / tot["bf16_us"], 3),
            "int8_vs_bf16": round(tot["int8_us"] / tot["bf16_us"], 3),
            "bf16_tb_s": round(2 * params / tot["bf16_us"] / 1e6, 2),
            "machete_tb_s": round(params / 2 / tot["machete_us"] / 1e6, 2),
            "int8_tb_s": round(params / tot["int8_us"] / 1e6, 2),
            "machete_err": max(r["machete_err"] for r in sel)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="7b,14b")
    ap.add_argument("--rows", default="1,4,8,16,32,64,128,256")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("error: small_m_w4a16.py needs a Hopper GPU (it times vLLM's Machete kernel, sm_90 only)")
    from vllm import _custom_ops as ops

    rows_list = [int(r) for r in args.rows.split(",")]
    if any(r <= 0 for r in rows_list):
        sys.exit(f"error: --rows {args.rows}: row counts are positive")
    torch.manual_seed(0)
    rows = []
    for shape in args.shapes.split(","):
        for name, n, k, has_bias in layers(shape):
            w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
            bias = (torch.randn(n, device="cuda") * 0.1).to(torch.bfloat16) if has_bias else None
            for m in rows_list:
                row = measure(ops, w, bias, m)
                rows.append({"shape": shape, "layer": name, "n": n, "k": k, "rows": m, **row})
                print(f"{shape} {name} M={m}: bf16 {row['bf16_us']:.1f} us, machete {row['machete_us']:.1f}, "
                      f"int8 {row['int8_us']:.1f}; err machete {row['machete_err']:.2e}", flush=True)
            del w, bias
            torch.cuda.empty_cache()
            save(args, torch.cuda.get_device_name(), rows, None)
    dev = torch.cuda.get_device_name()
    print(f"\nOne decoder layer's linears, us per decode step, CUDA graphs ({dev}); TB/s = weight bytes read / time")
    print("| shape | rows | BF16 | Machete W4A16 | INT8 (quant + GEMM) | Machete / BF16 | INT8 / BF16 | Machete max error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    summary = [summarize(rows, shape, m) for shape in args.shapes.split(",") for m in rows_list]
    for s in summary:
        print(f"| {s['shape']} | {s['rows']} | {s['bf16_us']:.1f} ({s['bf16_tb_s']}) | {s['machete_us']:.1f} "
              f"({s['machete_tb_s']}) | {s['int8_us']:.1f} ({s['int8_tb_s']}) | {s['machete_vs_bf16']:.2f}x | "
              f"{s['int8_vs_bf16']:.2f}x | {s['machete_err']:.1e} |")
    save(args, dev, rows, summary)


def save(args, dev: str, rows: list[dict], summary: list[dict] | None) -> None:
    """The JSON (written after every layer too: a run cut short keeps what it measured)."""
    if not args.json:
        return
    tmp = args.json + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"command": "python benchmarks/small_m_w4a16.py " + " ".join(sys.argv[1:]), "device": dev,
                   "torch": torch.__version__, "summary": summary, "rows": rows}, f, indent=1)
    os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
