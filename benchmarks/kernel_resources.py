"""What flashrl's FP8 decode-attention split kernel costs an SM, compiled for Hopper (sm_90) on any machine -- no GPU.

Triton compiles the kernel as `fp8_decode_attn.fp8_decode_attention` launches it in vLLM (an FP8 query with its
scale tensor, the FP8 cache with 16-token pages, the pointers and the strides 16-aligned as Triton's launcher
specializes them) for each tile (keys an iteration : warps : pipeline stages), then reads the cubin's registers a
thread, spill stack and shared memory (Triton's bundled `cuobjdump -res-usage`). Programs an SM = the fewest that the
Hopper SM's 64 K registers, 228 KB shared memory, 64 warps and 32 blocks allow (registers allocated in 8s a thread;
1 KB of shared memory reserved a block). The decode kernel's split count (`fp8_decode_attn.splits_for`) aims at ~16
programs an SM; how many fit says how many waves a grid takes. Prints a table, writes JSON.

The numbers are those of the Triton installed here: the GPU host's (3.6 with torch 2.11; there this compile equals the
JIT of a real launch) can differ -- run it there, or point PYTHONPATH at an unpacked `triton==3.6.0` wheel here.

    python benchmarks/kernel_resources.py --shapes qwen3-8b,14b,7b --tiles 64:2:2,32:2:2,32:2:3,32:1:2 --json res.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import QWEN3, QWEN25  # noqa: E402

from flashrl_tools.quant.kernels import fp8_decode_attn  # noqa: E402

# Hopper (sm_90) per-SM limits: registers, shared memory (bytes), warps, resident blocks; 1 KB reserved a block
SM90 = {"regs": 65536, "smem": 233472, "warps": 64, "blocks": 32, "smem_reserved": 1024}
PTRS = {"q_ptr": "*fp8e4nv", "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "bt_ptr": "*i32", "lens_ptr": "*i32",
        "qsl_ptr": "*i32", "qs_ptr": "*fp32", "ks_ptr": "*fp32", "vs_ptr": "*fp32", "out_ptr": "*bf16",
        "part_ptr": "*fp32", "lse_ptr": "*fp32", "order_ptr": "*i32"}
ALIGNED = ("stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh",
           "stride_ot", "stride_oh", "q_heads")  # multiples of 16 in vLLM's layout (head size 128)


def constexprs(q_heads: int, kv_heads: int, block_n: int, splits: int = 16) -> dict:
    """The split kernel's compile-time arguments as `fp8_decode_attention` sets them (FP8 query with a scale tensor,
    V cast first; the heads a program and the padded query rows from the same functions)."""
    group = q_heads // kv_heads
    hpp = fp8_decode_attn.heads_per_program(q_heads, kv_heads)
    return dict(GROUP=group, GROUP_PAD=max(16, 1 << (hpp * group - 1).bit_length()), D=128, PAGE=16, BLOCK_N=block_n,
                SPLITS=splits, Q_FP8=True, Q_SCALED=True, HPP=hpp, V_ASM=True, ORDERED=False, MIN_SPLIT=0)


def balanced_constexprs(q_heads: int, kv_heads: int, block_n: int) -> dict:
    """The balanced kernel's (`fp8_decode_attn_bal`) compile-time arguments (one variant for up to 32 sequences)."""
    from flashrl_tools.quant.kernels import fp8_decode_attn_bal

    consts = {k: v for k, v in constexprs(q_heads, kv_heads, block_n).items()
              if k not in ("SPLITS", "ORDERED", "MIN_SPLIT")}
    return {**consts, "PAIRS": kv_heads // consts["HPP"], "SEQS_PAD": fp8_decode_attn_bal.MAX_SEQS}


def compile_split(consts: dict, num_warps: int, num_stages: int, qk: bool = False):
    """The split kernel (`qk`: the FP8-score one, `fp8_decode_attn_qk`; consts with PAIRS: the balanced one,
    `fp8_decode_attn_bal`) compiled for sm_90 (no device needed), with the divisibility Triton's launcher gives a real
    launch; arguments not in `consts` are runtime ones."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flashrl_tools.quant.kernels import fp8_decode_attn_bal, fp8_decode_attn_jit, fp8_decode_attn_qk

    split = (fp8_decode_attn_qk.kernel(fp8_decode_attn_jit) if qk else fp8_decode_attn_bal.kernels(fp8_decode_attn_jit)[0]
             if "PAIRS" in consts else fp8_decode_attn_jit.kernels()[0])
    names = split.arg_names
    sig = {n: "constexpr" if n in consts else PTRS.get(n, "fp32" if n == "sm_scale" else "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n not in consts and (n in PTRS or n in ALIGNED)}
    src = ASTSource(fn=split, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                          "num_stages": num_stages})


def resources(kernel, num_warps: int) -> dict:
    """Registers a thread, spill stack (bytes a thread), shared memory (bytes a program) and programs an SM."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        out = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if "REG:" in ln)
    regs, stack = (int(re.search(rf"{k}:(\d+)", line).group(1)) for k in ("REG", "STACK"))
    smem = kernel.metadata.shared
    by_regs = SM90["regs"] // (((regs + 7) // 8 * 8) * 32 * num_warps)
    by_smem = SM90["smem"] // (smem + SM90["smem_reserved"])
    programs = min(by_regs, by_smem, SM90["warps"] // num_warps, SM90["blocks"])
    limit = "registers" if programs == by_regs else "shared memory" if programs == by_smem else "warps / blocks"
    return {"regs": regs, "stack_bytes": stack, "smem_bytes": smem, "programs_per_sm": programs,
            "warps_per_sm": programs * num_warps, "limited_by": limit}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen3-8b,14b,7b")
    ap.add_argument("--tiles", default="64:2:2,64:2:3,32:2:2,32:2:3,32:1:2,128:4:2",
                    help="BLOCK_N:warps:stages, comma-separated (the default: 64:2:2)")
    ap.add_argument("--json")
    a = ap.parse_args()
    try:
        import triton
        import triton.backends.nvidia  # noqa: F401  (the sm_90 compiler and its ptxas / cuobjdump)
    except ImportError as e:
        sys.exit(f"kernel_resources: Triton with its NVIDIA backend is needed ({e}); install the project "
                 "(scripts/install.sh) or run it on the GPU host")
    shapes = {**QWEN3, **QWEN25}
    tiles = []
    for tile in a.tiles.split(","):
        parts = tile.split(":")
        pow2 = len(parts) == 3 and all(p.isdigit() and int(p) > 0 for p in parts) and all(
            int(p) & (int(p) - 1) == 0 for p in parts[:2])
        if not pow2 or int(parts[0]) < 16:
            sys.exit(f"kernel_resources: --tiles entry {tile!r} is not KEYS:WARPS:STAGES (positive integers; KEYS a "
                     "power of 2 from 16, WARPS a power of 2), e.g. 64:2:2")
        tiles.append(tuple(int(p) for p in parts))
    rows = []
    for name in a.shapes.split(","):
        if name not in shapes:
            sys.exit(f"kernel_resources: unknown shape {name!r} (one of {', '.join(shapes)})")
        cfg = shapes[name]
        for block_n, warps, stages in tiles:
            consts = constexprs(cfg["num_attention_heads"], cfg["num_key_value_heads"], block_n)
            rows.append({"shape": name, "block_n": block_n, "num_warps": warps, "num_stages": stages,
                         "heads_per_program": consts["HPP"],
                         **resources(compile_split(consts, warps, stages), warps)})
    print(f"flashrl's FP8 decode split kernel on sm_90 (Triton {triton.__version__}; programs an SM from its limits)")
    print(f"{'shape':9} {'keys':>4} {'warps':>5} {'stages':>6} {'regs':>4} {'spill B':>7} {'smem KB':>7} {'programs/SM':>11}"
          f" {'warps/SM':>8}  limited by")
    for r in rows:
        print(f"{r['shape']:9} {r['block_n']:4d} {r['num_warps']:5d} {r['num_stages']:6d} {r['regs']:4d} "
              f"{r['stack_bytes']:7d} {r['smem_bytes'] / 1024:7.1f} {r['programs_per_sm']:11d} {r['warps_per_sm']:8d}"
              f"  {r['limited_by']}")
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"triton": triton.__version__, "arch": "sm_90", "limits": SM90, "rows": rows}, f, indent=1)
        os.replace(tmp, a.json)


if __name__ == "__main__":
    main()
