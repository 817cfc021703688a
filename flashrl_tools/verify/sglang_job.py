"""One SGLang engine in its own process, driven by the same JSON request as verify/engine_job.py (the
vLLM one): ops `observe`, `push`, `sample`. SGLang runs the runtime's plugin itself (entry point
`sglang.srt.plugins`, FLASHRL_CONFIG from the environment). Written against SGLang 0.5.17's offline
`Engine`; GPU only (SGLang has no CPU backend installable from PyPI for this project's CPUs).

    python -m flashrl_tools.verify.sglang_job REQUEST.json RESULT.json
"""

from __future__ import annotations

import time


def observe(engine, step: dict) -> dict:
    outs = engine.generate(input_ids=step["sequences"], return_logprob=True, logprob_start_len=0,
                           sampling_params={"temperature": 0.0, "max_new_tokens": step.get("max_tokens", 8)})
    return {"tokens": [list(o["output_ids"]) for o in outs],
            # input_token_logprobs: (logprob, token id, text) per input token, None for the first
            "logprobs": [[lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]] for o in outs]}


def push(engine, step: dict) -> dict:
    """The checkpoint's BF16 tensors through SGLang's `update_weights_from_tensor`, one per call
    (how verl's per-tensor path and slime push); `"bucket": true` sends them all in one call as
    SGLang's flattened bucket."""
    from flashrl_tools.safetensors_io import CheckpointReader

    tensors = list(CheckpointReader(step["path"]).iter_tensors())
    t0 = time.perf_counter()
    if step.get("bucket"):  # as verl's SGLang path: one serialized payload per TP rank
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        bucket = FlattenedTensorBucket(named_tensors=tensors)
        payload = MultiprocessingSerializer.serialize({"flattened_tensor": bucket.get_flattened_tensor(),
                                                       "metadata": bucket.get_metadata()})
        engine.update_weights_from_tensor(named_tensors=[payload] * engine.server_args.tp_size,
                                          load_format="flattened_bucket")
    else:
        for name, tensor in tensors:
            engine.update_weights_from_tensor(named_tensors=[(name, tensor)])
    return {"seconds": time.perf_counter() - t0}


def sample(engine, step: dict) -> dict:
    params = [{"temperature": step.get("temperature", 1.0), "top_p": step.get("top_p", 1.0),
               "top_k": step.get("top_k", -1) or -1, "max_new_tokens": step["max_tokens"],
               "sampling_seed": step.get("seed", 0) + i} for i in range(len(step["prompts"]))]
    outs = engine.generate(input_ids=step["prompts"], sampling_params=params, return_logprob=True)
    return {"rollouts": [{"token_ids": list(o["output_ids"]),
                          "logprobs": [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]],
                          "finish_reason": (o["meta_info"].get("finish_reason") or {}).get("type")}
                         for o in outs]}


def run(req: dict) -> dict:
    import sglang

    kwargs = dict(dtype="bfloat16", context_length=1024, disable_radix_cache=True, random_seed=0,
                  mem_fraction_static=0.3, attention_backend="triton", log_level="error")
    kwargs.update(req.get("engine_kwargs", {}))
    engine = sglang.Engine(model_path=req["model"], **kwargs)
    try:
        ops = {"observe": observe, "push": push, "sample": sample}
        results = []
        for step in req["steps"]:
            if step["op"] not in ops:
                raise ValueError(f"unknown op {step['op']!r}")
            results.append(ops[step["op"]](engine, step))
        return {"steps": results}
    finally:
        engine.shutdown()


def main() -> None:
    from flashrl_tools.verify.engine_job import job_main

    job_main(run)


if __name__ == "__main__":
    main()
