"""One vLLM engine in sleep mode, driven the way verl's and TRL's trainers drive it (GPU).

FLASHRL_CONFIG (and FLASHRL_KV_CACHE_DTYPE) come from the environment; the engine is started with
`enable_sleep_mode=True` and compiled (torch.compile + CUDA graphs, FULL_AND_PIECEWISE as verl),
in-process. Usage: python lifecycle_probe.py REQUEST.json RESULT.json
REQUEST: {"model": dir, "sequences": [[ids]], "max_tokens": n, "engine_kwargs": {...},
          "fresh": true  -> observe once (a fresh engine on `model`) and stop, or
          "original": dir, "perturbed": dir (BF16 checkpoints; the engine starts on `original`),
          "verl": true | false (verl 0.9.1's own update_weights_from_ipc + BucketedWeightSender,
                  CUDA IPC from a trainer process), "bucket_mb": n,
          "sleep": false -> no sleep mode: the first three stages only (a baseline)}
Stages (each observed: greedy tokens, teacher-forced logprobs, FP8 KV scales if any):
  start                  the engine as started
  push_nosleep           perturbed pushed without sleeping (one tensor per call)
  back_nosleep           original pushed back
  verl_replica           verl's order: sleep(2), wake(["weights"]), the trainer's tensors (in-memory
                         names) in buckets through one reused buffer overwritten with NaN after
                         each bucket, vLLM's whole-model process_weights_after_loading,
                         reset_prefix_cache, wake(["kv_cache"])     -> perturbed
  level1                 sleep(1), wake_up()                         -> unchanged
  refused                sleep(2), wake_up(), no push: generate must be refused
  trl                    TRL's order: sleep(2), wake(["weights"]), one load_weights per trainer
                         parameter, reset_prefix_cache, wake(["kv_cache"])   -> original
  verl                   (with "verl") verl's own code, fp32 trainer tensors  -> perturbed
                         (else verl_replica again)
RESULT: {"stages": {name: observation}, "refused": message or null, "digest": {tensor: sha1}}
(`digest`: every parameter and buffer, and every tensor kernel objects hold, after the last stage; at TP > 1 every
rank's, named `rankR:tensor`, and the FP8 KV scales of every rank.) Engine kwargs `tensor_parallel_size` 2 with
`distributed_executor_backend` "mp": verl's own code runs a trainer per rank, each on its rank's GPU and socket.
"""

import json
import os
import subprocess
import sys
import threading
import time

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

TRAINER = """
import asyncio, os, sys, torch
from transformers import AutoModelForCausalLM
from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender
path, handle, mb, device = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.cuda.set_device(device)  # the trainer rank beside its rollout rank (verl colocates them GPU by GPU)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()  # verl pushes fp32 masters
sender = BucketedWeightSender(zmq_handle=handle, bucket_size_mb=mb, use_shm=False)
asyncio.run(sender.async_send_weights(iter(model.state_dict().items())))
print("sent", flush=True)
"""


def trainer_tensors(path, dtype="bfloat16"):
    """What a transformers trainer holds: in-memory names (fused MoE experts), on the GPU."""
    def load(worker):
        import torch
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        device = next(worker.model_runner.model.parameters()).device
        worker._probe_trainer = [(n, t.to(device)) for n, t in m.state_dict().items()]
        return len(worker._probe_trainer)
    return load


def push_per_parameter(worker):
    """TRL colocate: model.load_weights([(name, param.data)]) per parameter."""
    model = worker.model_runner.model
    for name, tensor in worker._probe_trainer:
        model.load_weights([(name, tensor)])


def push_buckets_poisoned(bucket_bytes):
    """verl's order with a reused transfer buffer: pack the trainer's tensors into one buffer,
    load_weights(bucket of views), overwrite the buffer with NaN, next bucket; then vLLM's
    whole-model process_weights_after_loading (as update_weights_from_ipc)."""
    def push(worker):
        import torch
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        model = worker.model_runner.model
        items = worker._probe_trainer
        size = max(bucket_bytes, max(t.numel() * t.element_size() for _, t in items))
        device = next(model.parameters()).device
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
        bucket, offset = [], 0

        def flush():
            model.load_weights(bucket)
            if device.type == "cuda":
                torch.cuda.synchronize()
            buffer.fill_(255)  # NaN in bf16 / fp32: what the next bucket's bytes would be
        for name, t in items:
            nbytes = t.numel() * t.element_size()
            offset = (offset + t.element_size() - 1) // t.element_size() * t.element_size()
            if offset + nbytes > size and bucket:
                flush()
                bucket, offset = [], 0
            view = buffer[offset:offset + nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            bucket.append((name, view))
            offset += nbytes
        flush()
        mc = worker.model_runner.vllm_config.model_config
        process_weights_after_loading(model, mc, device)
    return push


def push_checkpoint(path):
    def push(worker):
        from flashrl_tools.safetensors_io import CheckpointReader

        model = worker.model_runner.model
        device = next(model.parameters()).device
        for name, tensor in CheckpointReader(path).iter_tensors():
            model.load_weights([(name, tensor.to(device))])
    return push


def verl_handle(rank: int = 0):
    return f"ipc:///tmp/rl-colocate-zmq-{os.environ['VERL_RAY_JOB_ID']}-replica-0-rank-{rank}.sock"


def verl_sync(llm, path, bucket_mb, log_path, tp: int = 1):
    """verl 0.9.1 vLLMAsyncRollout.update_weights: the workers' update_weights_from_ipc (RPC) while a
    trainer process per rank (its GPU, its rank's socket: verl's `_get_zmq_handle`) streams the whole model with
    BucketedWeightSender over CUDA IPC; each rank loads its shard. A trainer that fails leaves the receiver waiting
    for buckets forever: the trainers' log and every thread's stack are written to `log_path` and the probe stops
    with an error."""
    import faulthandler

    result = {}

    def rpc():
        try:
            llm.collective_rpc("update_weights_from_ipc", kwargs={"use_shm": False})
        except BaseException as e:  # re-raised below
            result["error"] = e

    t = threading.Thread(target=rpc, daemon=True)
    t.start()
    with open(log_path, "w") as log:
        trainers = [subprocess.Popen([sys.executable, "-c", TRAINER, path, verl_handle(r), str(bucket_mb), str(r)],
                                     stdout=log, stderr=subprocess.STDOUT) for r in range(tp)]
        deadline = None
        while t.is_alive():
            t.join(1.0)
            if all(tr.poll() is not None for tr in trainers) and deadline is None:
                deadline = time.monotonic() + 60  # the receivers have a minute to finish after the trainers
            if deadline is not None and t.is_alive() and time.monotonic() > deadline:
                codes = [tr.returncode for tr in trainers]
                log.write(f"\ntrainer exit codes {codes}; receiver still waiting. Threads:\n")
                log.flush()
                faulthandler.dump_traceback(file=log, all_threads=True)
                raise RuntimeError(f"verl's receiver did not finish (trainer exits {codes}); see {log_path}")
        for tr in trainers:
            tr.wait(60)
    if "error" in result:
        raise result["error"]


def digest(worker):
    """sha1 of every parameter and buffer and of every tensor kernel objects hold (with or without the
    runtime in this engine: a function, not the runtime's named RPC)."""
    from flashrl_tools.runtime.core.digest import model_digest

    return model_digest(worker.model_runner.model, "vllm")


def main():
    req = json.loads(open(sys.argv[1]).read())
    if req.get("verl"):
        os.environ.setdefault("VERL_RAY_JOB_ID", f"flashrl-lifecycle-{os.getpid()}")
    from vllm import LLM, SamplingParams

    kwargs = dict(dtype="bfloat16", max_model_len=512, enable_prefix_caching=False,
                  enable_sleep_mode=req.get("sleep", True),
                  seed=0, compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"})
    if req.get("verl"):
        kwargs["worker_extension_cls"] = "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension"
    kwargs.update(req.get("engine_kwargs", {}))
    llm = LLM(model=req["model"], **kwargs)
    prompts = [{"prompt_token_ids": s} for s in req["sequences"]]
    fp8_kv = str(llm.llm_engine.vllm_config.cache_config.cache_dtype).startswith("fp8")
    tp = llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size

    def per_rank(values: list, digests: bool = False):
        """One rank's value as it is; at TP > 1 every rank's (a list; digests: one dict keyed `rankR:tensor`)."""
        if len(values) == 1:
            return values[0]
        return {f"rank{r}:{name}": h for r, d in enumerate(values) for name, h in d.items()} if digests else values

    def observe():
        p = SamplingParams(temperature=0.0, max_tokens=req.get("max_tokens", 8), prompt_logprobs=0)
        outs = llm.generate(prompts, p, use_tqdm=False)
        obs = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
               "logprobs": [[lp[t].logprob for t, lp in zip(s[1:], o.prompt_logprobs[1:])]
                            for s, o in zip(req["sequences"], outs)]}
        if fp8_kv:  # every rank's (TP > 1: the scales must be bit-equal on each)
            obs["kv_scales"] = per_rank(llm.collective_rpc("flashrl_kv_scales"))
        return obs

    stages, refused, timing = {}, None, {}
    if req.get("fresh"):
        stages["fresh"] = observe()
    else:
        orig, pert = req["original"], req["perturbed"]
        bucket = req.get("bucket_mb", 4) << 20
        stages["start"] = observe()
        llm.collective_rpc(push_checkpoint(pert))
        stages["push_nosleep"] = observe()
        llm.collective_rpc(push_checkpoint(orig))
        stages["back_nosleep"] = observe()
    if not req.get("fresh") and req.get("sleep", True):

        def verl_replica(path):
            llm.sleep(level=2)
            llm.wake_up(tags=["weights"])
            llm.collective_rpc(trainer_tensors(path))
            t0 = time.perf_counter()
            llm.collective_rpc(push_buckets_poisoned(bucket))
            timing.setdefault("verl_replica_s", time.perf_counter() - t0)
            llm.reset_prefix_cache()
            llm.wake_up(tags=["kv_cache"])

        verl_replica(pert)
        stages["verl_replica"] = observe()
        llm.sleep(level=1)
        llm.wake_up()
        stages["level1"] = observe()
        llm.sleep(level=2)
        llm.wake_up()
        try:
            llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
        except Exception as e:  # must be refused: the weights are gone
            refused = f"{type(e).__name__}: {e}"
        llm.sleep(level=2)  # TRL: sleep after each rollout, wake weights, push, wake KV cache
        llm.wake_up(tags=["weights"])
        llm.collective_rpc(trainer_tensors(orig))
        llm.collective_rpc(push_per_parameter)
        llm.reset_prefix_cache()
        llm.wake_up(tags=["kv_cache"])
        stages["trl"] = observe()
        if req.get("verl"):
            llm.sleep(level=2)
            llm.wake_up(tags=["weights"])
            t0 = time.perf_counter()
            verl_sync(llm, pert, req.get("bucket_mb", 4), sys.argv[2] + ".trainer.log", tp)
            timing["verl_s"] = time.perf_counter() - t0
            llm.reset_prefix_cache()
            llm.wake_up(tags=["kv_cache"])
            stages["verl"] = observe()
            stages["verl_fp8_path"] = llm.collective_rpc(_verl_fp8_detected)[0]
        else:
            verl_replica(pert)
            stages["verl"] = observe()
    if not req.get("fresh") and not req.get("sleep", True):
        llm.collective_rpc(push_checkpoint(req["perturbed"]))  # the digest compares the perturbed state
    result = {"stages": stages, "refused": refused, "timing": timing, "digest": per_rank(llm.collective_rpc(digest), True),
              "tensor_parallel_size": tp,
              # a plain vLLM engine (the calibrated case's fresh reference) has no runtime to ask
              "inplace_layers": llm.collective_rpc("flashrl_inplace_layers")[0] if os.environ.get("FLASHRL_CONFIG") else {}}
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


def _verl_fp8_detected(worker):
    """Whether verl's own FP8 path took over this engine (it must not: the runtime syncs)."""
    from verl.utils.vllm.vllm_quant_utils import is_quantized_model

    return is_quantized_model(worker.model_runner.vllm_config)


if __name__ == "__main__":
    from flashrl_tools.verify.engine_job import exit_engine_process

    main()
    exit_engine_process()
