"""One vLLM engine in its own process, driven by a JSON request (used by `flashrl verify`).

    python -m flashrl_tools.verify.engine_job REQUEST.json RESULT.json

The runtime applies FLASHRL_CONFIG from the environment, as in a trainer's engine. REQUEST:
  {"model": dir, "engine_kwargs": {...}, "fault": null | name (verify/faults.py),
   "steps": [{"op": "observe", "sequences": [[ids]], "max_tokens": n}  greedy tokens + teacher-
                                                   forced logprobs (prompt_logprobs) of the sequences
             (+ "kv_scales" {layer: {q, k, v}} with an FP8 KV cache)
             {"op": "push", "path": dir}            the checkpoint's BF16 tensors via model.load_weights,
                                                   one tensor per call (verl / TRL colocate), each a
                                                   view into one reused buffer poisoned after the call
             {"op": "sample", "prompts": [[ids]], "temperature", "top_p", "top_k", "max_tokens",
              "seed"}                              one sampled response per prompt, with the
                                                   engine's logprob of each sampled token]}
RESULT: {"steps": [...]} or {"error": "..."} (exit code 3) when the engine could not start or a
step failed.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback


def push_checkpoint(path: str, count: int | None = None):
    """A function for collective_rpc: stream a checkpoint (its first `count` tensors: a sync left
    incomplete) into the worker's model, one tensor per
    `model.load_weights` call. Every tensor is handed over as a view into one staging buffer on the model's
    device that is overwritten with NaN right after the
    call, as a trainer reuses its transfer buffer (verl's bucket buffer): a sync that kept a view
    of what it was given instead of a copy serves NaN."""

    def push(worker):
        import torch

        from flashrl_tools.safetensors_io import CheckpointReader

        model = worker.model_runner.model
        reader = CheckpointReader(path)
        size = max(reader.dtype(n).itemsize * math.prod(reader.shape(n)) for n in reader.names())
        staging = torch.empty(size, dtype=torch.uint8, device=next(model.parameters()).device)
        t0 = time.perf_counter()
        for i, (name, tensor) in enumerate(reader.iter_tensors()):
            if count is not None and i >= count:
                break
            used = staging[:tensor.numel() * tensor.element_size()]
            view = used.view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
            model.load_weights([(name, view)])
            used.fill_(255)  # all-ones bytes: NaN in bf16 / fp32
        return {"seconds": time.perf_counter() - t0}

    return push


def observe(llm, step: dict) -> dict:
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": s} for s in step["sequences"]]
    params = SamplingParams(temperature=0.0, max_tokens=step.get("max_tokens", 8), prompt_logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
              "logprobs": [[lp[t].logprob for t, lp in zip(s[1:], o.prompt_logprobs[1:])]
                           for s, o in zip(step["sequences"], outs)]}
    if fp8_kv_cache(llm):  # the scales these logprobs were computed with (rank 0's)
        result["kv_scales"] = llm.collective_rpc("flashrl_kv_scales")[0]
    return result


def fp8_kv_cache(llm) -> bool:
    """Whether the engine has an FP8 KV cache whose scales the runtime calibrates."""
    from flashrl_tools.config.resolve import from_env

    dtype = str(llm.llm_engine.vllm_config.cache_config.cache_dtype)
    return from_env() is not None and dtype.startswith("fp8")


def sample(llm, step: dict) -> dict:
    from vllm import SamplingParams

    params = [SamplingParams(temperature=step.get("temperature", 1.0), top_p=step.get("top_p", 1.0),
                             top_k=step.get("top_k", -1) or -1, max_tokens=step["max_tokens"],
                             seed=step.get("seed", 0) + i, logprobs=0)
              for i in range(len(step["prompts"]))]
    outs = llm.generate([{"prompt_token_ids": p} for p in step["prompts"]], params, use_tqdm=False)
    rollouts = []
    for o in outs:
        c = o.outputs[0]
        rollouts.append({"token_ids": list(c.token_ids),
                         "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                         "finish_reason": c.finish_reason})
    return {"rollouts": rollouts}


def run(req: dict) -> dict:
    # pushes send a function to the workers; across processes vLLM requires this opt-in
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if req.get("fault"):
        from flashrl_tools.verify.faults import inject

        inject(req["fault"])
    from vllm import LLM

    kwargs = dict(dtype="bfloat16", max_model_len=1024, enforce_eager=True, enable_prefix_caching=False,
                  gpu_memory_utilization=0.3, seed=0)
    kwargs.update(req.get("engine_kwargs", {}))
    llm = LLM(model=req["model"], **kwargs)
    results = []
    for step in req["steps"]:
        if step["op"] == "observe":
            results.append(observe(llm, step))
        elif step["op"] == "push":
            results.append(llm.collective_rpc(push_checkpoint(step["path"]))[0])
        elif step["op"] == "sample":
            results.append(sample(llm, step))
        else:
            raise ValueError(f"unknown op {step['op']!r}")
    return {"steps": results}


def job_main(run_request, exit_process=sys.exit) -> None:
    """`python -m JOB REQUEST.json RESULT.json` for an engine job (this one, verify/sglang_job.py)."""
    req_path, out_path = sys.argv[1], sys.argv[2]
    try:
        result, code = run_request(json.loads(open(req_path).read())), 0
    except Exception as e:  # reported to the parent, which prints one line
        traceback.print_exc()
        result, code = {"error": f"{type(e).__name__}: {e}"}, 3
    with open(out_path, "w") as f:
        json.dump(result, f)
    exit_process(code)


def main() -> None:
    job_main(run, exit_engine_process)


def exit_engine_process(code: int = 0) -> None:
    """End a process that ran one vLLM engine, its result already written. An in-process engine
    has nothing outside this process to shut down, and the interpreter's teardown of vLLM/torch
    costs ~3 s on 2 CPU cores (measured): skip it. A multiprocess engine exits normally (its
    engine-core process is shut down by that teardown)."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
