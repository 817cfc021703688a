"""MoE sync conversion: quantizing a layer's expert weights one at a time vs stacked per fused tensor.

A transformers-5 trainer pushes each MoE layer's experts as two fused tensors
(`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]); the runtime splits them into 3E checkpoint
weights. This times the runtime converter on one layer of a MoE shape (benchmarks/shapes.py),
`convert` per expert weight vs `convert_group` stacking them (what the sync does on CUDA), checks the outputs are
bit-identical, prints a table and writes JSON. Conversion only: the vLLM loader calls that follow
are timed by weight_sync.py.

    python benchmarks/moe_convert.py --shape 30b-a3b --fns int8,fp8_tensor,fp8_channel,fp8_block \
        --json benchmarks/results/moe/convert_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import QWEN3_MOE  # noqa: E402

from flashrl_tools.quant.quantizer import QuantFn  # noqa: E402
from flashrl_tools.runtime.core.convert import WeightConverter  # noqa: E402
from flashrl_tools.config.schema import ConfigFn  # noqa: E402


def layer_groups(cfg: dict, device: str) -> list[list[tuple[str, torch.Tensor]]]:
    """One layer's experts as the runtime sees them after the name split: per fused tensor, the
    list of per-expert 2D views (gate rows first, as transformers stores gate_up_proj)."""
    e, h, i = cfg["num_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    g = torch.Generator(device=device).manual_seed(0)
    gate_up = (torch.randn(e, 2 * i, h, generator=g, device=device) * 0.02).to(torch.bfloat16)
    down = (torch.randn(e, h, i, generator=g, device=device) * 0.02).to(torch.bfloat16)
    p = "model.layers.0.mlp.experts"
    return [[(f"{p}.{x}.gate_proj.weight", gate_up[x, :i]) for x in range(e)]
            + [(f"{p}.{x}.up_proj.weight", gate_up[x, i:]) for x in range(e)],
            [(f"{p}.{x}.down_proj.weight", down[x]) for x in range(e)]]


def timed(fn, repeats: int, device: str) -> tuple[float, list]:
    best, out = float("inf"), None
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="30b-a3b")
    ap.add_argument("--fns", default="int8,fp8_tensor,fp8_channel,fp8_block")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = QWEN3_MOE[args.shape]
    groups = layer_groups(cfg, args.device)
    names = {n for grp in groups for n, _ in grp}
    layers = cfg["num_hidden_layers"]
    rows = []
    for fn in args.fns.split(","):
        conv = WeightConverter(ConfigFn(fn), names, served=QuantFn(fn))
        conv.batch_devices = frozenset({args.device})  # time stacking even where the runtime skips it
        one, ref = timed(lambda conv=conv: [p for grp in groups for n, t in grp for p in conv.convert(n, t)],
                         args.repeats, args.device)
        grouped, got = timed(lambda conv=conv: [p for grp in groups for p in conv.convert_group(grp)], args.repeats,
                              args.device)
        exact = [n for n, _ in ref] == [n for n, _ in got] and all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)
            for (_, a), (_, b) in zip(ref, got))
        rows.append({"fn": fn, "per_expert_s": one, "grouped_s": grouped, "speedup": one / grouped,
                     "bit_identical": exact, "expert_weights_per_layer": len(names), "layers": layers})
        del ref, got
    print(f"\n{args.shape}: one layer's {len(names)} expert weights ({args.device}, best of {args.repeats}); "
          f"the model has {layers} such layers\n")
    print("| fn | per expert | stacked | speed-up | bit-identical |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['fn']} | {r['per_expert_s']:.3f} s | {r['grouped_s']:.3f} s | {r['speedup']:.1f}x | {r['bit_identical']} |")
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump({"shape": args.shape, "device": args.device, "torch": torch.__version__, "rows": rows}, f, indent=1)
        os.replace(args.json + ".tmp", args.json)
    if not all(r["bit_identical"] for r in rows):
        sys.exit("grouped conversion differs from per-expert conversion")


if __name__ == "__main__":
    main()
