"""INT8 quantization of one weight sync's linear weights: torch reference vs the fused Triton kernel.

For each model shape (config-only, benchmarks/shapes.py), quantizes every linear weight of one
layer-set the size of the model (the shapes a full sync converts) on the GPU, both ways, and
checks the outputs are bit-identical. Prints a table and writes JSON.

    python benchmarks/quantize_kernel.py --shapes 7b,14b,32b --json benchmarks/results/weight_sync/quantize_kernel.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import QWEN25  # noqa: E402

from flashrl_tools.quant.kernels import int8_triton  # noqa: E402
from flashrl_tools.quant.quantizer import int8_scale, quantize_int8_with_scale  # noqa: E402


def linear_shapes(cfg: dict) -> list[tuple[int, int]]:
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * (h // cfg["num_attention_heads"])
    per_layer = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]  # q k v o gate up down
    return per_layer * layers


def torch_int8(w):
    s = int8_scale(w)
    return quantize_int8_with_scale(w, s), s


def timed(fn, weights, repeats):
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for w in weights:
            fn(w)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="7b,14b,32b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: needs a CUDA GPU")
    rows = []
    for name in args.shapes.split(","):
        shapes = linear_shapes(QWEN25[name])
        distinct = sorted(set(shapes))
        pool = {s: (torch.randn(s, device="cuda") * 0.02).to(torch.bfloat16) for s in distinct}
        weights = [pool[s] for s in shapes]  # same bytes moved as a full sync, memory of one layer
        same = all(torch.equal(a, b) for s in distinct
                   for a, b in zip(int8_triton.int8_channel(pool[s]), torch_int8(pool[s])))
        t_ref = timed(torch_int8, weights, args.repeats)
        t_tri = timed(int8_triton.int8_channel, weights, args.repeats)
        gib = sum(a * b for a, b in shapes) * 2 / 2**30
        rows.append({"shape": name, "linear_weights": len(shapes), "bf16_gib": round(gib, 2),
                     "torch_s": round(t_ref, 4), "triton_s": round(t_tri, 4),
                     "speedup": round(t_ref / t_tri, 2), "bit_identical": same,
                     "triton_gib_per_s": round(gib / t_tri, 1)})
        del pool, weights
        torch.cuda.empty_cache()
    dev = torch.cuda.get_device_name()
    print(f"INT8 quantization of all linear weights of one sync ({dev}, best of {args.repeats})")
    print("| shape | weights | BF16 GiB | torch | Triton | speedup | bit-identical |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['shape']} | {r['linear_weights']} | {r['bf16_gib']} | {r['torch_s']:.3f} s | "
              f"{r['triton_s']:.3f} s | {r['speedup']}× | {r['bit_identical']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
