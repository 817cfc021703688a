"""verl 0.9.1's SGLang rollout path: verl's own HTTP server adapter and weight-sync code driving an SGLang
0.5.17 server with FLASHRL_CONFIG (from the environment: the server process inherits it, as verl's Ray
actors do), as verl's hybrid engine does. The server is started by verl's `AsyncHttpServerAdapter` with the
arguments verl's SGLang server passes in hybrid mode: `enable_memory_saver`, `enable_weights_cpu_backup`,
`load_format="dummy"` (the trainer's first push brings the weights), `skip_server_warmup`; verl builds
ServerArgs before SGLang loads the plugins, so the runtime's config applies in `check_server_args`. Each
step, verl's order: release(["kv_cache", "weights"]), resume(["weights"]), the trainer's BF16 weights through
verl's `get_named_tensor_buckets` + SGLang's `weight_sync.utils.update_weights` (CUDA IPC, the `infer_tp`
mesh), flush_cache, resume(["kv_cache"]); then greedy tokens + teacher-forced logprobs (and the greedy
tokens' own) over HTTP. Pushed: the original weights, the perturbed, then a sleep / wake with no push, then the
original again while awake (no release / resume around the push: tells a sleep-path fault from a push-path one).
Usage: python verl_sglang_probe.py REQUEST.json RESULT.json
REQUEST: {"original": dir, "perturbed": dir, "sequences": [[ids]], "max_tokens": n, "bucket_mb": n,
          "engine_kwargs": {...}}
RESULT: {"original", "perturbed", "wake_without_push", "original_awake": observation, "push_seconds": [s, s]}"""

import asyncio
import json
import multiprocessing
import socket
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def observe(adapter, sequences, max_tokens) -> dict:
    outs = [await adapter.generate(input_ids=s, sampling_params={"temperature": 0.0, "max_new_tokens": max_tokens},
                                   return_logprob=True, logprob_start_len=0) for s in sequences]
    return {"tokens": [list(o["output_ids"]) for o in outs],  # teacher-forced, then the greedy tokens' (decode)
            "logprobs": [[e[0] for e in o["meta_info"]["input_token_logprobs"][1:]] +
                         [e[0] for e in o["meta_info"]["output_token_logprobs"]] for o in outs]}


async def push(adapter, mesh, path: str, bucket_mb: int) -> float:
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


async def cycle(adapter, mesh, path, bucket_mb: int):
    await adapter.release_memory_occupation(tags=["kv_cache", "weights"])
    await adapter.resume_memory_occupation(tags=["weights"])
    seconds = await push(adapter, mesh, path, bucket_mb) if path is not None else None
    await adapter.flush_cache()
    await adapter.resume_memory_occupation(tags=["kv_cache"])
    return seconds


def main():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from verl.workers.rollout.sglang_rollout.http_server_engine import AsyncHttpServerAdapter

    req = json.loads(open(sys.argv[1]).read())
    multiprocessing.set_start_method("spawn", force=True)  # verl's adapter starts the server with mp.Process
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    adapter = AsyncHttpServerAdapter(
        model_path=req["original"], host="127.0.0.1", port=_free_port(), first_rank_in_node=True, dtype="bfloat16",
        enable_memory_saver=True, enable_weights_cpu_backup=True, load_format="dummy", skip_server_warmup=True,
        attention_backend="triton", log_level="error", random_seed=0, disable_radix_cache=True,
        **req.get("engine_kwargs", {}))
    mesh = init_device_mesh("cpu", mesh_shape=(1, 1, 1), mesh_dim_names=["dp", "infer_tp", "infer_pp"])
    seqs, n, mb = req["sequences"], req["max_tokens"], req.get("bucket_mb", 16)

    async def drive():
        out = {"push_seconds": [await cycle(adapter, mesh, req["original"], mb)]}
        out["original"] = await observe(adapter, seqs, n)
        out["push_seconds"].append(await cycle(adapter, mesh, req["perturbed"], mb))
        out["perturbed"] = await observe(adapter, seqs, n)
        await cycle(adapter, mesh, None, mb)
        out["wake_without_push"] = await observe(adapter, seqs, n)
        await push(adapter, mesh, req["original"], mb)  # awake, no release / resume around it (verl's async mode)
        await adapter.flush_cache()
        out["original_awake"] = await observe(adapter, seqs, n)
        return out

    try:
        out = asyncio.run(drive())
    finally:
        adapter.shutdown()
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
