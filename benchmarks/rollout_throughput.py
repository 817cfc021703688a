"""Rollout throughput, BF16 vs FP8 vs INT8, through FLASHRL_CONFIG (our runtime), equal work.

Same process per engine, same random prompts, fixed output length (ignore_eos), sampling at
T=1 with the sampled token's logprob (as RL rollouts do). Per (shape, config): output tokens/s,
KV-cache capacity (tokens), engine start time. Qwen2.5 7B/14B/32B shapes use dummy weights
(config.json + load_format="dummy"); `default` is the embedded model with real weights (CPU).

    python benchmarks/rollout_throughput.py --shapes 7b,14b,32b --json benchmarks/results/rollout_throughput/vllm.json
    python benchmarks/rollout_throughput.py --preset smoke   # CPU, embedded model, a few tokens
    python benchmarks/rollout_throughput.py --engine sglang --shapes 7b,14b ...   # GPU, SGLang 0.5.17

A config ending in `+kv` adds FLASHRL_KV_CACHE_DTYPE=fp8 (e.g. `int8+kv`). With SGLang and
--sync-bucket-mb, the first 1-token rollout after the sync is timed against a second one: with an FP8
KV cache the first includes the scales' recalibration (and the decode graphs' capture).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import bench_parser, output_args, preset_options, run_worker, serve_worker, sglang_engine, vllm_settings  # noqa: E402
from shapes import model_dir  # noqa: E402

PRESETS = {
    "gpu": dict(shapes="7b,14b,32b", configs="bf16,fp8,int8", prompts=256, prompt_len=256, output_len=512),
    "cpu": dict(shapes="default", configs="bf16,int8", prompts=32, prompt_len=64, output_len=64),
    # CI: the config-only shape (the GPU preset's path); the embedded model is the cpu preset's
    "smoke": dict(shapes="tiny", configs="bf16,int8", prompts=4, prompt_len=16, output_len=4),
}


def worker(spec: dict) -> dict:
    """Runs in a fresh process with FLASHRL_CONFIG set (or not)."""
    import random

    import torch
    from vllm import LLM, SamplingParams

    gpu = torch.cuda.is_available()
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], load_format="dummy" if spec["dummy"] else "auto", skip_tokenizer_init=True,
              dtype="bfloat16", max_model_len=spec["prompt_len"] + spec["output_len"] + 8,
              gpu_memory_utilization=spec["gpu_memory_utilization"], enforce_eager=not gpu, seed=0,
              enable_prefix_caching=False)
    start_s = time.perf_counter() - t0
    cache = llm.llm_engine.vllm_config.cache_config
    kv_tokens = (cache.num_gpu_blocks or 0) * cache.block_size
    rng = random.Random(0)
    vocab = min(1000, json.loads((Path(spec["model"]) / "config.json").read_text())["vocab_size"])
    prompts = [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(spec["prompt_len"])]}
               for _ in range(spec["prompts"])]
    params = SamplingParams(temperature=1.0, max_tokens=spec["output_len"], ignore_eos=True, logprobs=0, seed=0,
                            detokenize=False)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    quant = llm.llm_engine.vllm_config.model_config.quantization
    return {"engine_start_s": start_s, "generate_s": gen_s, "output_tokens": tokens,
            "output_tok_per_s": tokens / gen_s, "kv_cache_tokens": kv_tokens, "quantization": quant,
            **vllm_settings(llm)}


def worker_sglang(spec: dict) -> dict:
    """The same workload on SGLang (issue 32): its offline Engine, CUDA graphs, triton attention."""
    import random

    t0 = time.perf_counter()
    engine = sglang_engine(spec, spec["prompt_len"] + spec["output_len"] + 8, disable_radix_cache=True,
                           attention_backend="triton")
    try:
        start_s = time.perf_counter() - t0
        info = engine.get_server_info()
        rng = random.Random(0)
        vocab = min(1000, json.loads((Path(spec["model"]) / "config.json").read_text())["vocab_size"])
        prompts = [[rng.randrange(10, vocab) for _ in range(spec["prompt_len"])] for _ in range(spec["prompts"])]
        engine.generate(input_ids=prompts[:4], sampling_params={"max_new_tokens": 4, "ignore_eos": True})
        params = {"temperature": 1.0, "max_new_tokens": spec["output_len"], "ignore_eos": True}
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        gen_s = time.perf_counter() - t0
        tokens = sum(len(o["output_ids"]) for o in outs)
        out = {"engine_start_s": start_s, "generate_s": gen_s, "output_tokens": tokens,
               "output_tok_per_s": tokens / gen_s, "kv_cache_tokens": int(info.get("max_total_num_tokens") or 0),
               "quantization": info.get("quantization"),
               # SGLang's counterpart of vLLM's asynchronous scheduling: the overlap scheduler (on by default)
               "async_scheduling": not getattr(engine.server_args, "disable_overlap_schedule", False)}
        if spec.get("sync_bucket_mb"):
            out.update(sglang_sync_seconds(engine, spec["model"], spec["sync_bucket_mb"]))
            for key in ("first_rollout_after_sync_s", "next_rollout_s"):  # the first one calibrates FP8 KV scales
                t0 = time.perf_counter()
                engine.generate(input_ids=prompts[:1], sampling_params={"max_new_tokens": 1})
                out[key] = time.perf_counter() - t0
        return out
    finally:
        engine.shutdown()


def bucket_groups(model_path: str, bucket_mb: int) -> list[list[tuple[str, tuple]]]:
    """The policy's (name, shape) pairs (a tied lm_head left out) in BF16 buckets of at most `bucket_mb`."""
    from flashrl_tools.model_structure import _meta_model

    _, meta = _meta_model(Path(model_path), allow_quantized=True)
    tied = meta.config.tie_word_embeddings
    groups, size = [[]], 0
    for name, t in meta.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue
        if groups[-1] and size + t.numel() * 2 > bucket_mb << 20:
            groups.append([])
            size = 0
        groups[-1].append((name, t.shape))
        size += t.numel() * 2
    return groups


def sglang_sync_seconds(engine, model_path: str, bucket_mb: int) -> dict:
    """One full sync of random BF16 weights (the policy's names and shapes) the way verl's SGLang path
    sends them: flattened buckets of `bucket_mb` on the GPU through `update_weights_from_tensor`. Only
    the calls are timed, not the making of each bucket (a full trainer copy would not fit beside the engine)."""
    import torch

    from flashrl_tools.verify.sglang_job import bucket_payload, push_payload

    groups = bucket_groups(model_path, bucket_mb)
    gen = torch.Generator(device="cuda").manual_seed(0)
    seconds = []
    for group in groups:
        tensors = [(n, torch.randn(s, generator=gen, device="cuda", dtype=torch.bfloat16).mul_(0.02)) for n, s in group]
        payload = bucket_payload(tensors)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        push_payload(engine, payload)
        seconds.append(time.perf_counter() - t0)
        del tensors, payload
    return {"sync_s": sum(seconds), "sync_buckets": len(groups), "sync_bucket_mb": bucket_mb}


def run_one(spec: dict, config: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("FLASHRL_CONFIG", "FLASHRL_KV_CACHE_DTYPE")}
    env["FLASHRL_CONFIG"] = config.removesuffix("+kv")
    if config.endswith("+kv"):
        env["FLASHRL_KV_CACHE_DTYPE"] = "fp8"
    return run_worker(__file__, spec, env)


def main() -> None:
    if serve_worker(lambda spec: (worker_sglang if spec.get("engine") == "sglang" else worker)(spec)):
        return
    ap = bench_parser(__doc__, PRESETS)
    ap.add_argument("--configs")
    ap.add_argument("--prompts", type=int)
    ap.add_argument("--prompt-len", type=int)
    ap.add_argument("--output-len", type=int)
    ap.add_argument("--engine", choices=["vllm", "sglang"], default="vllm")
    ap.add_argument("--sync-bucket-mb", type=int, default=0,
                    help="SGLang: also time one full BF16 sync in flattened buckets of this size (verl's path)")
    output_args(ap)
    a = ap.parse_args()
    import torch

    opts, util, work = preset_options(a, PRESETS, gpu_util=0.9)
    rows = []
    for shape in opts["shapes"].split(","):
        path, dummy = model_dir(shape, work)
        for config in opts["configs"].split(","):
            spec = {"model": str(path), "dummy": dummy, "prompts": opts["prompts"], "prompt_len": opts["prompt_len"],
                    "output_len": opts["output_len"], "gpu_memory_utilization": util, "engine": a.engine,
                    "sync_bucket_mb": a.sync_bucket_mb}
            r = {"shape": shape, "config": config, **run_one(spec, config)}
            rows.append(r)
            print(json.dumps(r), flush=True)
    for r in rows:
        base = next((b for b in rows if b["shape"] == r["shape"] and b["config"] == "bf16" and "error" not in b), None)
        if base and "error" not in r:
            r["speedup_vs_bf16"] = r["output_tok_per_s"] / base["output_tok_per_s"]
            r["kv_cache_vs_bf16"] = r["kv_cache_tokens"] / base["kv_cache_tokens"] if base["kv_cache_tokens"] else None
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    engine = __import__(a.engine)
    label = f"{'vLLM' if a.engine == 'vllm' else 'SGLang'} {engine.__version__}"
    print(f"\nrollout throughput on {device}, {label}: {opts['prompts']} prompts x "
          f"{opts['prompt_len']} tokens in, {opts['output_len']} tokens out (ignore_eos, T=1, logprobs=0)")
    print(f"{'shape':8} {'config':7} {'tok/s':>10} {'vs bf16':>8} {'KV tokens':>11} {'KV vs bf16':>10} {'start s':>8} "
          f"{'sync s':>7} {'async sch':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:8} {r['config']:7} error: {r['error']}")
            continue
        kv = r.get("kv_cache_vs_bf16")
        sync = f"{r['sync_s']:7.2f}" if "sync_s" in r else "      -"
        print(f"{r['shape']:8} {r['config']:7} {r['output_tok_per_s']:10.1f} {r.get('speedup_vs_bf16', 0):7.2f}x "
              f"{r['kv_cache_tokens']:11d} {(f'{kv:.2f}x' if kv else '-'):>10} {r['engine_start_s']:8.1f} "
              f"{sync} {str(r.get('async_scheduling', '-')):>9}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"device": device, a.engine: engine.__version__, "date": time.strftime("%Y-%m-%d"),
                                            "settings": opts, "gpu_memory_utilization": util, "rows": rows}, indent=1))
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
