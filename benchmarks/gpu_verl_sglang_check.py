"""verl 0.9.1's SGLang rollout path on the GPU (issue 32): verl's own HTTP server adapter and weight
sync code driving an SGLang 0.5.17 server with FLASHRL_CONFIG set, as verl's hybrid engine does.

The server is started by verl's `AsyncHttpServerAdapter` with the arguments verl's SGLang server
(async_sglang_server.py) passes in hybrid mode: `enable_memory_saver`, `enable_weights_cpu_backup`,
`load_format="dummy"` (the trainer's first push brings the weights), `skip_server_warmup`; verl builds
ServerArgs before SGLang loads the plugins, so the runtime's config applies in `check_server_args`.
Each step, verl's order: `release_memory_occupation(["kv_cache", "weights"])`, `resume(["weights"])`,
the trainer's BF16 weights through verl's `get_named_tensor_buckets` + SGLang's
`weight_sync.utils.update_weights` (CUDA IPC, the `infer_tp` mesh), `flush_cache`,
`resume(["kv_cache"])`, then greedy tokens + teacher-forced logprobs over HTTP. Pushed: the original
weights, the perturbed weights, then a sleep / wake with no push (the CPU backup keeps the synced
8-bit weights). Each compared with a fresh plain SGLang engine on the offline quantization of the same
weights (0.0 expected). HF-initialised random Qwen3 (benchmarks/gpu_sglang_check.py's models).
A config with a '+kv' suffix adds FLASHRL_KV_CACHE_DTYPE=fp8 (the fresh engines: FLASHRL_CONFIG=bf16 on the
quantized checkpoint, same KV cache); the logprobs compared include the greedy tokens' (decode steps).
Usage: python benchmarks/gpu_verl_sglang_check.py --json OUT [--configs int8,fp8,int8+kv]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import tempfile
import time
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import load_sibling  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def observe(adapter, sequences) -> dict:
    outs = [await adapter.generate(input_ids=s, sampling_params={"temperature": 0.0, "max_new_tokens": 8},
                                   return_logprob=True, logprob_start_len=0) for s in sequences]
    return {"tokens": [list(o["output_ids"]) for o in outs],  # teacher-forced, then the greedy tokens' (decode)
            "logprobs": [[e[0] for e in o["meta_info"]["input_token_logprobs"][1:]] +
                         [e[0] for e in o["meta_info"]["output_token_logprobs"]] for o in outs]}


async def push(adapter, mesh, path: Path, bucket_mb: int) -> float:
    """verl's ServerAdapter.update_weights (hybrid, no LoRA, no verl FP8): its buckets, SGLang's sender."""
    import torch
    from sglang.srt.weight_sync.utils import update_weights as sgl_update_weights
    from verl.workers.rollout.sglang_rollout.utils import get_named_tensor_buckets

    from flashrl_tools.safetensors_io import CheckpointReader

    weights = ((n, t.to("cuda")) for n, t in CheckpointReader(path).iter_tensors())  # the trainer's GPU copy
    t0 = time.perf_counter()
    async for batch in get_named_tensor_buckets(weights, bucket_mb << 20):
        r = await sgl_update_weights(engine=adapter, params_batch=batch, device_mesh_key="infer_tp", device_mesh=mesh)
        if isinstance(r, dict) and not r.get("success", True):  # the server reports a failed load, never raises
            raise RuntimeError(f"SGLang refused a weight update: {r.get('message')}")
    torch.cuda.synchronize()
    return time.perf_counter() - t0


async def cycle(adapter, mesh, path: Path | None, bucket_mb: int) -> float | None:
    await adapter.release_memory_occupation(tags=["kv_cache", "weights"])
    await adapter.resume_memory_occupation(tags=["weights"])
    seconds = await push(adapter, mesh, path, bucket_mb) if path is not None else None
    await adapter.flush_cache()
    await adapter.resume_memory_occupation(tags=["kv_cache"])
    return seconds


def run_config(config: str, models, work: Path, args) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from verl.workers.rollout.sglang_rollout.http_server_engine import AsyncHttpServerAdapter

    gsc = load_sibling("gpu_sglang_check")
    orig, pert = models
    kv = "fp8" if config.endswith("+kv") else None
    fmt = gsc.FORMAT[config.removesuffix("+kv")]
    os.environ["FLASHRL_CONFIG"] = config.removesuffix("+kv")  # the server process inherits it, as verl's Ray actors do
    if kv:  # FP8 KV cache: the server's TokenizerManager calibrates after each push
        os.environ["FLASHRL_KV_CACHE_DTYPE"] = kv
    adapter = AsyncHttpServerAdapter(
        model_path=str(orig), host="127.0.0.1", port=_free_port(), first_rank_in_node=True, dtype="bfloat16",
        mem_fraction_static=args.mem_fraction, enable_memory_saver=True, enable_weights_cpu_backup=True,
        load_format="dummy", skip_server_warmup=True, attention_backend="triton", log_level="error",
        context_length=512, cuda_graph_max_bs_decode=8, random_seed=0, disable_radix_cache=True, max_total_tokens=8192)
    mesh = init_device_mesh("cpu", mesh_shape=(1, 1, 1), mesh_dim_names=["dp", "infer_tp", "infer_pp"])

    async def drive():
        out = {}
        out["push_original_s"] = await cycle(adapter, mesh, orig, args.bucket_mb)
        out["original"] = await observe(adapter, gsc.SEQS)
        out["push_perturbed_s"] = await cycle(adapter, mesh, pert, args.bucket_mb)
        out["perturbed"] = await observe(adapter, gsc.SEQS)
        await cycle(adapter, mesh, None, args.bucket_mb)
        out["wake_without_push"] = await observe(adapter, gsc.SEQS)
        return out

    try:
        got = asyncio.run(drive())
    finally:
        adapter.shutdown()
        os.environ.pop("FLASHRL_CONFIG", None)
        os.environ.pop("FLASHRL_KV_CACHE_DTYPE", None)
    fresh = {tag: gsc.engine(gsc.quantized(src, fmt, work), [gsc.obs()], "bf16" if kv else None, f"fresh {tag}",
                             args.ekw, kv)
             for tag, src in (("original", orig), ("perturbed", pert))}
    if any(isinstance(v, str) for v in fresh.values()):
        return {"config": config, "error": fresh}
    row = {"config": config, "served_format": fmt or "bf16",
           "original_vs_fresh": gsc.same(got["original"], fresh["original"][0]),
           "perturbed_vs_fresh": gsc.same(got["perturbed"], fresh["perturbed"][0]),
           "wake_without_push_vs_fresh": gsc.same(got["wake_without_push"], fresh["perturbed"][0]),
           "changed_by_sync": gsc.same(got["original"], got["perturbed"])["max_dlogp"],
           "push_seconds": [got["push_original_s"], got["push_perturbed_s"]]}
    checks = [row[k] for k in ("original_vs_fresh", "perturbed_vs_fresh", "wake_without_push_vs_fresh")]
    row["passed"] = all(c["max_dlogp"] == 0.0 and c["tokens_equal"] for c in checks) and row["changed_by_sync"] > 0.01
    return row



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, default=Path("gpu_verl_sglang_check.json"))
    ap.add_argument("--configs", default="int8,fp8")
    ap.add_argument("--bucket-mb", type=int, default=16, help="verl's update_weights_bucket_megabytes")
    ap.add_argument("--mem-fraction", type=float, default=0.3)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    args.ekw = {"mem_fraction_static": args.mem_fraction, "max_total_tokens": 8192, "cuda_graph_max_bs_decode": 8,
                "context_length": 512}
    import multiprocessing

    import torch.distributed as dist

    multiprocessing.set_start_method("spawn", force=True)  # verl's adapter starts the server with mp.Process
    work = args.workdir or Path(tempfile.mkdtemp(prefix="gpu-verl-sglang-"))
    work.mkdir(parents=True, exist_ok=True)
    models = load_sibling("gpu_sglang_check").make_models(work, {"dense"})["dense"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    rows = []
    for config in args.configs.split(","):
        try:
            rows.append(run_config(config, models, work, args))
        except Exception as e:  # noqa: BLE001 -- one config's failure is a row, the next still runs
            rows.append({"config": config, "error": f"{type(e).__name__}: {e}", "passed": False})
        print(json.dumps(rows[-1]), flush=True)
    import sglang
    import torch
    import verl

    result = {"device": torch.cuda.get_device_name(), "sglang": sglang.__version__, "verl": verl.__version__,
              "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"\nverl {verl.__version__} SGLang rollout path (hybrid: memory saver + weights CPU backup, dummy load) "
          f"on {result['device']}, SGLang {sglang.__version__}")
    for r in rows:
        if "error" in r:
            print(f"{r['config']:6} ERROR {str(r['error'])[:300]}")
            continue
        cells = "  ".join(f"{k}: {r[k]['max_dlogp']:.2e} {'=' if r[k]['tokens_equal'] else 'x'}"
                          for k in ("original_vs_fresh", "perturbed_vs_fresh", "wake_without_push_vs_fresh"))
        print(f"{r['config']:6} {r['served_format']:11} {cells}  {'ok' if r['passed'] else 'FAIL'}")


if __name__ == "__main__":
    main()
