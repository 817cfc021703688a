"""vLLM's Triton fused-MoE GEMM for flashrl's INT8 experts: its tile table tuned on this GPU (issue 74, goal 3).

vLLM 0.26 serves compressed-tensors INT8 experts with dynamic activations as `int8_w8a16` (its
`make_int8_moe_quant_config`: no static input scales) and ships no table for that dtype: every batch size takes
`get_default_config`. For each shape (benchmarks/shapes.py's MoE shapes) this builds the quant config the engine
builds (vLLM's own function: a version that serves W8A8 tunes W8A8), times vLLM's `fused_experts` under CUDA
graphs at each batch size (tokens of a step) for vLLM's own choice and for each tile configuration of a search
space (the M tile bounded by the tokens an expert gets), checks each output against vLLM's choice's, and writes
vLLM's table format under vLLM's file name into --out (default: the tables the runtime reads,
flashrl_tools/runtime/vllm/moe_configs/). BF16 experts (vLLM's tuned table) and the same INT8 experts as W8A8 are
timed beside. Prints a table, writes JSON. --budget-s stops the search (the best so far is kept; every batch size
gets at least vLLM's choice).

    python benchmarks/moe_tune.py --shapes 30b-a3b --json moe_tune.json
    python benchmarks/moe_tune.py --shapes /models/Qwen3-30B-A3B --tp 2     # a model's own experts, per rank
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import QWEN3_MOE  # noqa: E402

from flashrl_tools.runtime.vllm import moe_tables  # noqa: E402

TOKENS = "1,2,4,8,16,24,32,48,64,96,128,192,256,512,1024,2048,4096"
SPACE = {"BLOCK_SIZE_N": [32, 64, 128, 256], "BLOCK_SIZE_K": [64, 128, 256], "GROUP_SIZE_M": [1, 16],
         "warps_stages": [(4, 3), (4, 4), (4, 5), (8, 3), (8, 4)]}
REL_TOL = 2e-2  # a tile's output vs vLLM's choice's: the same products in another summation order (bf16 output)


def block_ms(tokens: int, topk: int, experts: int) -> list[int]:
    """M tiles worth trying: up to twice the rows an expert gets on average (at least 16)."""
    rows = max(1, tokens * topk // experts)
    return [m for m in (16, 32, 64, 128) if m == 16 or m <= 2 * rows]


def candidates(tokens: int, topk: int, experts: int) -> list[dict[str, int]]:
    """The search space at one batch size (GROUP_SIZE_M > 1 only where an expert gets several M tiles)."""
    out = []
    for bm, bn, bk, gm, (warps, stages) in itertools.product(block_ms(tokens, topk, experts), *SPACE.values()):
        if gm > 1 and tokens * topk // experts < 2 * bm:
            continue
        out.append({"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "GROUP_SIZE_M": gm,
                    "num_warps": warps, "num_stages": stages})
    return out


def distance(config: dict[str, int], near: dict[str, int]) -> float:
    """How far a tile is from another (log2 steps summed): the search starts next to vLLM's choice."""
    import math

    return sum(abs(math.log2(config[k]) - math.log2(near.get(k, config[k]))) for k in moe_tables.CONFIG_KEYS)


def shape_dims(shape: str, tp: int = 1) -> tuple[int, int, int, int]:
    """(experts, one rank's intermediate N, hidden K, top-k) of a benchmarks/shapes.py MoE shape, or of a model's
    config.json (a path to it or to its directory: Qwen-MoE's `num_experts` / `moe_intermediate_size`, Mixtral's
    `num_local_experts` / `intermediate_size`, DeepSeek's `n_routed_experts`); raises ValueError naming what is
    missing."""
    if shape in QWEN3_MOE:
        cfg = QWEN3_MOE[shape]
    else:
        path = Path(shape) / "config.json" if Path(shape).is_dir() else Path(shape)
        if not path.is_file():
            raise ValueError(f"{shape}: neither a MoE shape of benchmarks/shapes.py ({', '.join(QWEN3_MOE)}) nor a "
                             "model's config.json")
        cfg = json.loads(path.read_text())
        cfg = cfg.get("text_config", cfg)
    pick = {"experts": ("num_experts", "num_local_experts", "n_routed_experts"),
            "n": ("moe_intermediate_size", "intermediate_size"), "k": ("hidden_size",), "topk": ("num_experts_per_tok",)}
    dims = {}
    for dim, keys in pick.items():
        found = [cfg[key] for key in keys if isinstance(cfg.get(key), int)]
        if not found:
            raise ValueError(f"{shape}: no {' / '.join(keys)} (not a MoE model?)")
        dims[dim] = found[0]
    if tp < 1 or dims["n"] % tp:
        raise ValueError(f"--tp {tp}: the experts' intermediate size {dims['n']} does not split into {tp} ranks")
    return dims["experts"], dims["n"] // tp, dims["k"], dims["topk"]


def write_table(table: dict[int, dict], path: Path) -> None:
    """vLLM's format (string keys, the Triton version), checked, written to a temporary file and renamed."""
    import triton

    body = {"triton_version": triton.__version__, **{str(m): table[m] for m in sorted(table)}}
    moe_tables.check_table(body)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(body, indent=4) + "\n")
    os.replace(tmp, path)


class Problem:
    """One shape's experts (random INT8 weights, per-channel scales as vLLM's layer holds them) and BF16 twins."""

    def __init__(self, shape: str, tp: int = 1):
        from vllm.model_executor.layers.fused_moe.oracle.int8 import Int8MoeBackend, make_int8_moe_quant_config

        self.E, self.N, self.K, self.topk = shape_dims(shape, tp)
        E, N, K = self.E, self.N, self.K
        g = torch.Generator(device="cuda").manual_seed(0)
        self.w1 = torch.randint(-127, 128, (E, 2 * N, K), device="cuda", dtype=torch.int8, generator=g)
        self.w2 = torch.randint(-127, 128, (E, K, N), device="cuda", dtype=torch.int8, generator=g)
        s1 = torch.rand(E, 2 * N, 1, device="cuda", generator=g) * 2e-4 + 1e-4
        s2 = torch.rand(E, K, 1, device="cuda", generator=g) * 2e-4 + 1e-4
        self.quant = make_int8_moe_quant_config(int8_backend=Int8MoeBackend.TRITON, w1_scale=s1, w2_scale=s2,
                                                a1_scale=None, a2_scale=None, per_act_token_quant=True)
        self.dtype = self.quant.config_name(torch.bfloat16)
        self.s1, self.s2 = s1, s2
        self.b1 = (self.w1.float() * s1).to(torch.bfloat16)
        self.b2 = (self.w2.float() * s2).to(torch.bfloat16)

    def inputs(self, tokens: int):
        g = torch.Generator(device="cuda").manual_seed(tokens)
        x = torch.randn(tokens, self.K, device="cuda", generator=g).to(torch.bfloat16)
        logits = torch.randn(tokens, self.E, device="cuda", generator=g)
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), self.topk, dim=-1)
        return x, (weights / weights.sum(dim=-1, keepdim=True)).float(), ids.to(torch.int32)


@contextlib.contextmanager
def tile(config: dict[str, int]):
    """vLLM's override_config, restored when the body raises too (vLLM's restores only when it returns: a tile
    the shared memory cannot hold would otherwise stay in force for every later call)."""
    import vllm.model_executor.layers.fused_moe as fm

    old = fm.get_config()
    try:
        with fm.override_config(dict(config)):  # (vLLM adds SPLIT_K to the dict it is given)
            yield
    finally:
        fm._config = old


def bench(fn) -> float:
    """Microseconds per call, replayed from a CUDA graph (as vLLM's decode steps run)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=20) * 1000.0


def tune_tokens(p: Problem, tokens: int, deadline: float) -> dict:
    from vllm.model_executor.layers.fused_moe import fused_experts
    from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config

    x, w, ids = p.inputs(tokens)

    def run(config=None, bf16=False):
        if bf16:
            return fused_experts(x, p.b1, p.b2, w, ids)
        if config is None:
            return fused_experts(x, p.w1, p.w2, w, ids, quant_config=p.quant)
        with tile(config):
            return fused_experts(x, p.w1, p.w2, w, ids, quant_config=p.quant)

    vllm_cfg = {k: v for k, v in try_get_optimal_moe_config(p.w1.shape, p.w2.shape, p.topk, p.dtype, tokens).items()
                if k in moe_tables.CONFIG_KEYS}
    ref = run().float()
    scale = ref.abs().max().item() or 1.0
    t_vllm = bench(lambda: run())
    best, t_best, tried, rejected = None, t_vllm, 0, 0
    for cfg in sorted(candidates(tokens, p.topk, p.E), key=lambda c: distance(c, vllm_cfg)):
        if time.monotonic() > deadline:
            break
        try:
            err = (run(cfg).float() - ref).abs().max().item() / scale
            t = bench(lambda c=cfg: run(c))
        except Exception:  # a tile the shared memory cannot hold
            rejected += 1
            continue
        tried += 1
        if err > REL_TOL:
            rejected += 1
            continue
        if t < t_best:
            best, t_best = cfg, t
    table_cfg = best or {**{"GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 3}, **vllm_cfg}
    return {"tokens": tokens, "vllm_config": vllm_cfg, "vllm_us": round(t_vllm, 2), "tuned_config": table_cfg,
            "tuned_us": round(t_best, 2), "speedup": round(t_vllm / t_best, 3), "tried": tried,
            "rejected": rejected, "bf16_us": round(bench(lambda: run(bf16=True)), 2),
            **w8a8_arm(p, x, w, ids, table_cfg, ref, scale)}


def w8a8_arm(p: Problem, x, w, ids, tuned: dict, ref, scale: float) -> dict:
    """The same experts as W8A8 (activations quantized per token, INT8 products: what vLLM would serve with our
    dynamic scales were they passed as such): its time at vLLM's choice for it (BF16's table: `int8_w8a8` has no
    name of its own) and at the tuned W8A16 tile, its error against the W8A16 output (relative to its largest)."""
    from vllm.model_executor.layers.fused_moe import fused_experts
    from vllm.model_executor.layers.fused_moe.config import int8_w8a8_moe_quant_config

    q = int8_w8a8_moe_quant_config(w1_scale=p.s1, w2_scale=p.s2, a1_scale=None, a2_scale=None,
                                   per_act_token_quant=True)

    def run(config=None):
        if config is None:
            return fused_experts(x, p.w1, p.w2, w, ids, quant_config=q)
        with tile(config):
            return fused_experts(x, p.w1, p.w2, w, ids, quant_config=q)

    try:
        err = (run().float() - ref).abs().max().item() / scale
        return {"w8a8_vllm_us": round(bench(lambda: run()), 2), "w8a8_tuned_tile_us": round(bench(lambda: run(tuned)), 2),
                "w8a8_rel_err": round(err, 5)}
    except Exception as e:  # noqa: BLE001 -- a version without this path: reported, not fatal
        return {"w8a8_error": f"{type(e).__name__}: {e}"[:200]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="30b-a3b", help="benchmarks/shapes.py MoE shapes, or paths to models' "
                    "config.json (or their directories)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (each rank's experts are tuned)")
    ap.add_argument("--tokens", default=TOKENS, help="batch sizes (tokens of a step) to tune")
    ap.add_argument("--out", default=str(moe_tables.TABLES), help="the folder the tables are written to")
    ap.add_argument("--budget-s", type=float, default=900.0, help="seconds for the whole search")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        try:
            shape_dims(shape, args.tp)
        except (ValueError, json.JSONDecodeError) as e:
            sys.exit(f"error: --shapes: {e}")
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        sys.exit(f"error: --tokens {args.tokens!r}: a comma-separated list of positive integers")
    if not tokens or min(tokens) < 1:
        sys.exit(f"error: --tokens {args.tokens!r}: a comma-separated list of positive integers")
    near = Path(args.out)
    while not near.exists():
        near = near.parent
    if not near.is_dir() or not os.access(near, os.W_OK):
        sys.exit(f"error: --out {args.out}: {near} is not a folder you can write; pass --out DIR (then "
                 "VLLM_TUNED_CONFIG_FOLDER=DIR serves the tables)")
    if not torch.cuda.is_available():
        sys.exit("error: moe_tune.py needs a CUDA GPU (it times vLLM's Triton fused-MoE kernel)")
    from vllm.model_executor.layers.fused_moe.fused_moe import get_config_file_name

    start = time.monotonic()
    deadline = start + args.budget_s
    dev = torch.cuda.get_device_name()
    shapes = []
    for shape in args.shapes.split(","):
        p = Problem(shape, args.tp)
        rows = []
        for i, m in enumerate(tokens):  # each batch size gets an equal share of what is left
            rows.append(tune_tokens(p, m, time.monotonic() + (deadline - time.monotonic()) / (len(tokens) - i)))
            r = rows[-1]
            print(f"{shape} {p.dtype} M={m}: vLLM {r['vllm_us']} us, tuned {r['tuned_us']} us ({r['speedup']}x, "
                  f"{r['tried']} tried), bf16 {r['bf16_us']} us, w8a8 {r.get('w8a8_vllm_us')} / "
                  f"{r.get('w8a8_tuned_tile_us')} us", flush=True)
        name = get_config_file_name(p.E, p.N, p.dtype)
        try:
            write_table({r["tokens"]: r["tuned_config"] for r in rows}, Path(args.out) / name)
        except OSError as e:
            sys.exit(f"error: cannot write the table {Path(args.out) / name}: {e.strerror}; pass --out DIR (a folder "
                     "you can write; VLLM_TUNED_CONFIG_FOLDER=DIR then serves it)")
        shapes.append({"shape": shape, "tp": args.tp, "experts": p.E, "n": p.N, "k": p.K, "topk": p.topk, "dtype": p.dtype,
                       "table": name, "rows": rows})
        del p
        torch.cuda.empty_cache()
    print(f"\nvLLM's Triton fused-MoE experts, us per call (one layer), CUDA graphs ({dev}); table -> {args.out}")
    print("| shape | experts dtype | tokens | vLLM's config | tuned | tuned / vLLM's | INT8 tuned / BF16 | W8A8 (vLLM's / "
          "tuned tile) | tuned tile (M, N, K, group, warps, stages) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in shapes:
        for r in s["rows"]:
            c = r["tuned_config"]
            tile = ", ".join(str(c[k]) for k in moe_tables.CONFIG_KEYS)
            print(f"| {s['shape']} | {s['dtype']} | {r['tokens']} | {r['vllm_us']:.1f} | {r['tuned_us']:.1f} | "
                  f"{r['tuned_us'] / r['vllm_us']:.2f}x | {r['tuned_us'] / r['bf16_us']:.2f}x | "
                  f"{r.get('w8a8_vllm_us', '-')} / {r.get('w8a8_tuned_tile_us', '-')} | {tile} |")
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"device": dev, "torch": torch.__version__, "seconds": round(time.monotonic() - start, 1),
                       "shapes": shapes}, f, indent=1)
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
