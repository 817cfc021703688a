"""Weight-sync cost: one full trainer -> engine sync of BF16 weights, per precision and shape.

The trainer's tensors are made on the engine's device right before each call (random BF16
with the policy's names and shapes; for 14B/32B a full trainer copy would not fit beside the
engine) and the time spent making them is subtracted. Modes:
  bf16 / fp8 / int8  FLASHRL_CONFIG=...; `model.load_weights([(name, tensor)])` one tensor per
                     call, the path TRL colocate and verl use (through our runtime)
  native-bf16        FLASHRL_CONFIG unset; vLLM's own `model_runner.reload_weights` (reference)
Reported: wall time of the sync, time in our conversion (quantization; FLASHRL_SYNC_TIMING=1
synchronises the device around it), peak extra device memory during the sync (includes the one
incoming BF16 tensor).

    python benchmarks/weight_sync.py --shapes 7b,14b,32b --json benchmarks/results/weight_sync/dense.json
    python benchmarks/weight_sync.py --preset smoke    # CPU, a tiny config-only shape (CI)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import bench_parser, output_args, preset_options, run_worker, serve_worker, vllm_settings  # noqa: E402
from shapes import model_dir  # noqa: E402

PRESETS = {"gpu": dict(shapes="7b,14b,32b", modes="native-bf16,bf16,fp8,int8", repeats=3),
           "cpu": dict(shapes="default", modes="native-bf16,bf16,int8", repeats=3),
           # CI: the config-only shape (the GPU preset's path); the embedded model is the cpu preset's
           "smoke": dict(shapes="tiny", modes="native-bf16,bf16,int8", repeats=1)}


def sync_in_worker(model_path: str, native: bool, repeats: int, inplace: bool = True):
    """A worker function (collective_rpc): `repeats` full syncs, timed. `inplace=False` runs them
    with the runtime's in-place fast path off (every layer by the layerwise reload), for an A/B
    in one engine."""
    def run(worker):
        import torch

        from flashrl_tools.model_structure import _meta_model

        model = worker.model_runner.model
        dev = next(model.parameters()).device
        _, meta = _meta_model(Path(model_path), allow_quantized=True)
        config = meta.config
        shapes = [(n, t.shape) for n, t in meta.state_dict().items()
                  if not (n == "lm_head.weight" and config.tie_word_embeddings)]
        cuda = dev.type == "cuda"
        gen = {"s": 0.0}

        def tensors():
            g = torch.Generator(device=dev).manual_seed(0)
            for name, shape in shapes:
                t0 = time.perf_counter()
                t = (torch.randn(shape, generator=g, device=dev, dtype=torch.float32) * 0.02).to(torch.bfloat16)
                if cuda:
                    torch.cuda.synchronize()
                gen["s"] += time.perf_counter() - t0
                yield name, t
                del t

        results = []
        sync = getattr(model, "flashrl_sync", None)
        plan = sync.writer.inplace if sync is not None else None
        if sync is not None and not inplace:
            from flashrl_tools.runtime.vllm.inplace import InPlacePlan

            sync.writer.inplace = InPlacePlan()
        for _ in range(repeats):
            gen["s"] = 0.0
            before_convert = sync.convert_seconds if sync else 0.0
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            if native:
                worker.model_runner.reload_weights(weights_iterator=tensors())
            else:
                for name, t in tensors():
                    model.load_weights([(name, t)])
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0 - gen["s"]
            results.append({"sync_s": wall, "convert_s": (sync.convert_seconds - before_convert) if sync else 0.0,
                            "generate_s": gen["s"],
                            "peak_extra_bytes": (torch.cuda.max_memory_allocated() - base) if cuda else None,
                            "syncs_completed": sync.completed if sync else None, "tensors": len(shapes),
                            "inplace_layers": sum(plan.kinds.values()) if plan is not None and inplace else 0})
        if sync is not None:
            sync.writer.inplace = plan
        return results

    return run


def worker(spec: dict) -> dict:
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    import torch
    from vllm import LLM

    gpu = torch.cuda.is_available()
    llm = LLM(model=spec["model"], load_format="dummy" if spec["dummy"] else "auto", skip_tokenizer_init=True,
              dtype="bfloat16", max_model_len=512, gpu_memory_utilization=spec["gpu_memory_utilization"],
              enforce_eager=not gpu, seed=0, enable_prefix_caching=False)
    runs = llm.collective_rpc(sync_in_worker(spec["model"], spec["native"], spec["repeats"]))[0]
    best = min(runs, key=lambda r: r["sync_s"])
    return {"runs": runs, **best, **vllm_settings(llm)}


def run_one(spec: dict, mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "FLASHRL_CONFIG"}
    if mode != "native-bf16":
        env["FLASHRL_CONFIG"] = mode
    env["FLASHRL_SYNC_TIMING"] = "1"
    return run_worker(__file__, {**spec, "native": mode == "native-bf16"}, env)


def main() -> None:
    if serve_worker(worker):
        return
    ap = bench_parser(__doc__, PRESETS)
    ap.add_argument("--modes")
    ap.add_argument("--repeats", type=int)
    output_args(ap)
    a = ap.parse_args()
    import torch

    opts, util, work = preset_options(a, PRESETS, gpu_util=0.6)
    rows = []
    for shape in opts["shapes"].split(","):
        path, dummy = model_dir(shape, work)
        for mode in opts["modes"].split(","):
            spec = {"model": str(path), "dummy": dummy, "repeats": opts["repeats"], "gpu_memory_utilization": util}
            r = {"shape": shape, "mode": mode, **run_one(spec, mode)}
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "runs"}), flush=True)
    for r in rows:
        base = next((b for b in rows if b["shape"] == r["shape"] and b["mode"] == "bf16" and "error" not in b), None)
        if base and "error" not in r:
            r["vs_bf16_load_weights"] = r["sync_s"] / base["sync_s"]
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    import vllm

    print(f"\nweight sync on {device}, vLLM {vllm.__version__} (best of {opts['repeats']})")
    print(f"{'shape':8} {'mode':12} {'sync s':>8} {'vs bf16':>8} {'quantize s':>10} {'peak extra MiB':>14}")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:8} {r['mode']:12} error: {r['error']}")
            continue
        peak = f"{r['peak_extra_bytes'] / 2**20:.0f}" if r["peak_extra_bytes"] is not None else "-"
        print(f"{r['shape']:8} {r['mode']:12} {r['sync_s']:8.3f} {r.get('vs_bf16_load_weights', 0):7.2f}x "
              f"{r['convert_s']:10.3f} {peak:>14}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"device": device, "vllm": vllm.__version__, "date": time.strftime("%Y-%m-%d"),
                                            "settings": opts, "gpu_memory_utilization": util, "rows": rows}, indent=1))
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
