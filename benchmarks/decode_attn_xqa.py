"""TensorRT-LLM's XQA decode kernel (as FlashInfer 0.6.14 ships it) against flashrl's FP8 decode kernel, on one
layer's decode step over a paged FP8 (E4M3) cache with per-tensor scales (issue 45: flashrl's kernel reads the cache
at ~2.9 TB/s where FA3 reads a BF16 one at ~4.2; every Triton-level change to its loop was slower, RESULTS).

XQA takes a BF16 query; on Hopper with an FP8 cache it has two kernels: `xqa_sm90` (warpgroup MMAs on FP8 operands:
the query and the probabilities rounded to FP8, as FA3's FP8 path does) and `xqa_generic` (the cache widened to BF16,
BF16 products). K and V share one scale there, so the K scale rides on the query's: `q_scale = k_scale / v_scale`,
`kv_scale = v_scale` (softmax scale 1/sqrt(D) inside). Rows, each replayed from a CUDA graph:
  package        flashrl's kernel at its defaults on the FP8 query with its scale (what vLLM and SGLang run now)
  package_bf16q  flashrl's kernel on the BF16 query (keys widened to BF16: exact)
  xqa_sm90, xqa_generic   XQA's two kernels on the BF16 query
Bandwidth = the KV bytes a step must read / its time; error = max |out - float32 attention on the same FP8 cache
and query| / max |out|, first 8 sequences.

XQA is JIT-compiled CUDA. The GPU host has no compiler, so the modules are built where nvcc 13 is (no GPU needed:
`--build DIR`, with flashinfer-python 0.6.14 and apache-tvm-ffi 0.1.10 importable) and loaded there by path
(`--modules DIR`, only apache-tvm-ffi needed beside torch):

    bash scripts/build_xqa.sh .stage/xqa                                          # here: nvcc, no GPU
    python benchmarks/decode_attn_xqa.py --modules .stage/xqa --json xqa.json   # on the GPU (tvm-ffi installed)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_attention import D, PAGE, bench, make_batch  # noqa: E402
from shapes import QWEN3, QWEN25  # noqa: E402

from flashrl_tools.quant.kernels import fp8_decode_attn, fp8_decode_attn_ref  # noqa: E402
from flashrl_tools.quant.kernels.xqa_decode import SCRATCH_BYTES, SEMAPHORE_BYTES  # noqa: E402


SHAPES = {name: (cfg["num_attention_heads"], cfg["num_key_value_heads"])  # (query heads, KV heads)
          for name, cfg in {**QWEN25, **QWEN3}.items() if name != "tiny"}


def module_name(group: int, head_dim: int = D) -> str:
    """FlashInfer's JIT name of the XQA module for a BF16 query over an FP8 cache, 16-token pages."""
    return (f"xqa_input_bf16_kv_cache_e4m3_output_bf16_page_size_{PAGE}_head_dim_{head_dim}_head_group_ratio_{group}"
            "_use_sliding_window_False_use_spec_dec_False_spec_q_seq_len_1")


def module_shapes(text: str) -> list[tuple[int, int]]:
    """`--groups`: "G" (head dim 128) or "G:D" entries, comma-separated -> [(group, head_dim)]."""
    try:
        return [(int(g), int(d or D)) for g, _, d in (e.partition(":") for e in text.split(","))]
    except ValueError:
        sys.exit(f"error: --groups {text!r}: give comma-separated G or G:D entries (query heads per KV head[:head dim])")


def cuda_stub() -> None:
    """Where the toolkit has no driver stub (libcuda.so), link against one that defines the two driver calls XQA
    makes, so the module records libcuda.so.1 as needed and the GPU host's driver resolves them at load."""
    home = os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    if glob.glob(os.path.join(home, "lib64", "stubs", "libcuda.so")):
        return
    stub = tempfile.mkdtemp(prefix="cuda_stub_")
    src = os.path.join(stub, "stub.c")
    with open(src, "w") as f:
        f.write("int cuGetErrorName(void) { return 0; }\nint cuTensorMapEncodeTiled(void) { return 0; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", os.path.join(stub, "libcuda.so"), src],
                   check=True)
    os.environ["LIBRARY_PATH"] = stub + os.pathsep + os.environ.get("LIBRARY_PATH", "")


def build(out_dir: str, shapes: list[tuple[int, int]]) -> None:
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    try:
        from flashinfer.jit.xqa import gen_xqa_module
    except ImportError as e:
        sys.exit(f"error: --build needs flashinfer-python 0.6.14 (and nvcc 13 under CUDA_HOME): {e}")
    if not shutil.which("nvcc") and not os.path.exists(os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"),
                                                                     "bin", "nvcc")):
        sys.exit("error: --build needs nvcc 13 (set CUDA_HOME to the toolkit)")
    cuda_stub()

    os.makedirs(out_dir, exist_ok=True)
    for group, head_dim in shapes:
        spec = gen_xqa_module(torch.bfloat16, torch.float8_e4m3fn, PAGE, head_dim, group, False, torch.bfloat16, 1)
        spec.build(verbose=False)
        name = module_name(group, head_dim)
        shutil.copy(spec.jit_library_path, os.path.join(out_dir, name + ".so"))
        print(f"group {group}, head dim {head_dim}: {name}.so")


def package_fn(b: dict, fp8_query: bool, out: torch.Tensor):
    """flashrl's kernel at its defaults, on the FP8 query with its scale or on the BF16 one."""
    q, qs = (b["q8"], b["q_scale"]) if fp8_query else (b["q16"], None)
    k, v = b["raw"][..., :D], b["raw"][..., D:]
    return lambda: fp8_decode_attn.fp8_decode_attention(q, k, v, out, b["bt"], b["lens"], b["qsl"], D ** -0.5,
                                                        b["k_scale"], b["v_scale"], q_scale=qs)


def xqa_fn(mod, sm90: bool, b: dict, q16: torch.Tensor, kv_heads: int, out: torch.Tensor, ws: torch.Tensor):
    """One XQA call over the batch (the cache's K / V halves as strided views, the scales on the device)."""
    raw = b["raw"]
    k, v = raw[..., :D], raw[..., D:]
    lens = b["lens"].to(torch.uint32).unsqueeze(1)
    q_scale = b["k_scale"] / b["v_scale"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sem, scratch = ws[:SEMAPHORE_BYTES], ws[SEMAPHORE_BYTES:]
    max_len = b["bt"].shape[1] * PAGE

    def run():
        mod.xqa_wrapper(sm90, sms, kv_heads, 0, 1.0, q_scale, out.unsqueeze(1), 1.0, q16.unsqueeze(1), None, k, v,
                        None, None, b["bt"], max_len, lens, q16.shape[0], 1.0, b["v_scale"], 1, None, sem, scratch,
                        False)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", metavar="DIR", help="build the XQA modules into DIR (nvcc 13 + FlashInfer 0.6.14)")
    ap.add_argument("--groups", default="4,5,7", help="query heads per KV head to build, G or G:D with a head dim "
                    "other than 128 (Qwen3-8B 4, 14B 5, 7B 7; the GPU tests' models 4:64, SmolLM2-135M 3:64)")
    ap.add_argument("--modules", metavar="DIR", help="the built modules (on the GPU)")
    ap.add_argument("--shapes", default="14b,qwen3-8b,7b")
    ap.add_argument("--batches", default="256,128,16")
    ap.add_argument("--ctx", type=int, default=3000)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.build:
        build(args.build, module_shapes(args.groups))
        return
    if not args.modules or not torch.cuda.is_available():
        sys.exit("error: decode_attn_xqa.py times on a CUDA GPU and needs --modules DIR (built by --build DIR)")
    try:
        import tvm_ffi
    except ImportError:
        sys.exit("error: loading the XQA modules needs apache-tvm-ffi 0.1.10 (pip install apache-tvm-ffi==0.1.10)")

    ws = torch.zeros(SEMAPHORE_BYTES + SCRATCH_BYTES, dtype=torch.uint8, device="cuda")
    rows = []
    for shape in args.shapes.split(","):
        q_heads, kv_heads = SHAPES[shape]
        paths = glob.glob(os.path.join(args.modules, module_name(q_heads // kv_heads) + ".so"))
        mod = tvm_ffi.load_module(paths[0]) if paths else None
        for batch in (int(x) for x in args.batches.split(",")):
            b = make_batch(q_heads, kv_heads, batch, args.ctx, torch.Generator(device="cuda").manual_seed(0))
            n, raw = min(8, batch), b["raw"]
            q16 = b["q16"]
            refs = {q: fp8_decode_attn_ref.reference(x[:n], raw[..., :D], raw[..., D:], b["bt"][:n], b["lens"][:n],
                                                 b["qsl"][:n + 1], D ** -0.5, b["k_scale"], b["v_scale"], q_scale=s)
                    for q, x, s in (("q8", b["q8"], b["q_scale"]), ("q16", q16, None))}
            for name in ("package", "package_bf16q", "xqa_sm90", "xqa_generic"):
                out = torch.zeros(batch, q_heads, D, dtype=torch.bfloat16, device="cuda")
                row = {"shape": shape, "batch": batch, "variant": name, "ctx": args.ctx}
                try:
                    if name.startswith("package"):
                        fn = package_fn(b, name == "package", out)
                    elif mod is None:
                        raise FileNotFoundError(f"no module {module_name(q_heads // kv_heads)}.so in {args.modules}")
                    else:
                        fn = xqa_fn(mod, name == "xqa_sm90", b, q16, kv_heads, out, ws)
                    fn()
                    torch.cuda.synchronize()
                    us = bench(fn)
                    ref = refs["q8" if name == "package" else "q16"]
                    row.update(us=us, tb_s=b["kv_bytes"] / us / 1e6,
                               error=float((out[:n].float() - ref).abs().max() / ref.abs().max()))
                except Exception as e:  # noqa: BLE001 -- a kernel that fails is a row too
                    row["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                rows.append(row)
                print(f"{shape:9} {batch:4} {name:14} "
                      + (f"{row['us']:9.1f} us ({row['tb_s']:.2f} TB/s)  err {row['error']:.4f}" if "us" in row
                         else row["failed"]), flush=True)
                if args.json:
                    tmp = args.json + ".tmp"
                    with open(tmp, "w") as f:
                        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                   "rows": rows}, f, indent=1)
                    os.replace(tmp, args.json)
            del b


if __name__ == "__main__":
    main()
