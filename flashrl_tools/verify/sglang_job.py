"""One SGLang engine in its own process, driven by the same JSON request as verify/engine_job.py (the
vLLM one): ops `observe`, `push`, `sample`, and `score` (teacher-forced full distributions, for
checking sampled-token logprobs by hand). SGLang runs the runtime's plugin itself (entry point
`sglang.srt.plugins`, FLASHRL_CONFIG from the environment). Written against SGLang 0.5.17's offline
`Engine`; GPU only (SGLang has no CPU backend installable from PyPI for this project's CPUs).

    python -m flashrl_tools.verify.sglang_job REQUEST.json RESULT.json
"""

from __future__ import annotations

import time


def observe(engine, step: dict) -> dict:
    """Greedy tokens; "logprobs": the teacher-forced logprobs of each sequence, then those of its
    greedy tokens (decode steps: the ones that read the KV cache -- SGLang's prefill attends to the new
    tokens' own k / v). With an FP8 KV cache, rank 0's scales ("kv_scales"). `one_per_call`: each sequence its own
    request, one after another (a caller that observes so: a GEMM whose result depends on the batch's rows, as
    Marlin's W4A16 tiles by them, must see the same batches)."""
    kw = dict(return_logprob=True, logprob_start_len=0,
              sampling_params={"temperature": 0.0, "max_new_tokens": step.get("max_tokens", 8)})
    seqs = step["sequences"]
    outs = ([engine.generate(input_ids=[s], **kw)[0] for s in seqs] if step.get("one_per_call")
            else engine.generate(input_ids=seqs, **kw))
    result = {"tokens": [list(o["output_ids"]) for o in outs],
              # (logprob, token id, text) per token; the first input token has None
              "logprobs": [[lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]] +
                           [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]}
    if str(engine.server_args.kv_cache_dtype).startswith("fp8"):
        try:
            result["kv_scales"] = kv_scales(engine)
        except Exception as e:  # noqa: BLE001 -- reported (the scales checks then fail), the outputs still count
            result["kv_scales_error"] = f"{type(e).__name__}: {e}"
    return result


def kv_scales(engine) -> dict | list[dict]:
    """The FP8 KV scales the engine serves with ({layer: {k, v}}), through the runtime's scheduler RPC; at TP > 1
    every rank's, in rank order."""
    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="flashrl-kv-") as tmp:
        path = Path(tmp) / "scales.json"
        engine.collective_rpc("flashrl_kv_scales", path=str(path))
        tp = engine.server_args.tp_size
        files = [path if r == 0 else Path(f"{path}.rank{r}") for r in range(tp)]
        missing = [r for r, f in enumerate(files) if not f.is_file()]
        if missing:
            raise RuntimeError(f"TP ranks {missing} wrote no FP8 KV scales (`flashrl_kv_scales`; the engine's log "
                               "says why)")
        reports = [json.loads(f.read_text()) for f in files]
    if any(r["stale"] for r in reports):
        raise RuntimeError("the FP8 KV scales are stale after a rollout")
    return reports[0]["scales"] if tp == 1 else [r["scales"] for r in reports]


def push(engine, step: dict) -> dict:
    """The checkpoint's BF16 tensors through SGLang's `update_weights_from_tensor`, one per call
    (how verl's per-tensor path and slime push); `"bucket": true` sends them all in one call as
    SGLang's flattened bucket; `"disk": true` has SGLang read the checkpoint itself (`update_weights_from_disk`:
    its load, then every layer's processing again)."""
    from flashrl_tools.safetensors_io import CheckpointReader

    if step.get("disk"):
        t0 = time.perf_counter()
        ok, message = engine.update_weights_from_disk(str(step["path"]))[:2]
        if not ok:
            raise RuntimeError(f"SGLang refused a weight update from disk: {message}")
        return {"seconds": time.perf_counter() - t0}

    tensors = list(CheckpointReader(step["path"]).iter_tensors())
    if step.get("cuda"):  # the trainer's copy on the GPU (CUDA IPC handles, as verl's SGLang path sends)
        tensors = [(n, t.cuda()) for n, t in tensors]
    t0 = time.perf_counter()
    if step.get("bucket"):  # as verl's SGLang path
        push_payload(engine, bucket_payload(tensors))
    else:
        results = [engine.update_weights_from_tensor(named_tensors=[(name, tensor)]) for name, tensor in tensors]
        failed = [r[1] for r in results if not r[0]]  # (success, message): SGLang reports a failed load, never raises
        if failed:
            raise RuntimeError(f"SGLang refused {len(failed)} of {len(results)} weight updates: {failed[0]}")
    return {"seconds": time.perf_counter() - t0}


def bucket_payload(tensors) -> bytes:
    """SGLang's serialized flattened bucket of `tensors` (CUDA IPC handles for GPU tensors)."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    bucket = FlattenedTensorBucket(named_tensors=tensors)
    return MultiprocessingSerializer.serialize({"flattened_tensor": bucket.get_flattened_tensor(),
                                                "metadata": bucket.get_metadata()})


def push_payload(engine, payload: bytes) -> None:
    """One flattened-bucket update (the payload once per TP rank); raises when SGLang reports the load
    failed (it returns (success, message) and never raises)."""
    ok, message = engine.update_weights_from_tensor(named_tensors=[payload] * engine.server_args.tp_size,
                                                    load_format="flattened_bucket")[:2]
    if not ok:
        raise RuntimeError(f"SGLang refused a flattened-bucket weight update: {message}")


def sample(engine, step: dict) -> dict:
    """One sampled response per prompt with the engine's logprob of each sampled token. `"top": true`
    adds the step's whole distribution per token (dense, by token id: SGLang's log softmax(logits / T));
    with top-p / top-k truncation the renormalised logprobs (`return_sampling_mask`) as "sampling_logprobs"."""
    params = [{"temperature": step.get("temperature", 1.0), "top_p": step.get("top_p", 1.0),
               "top_k": step.get("top_k", -1) or -1, "max_new_tokens": step["max_tokens"],
               "sampling_seed": step.get("seed", 0) + i} for i in range(len(step["prompts"]))]
    top = engine.tokenizer_manager.model_config.vocab_size if step.get("top") else 0
    truncated = step.get("top_p", 1.0) < 1.0 or (step.get("top_k") or -1) > 0
    if truncated:  # Engine.generate has no return_sampling_mask (SGLang 0.5.17): the request itself
        from sglang.srt.managers.io_struct import GenerateReqInput

        req = GenerateReqInput(input_ids=step["prompts"], sampling_params=params, return_logprob=True,
                               top_logprobs_num=top, return_sampling_mask=True)
        outs = engine.loop.run_until_complete(engine.tokenizer_manager.generate_request(req, None).__anext__())
    else:
        outs = engine.generate(input_ids=step["prompts"], sampling_params=params, return_logprob=True,
                               top_logprobs_num=top)
    rollouts = []
    for o in outs:
        meta = o["meta_info"]
        r = {"token_ids": list(o["output_ids"]), "logprobs": [lp for lp, _, _ in meta["output_token_logprobs"]],
             "finish_reason": (meta.get("finish_reason") or {}).get("type")}
        if top:
            r["top"] = [dense(t, top) for t in meta["output_top_logprobs"]]
        if truncated:
            r["sampling_logprobs"] = meta.get("output_token_sampling_logprobs")
        rollouts.append(r)
    return {"rollouts": rollouts}


def score(engine, step: dict) -> dict:
    """Teacher-forced: the engine's whole log softmax(logits) (T = 1) at every position of each
    sequence, dense by token id (the first position has none: null)."""
    vocab = engine.tokenizer_manager.model_config.vocab_size
    outs = engine.generate(input_ids=step["sequences"], return_logprob=True, logprob_start_len=0,
                           top_logprobs_num=vocab, sampling_params={"temperature": 0.0, "max_new_tokens": 1})
    return {"dists": [[dense(t, vocab) if t else None for t in o["meta_info"]["input_top_logprobs"]] for o in outs]}


def dense(entries, vocab: int) -> list[float]:
    """SGLang's top-logprob entries [(logprob, token id, text), ...] as a list indexed by token id."""
    out = [float("-inf")] * vocab
    for lp, tok, _ in entries:
        out[tok] = lp
    return out


def own_nccl_port(pid: int | None = None) -> int | None:
    """A free torch.distributed port in a range of this process's own (SGLang takes any free port at start: two
    engines starting at the same moment on one host were handed the same one and one failed with EADDRINUSE).
    None when the range is taken (SGLang then picks its own)."""
    import os
    import socket

    base = 20000 + ((os.getpid() if pid is None else pid) % 2000) * 10
    for port in range(base, base + 10):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    return None


def run(req: dict) -> dict:
    import sglang

    kwargs = dict(dtype="bfloat16", context_length=1024, disable_radix_cache=True, random_seed=0,
                  mem_fraction_static=0.3, attention_backend="triton", log_level="error", nccl_port=own_nccl_port())
    kwargs.update(req.get("engine_kwargs", {}))
    engine = sglang.Engine(model_path=req["model"], **kwargs)
    try:
        ops = {"observe": observe, "push": push, "sample": sample, "score": score}
        results = []
        for step in req["steps"]:
            if step["op"] not in ops:
                raise ValueError(f"unknown op {step['op']!r}")
            if "rollouts_of" in step:  # score the prompts + responses of an earlier sample step
                k = step["rollouts_of"]
                step = {**step, "sequences": [p + r["token_ids"] for p, r in
                                              zip(req["steps"][k]["prompts"], results[k]["rollouts"])]}
            results.append(ops[step["op"]](engine, step))
        return {"steps": results}
    finally:
        engine.shutdown()


def main() -> None:
    from flashrl_tools.verify.engine_job import job_main

    job_main(run)


if __name__ == "__main__":
    main()
