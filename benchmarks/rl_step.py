"""One GRPO-shaped RL step per precision: rollout (with sampling logprobs) + full weight sync + next rollout.

What a verl/TRL user buys is a shorter step. Per config (each in a fresh process with its
FLASHRL_CONFIG, `+kv` adds FLASHRL_KV_CACHE_DTYPE=fp8): P prompts x n samples (default 64 x 8),
prompts of `--prompt-len` random tokens, each sample's output length drawn from a seeded
long-tailed (log-normal) distribution capped at `--max-len` and forced with per-request
`max_tokens` + `ignore_eos` (dummy weights never stop by themselves), T=1 with the sampled
token's logprob (what TIS needs), prefix caching on (the n samples share their prompt, as in
verl). Then a full sync of the trainer's BF16 tensors through `model.load_weights` one tensor per
call (the path TRL colocate and verl take, through our runtime; tensors are made on the engine's
device and the time to make them is subtracted, as in weight_sync.py; the first sync of the
process is reported apart (one-time JIT), the step uses the second, and a third runs with the
in-place fast path off: `reload s`, the layerwise reload for every layer), then the next rollout on
new prompts (for an FP8 KV cache it includes the scale recalibration). Same lengths for every
config. Reports rollout s (each), sync s, step s = rollout after the sync + sync, output tok/s,
KV capacity (tokens; how many full-length sequences fit), peak device memory, ratios vs the
`bf16` row of the same run; prints a table, writes JSON (`sync_log`: each sync's conversion and write as the
runtime logged them, FLASHRL_SYNC_TIMING, in every engine process -- SGLang's schedulers included;
`flashrl_decode_attn_ran`: whether decode batches went through flashrl's FP8 attention kernel; `roofline`: the
rollout's least bytes over the device's peak bandwidth, and the fraction of that bound it reached, `roofline.py`).

    python benchmarks/rl_step.py --shapes 7b --configs bf16,fp8,int8,int8+kv --json benchmarks/results/rl_step/7b.json
    python benchmarks/rl_step.py --preset smoke     # CPU, config-only tiny shape (CI)
    python benchmarks/rl_step.py --preset dapo      # Qwen3-8B / 7B / 14B, prompts of 1-2k tokens, responses <= 16k
    python benchmarks/rl_step.py --preset colocated --stats  # verl's colocated share (0.5 of the GPU), 256 sequences
    python benchmarks/rl_step.py --engine sglang --shapes 7b --configs bf16,int8+kv   # GPU, SGLang 0.5.17
    python benchmarks/rl_step.py --shapes 7b --configs bf16,int8+kv --step-bands     # + the rollout by running requests

`--engine sglang`: the same step on SGLang's offline Engine (radix cache on, its overlap scheduler on, the
attention backend of `--attention-backend`), the sync as verl's SGLang path sends it: flattened BF16 buckets
through `update_weights_from_tensor` (rollout_throughput.sglang_sync_seconds; SGLang has no layerwise-reload
A/B, so `reload s` is empty). `--page-size N`: SGLang's pool by N-token pages (its default 1; flashrl's FP8 decode
kernel reads contiguous pages at 16: 2.7 % off the 14B int8 + FP8 KV step, RESULTS).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    bench_parser, config_env, output_args, page_size_error, preset_options, run_worker, runtime_log, serve_worker,
    sglang_engine, vllm_settings)
from roofline import roofline  # noqa: E402
from shapes import model_dir  # noqa: E402
from step_bands import LoggedSteps, StepClock, print_bands  # noqa: E402
from weight_sync import sync_in_worker  # noqa: E402

PRESETS = {
    "gpu": dict(shapes="7b,14b,32b", configs="bf16,fp8,int8,int8+kv", prompts=64, samples=8, prompt_len=1024,
                max_len=8192),
    "cpu": dict(shapes="default", configs="bf16,int8,int8+kv", prompts=4, samples=4, prompt_len=64, max_len=128),
    "smoke": dict(shapes="tiny", configs="bf16,int8+kv", prompts=2, samples=3, prompt_len=16, max_len=48),
    # issue 45's anchors (NeMo-RL's Qwen3-8B FP8 report, DAPO): prompts of 1-2k tokens, responses up to 16k
    "dapo": dict(shapes="qwen3-8b,7b,14b", configs="bf16,int8+kv,fp8+kv", prompts=64, samples=8,
                 prompt_len="1024-2048", max_len=16384),
    # the colocated trainer's rollout (issue 45's anchors): the engine gets verl's default share of the GPU
    # (rollout.gpu_memory_utilization 0.5; NeMo-RL's FP8 recipe 0.5, TRL colocate 0.3) and 256 sequences, NeMo-RL's
    # Qwen3-8B recipe per engine (64 prompts x 32 on 8 GPUs); the goal rows' lengths
    "colocated": dict(shapes="qwen3-8b,14b", configs="bf16,int8+kv", prompts=32, samples=8, prompt_len=1024,
                      max_len=8192, gpu_memory_utilization=0.5),
}


def prompt_lengths(count: int, spec, seed: int = 0) -> list[int]:
    """Each prompt's length: `spec` tokens (an int), or drawn uniformly from "LO-HI" (seeded: the same for every
    config)."""
    text = str(spec)
    lo, sep, hi = text.partition("-")
    if not (lo.isdigit() and (not sep or hi.isdigit())) or int(lo) < 1 or (sep and int(hi) < int(lo)):
        raise ValueError(f"--prompt-len {text!r}: use N or LO-HI tokens (e.g. 1024 or 1024-2048)")
    if not sep:
        return [int(lo)] * count
    rng = random.Random(seed + 7)
    return [rng.randint(int(lo), int(hi)) for _ in range(count)]


def output_lengths(count: int, cap: int, seed: int = 0, fixed: bool = False) -> list[int]:
    """Long-tailed response lengths as RL rollouts have them: log-normal with median cap/4 and
    sigma 0.75 (mean ~cap/3; ~3 % hit the cap), at least min(16, cap). `fixed`: every sample
    exactly `cap` (with --prompts 1 --samples 1: the time of the longest sample alone, the floor
    of a rollout's tail)."""
    if fixed:
        return [cap] * count
    rng = random.Random(seed)
    mu = math.log(cap / 4)
    return [max(min(16, cap), min(cap, int(rng.lognormvariate(mu, 0.75)))) for _ in range(count)]


def _device_memory(worker) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"peak_allocated_bytes": None, "device_used_bytes": None}
    free, total = torch.cuda.mem_get_info()
    return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(), "device_used_bytes": total - free}


def _preemptions(llm) -> int | None:
    """vLLM's cumulative preemption counter (None when its stats are off, as by default)."""
    if llm.llm_engine.logger_manager is None:
        return None
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"))


def worker(spec: dict) -> dict:
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    import torch
    from vllm import LLM, SamplingParams

    gpu = torch.cuda.is_available()
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], load_format="dummy" if spec["dummy"] else "auto", skip_tokenizer_init=True,
              dtype="bfloat16", max_model_len=max(spec["prompt_lens"]) + spec["max_len"] + 8,
              gpu_memory_utilization=spec["gpu_memory_utilization"], enforce_eager=not gpu, seed=0,
              enable_prefix_caching=True, disable_log_stats=not spec.get("stats", False), **tp_kwargs(spec),
              **({"attention_backend": spec["attention_backend"]} if spec.get("attention_backend") else {}))
    start_s = time.perf_counter() - t0
    progress(f"engine started in {start_s:.0f} s")
    cache = llm.llm_engine.vllm_config.cache_config
    kv_tokens = (cache.num_gpu_blocks or 0) * cache.block_size
    vocab = min(1000, json.loads((Path(spec["model"]) / "config.json").read_text())["vocab_size"])

    def rollout(step: int, cap: int, bands: bool = False) -> dict:
        ids, lengths, seeds = sampled_requests(spec, step, cap, vocab)
        reqs = [{"prompt_token_ids": p} for p in ids]
        params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True,
                                 logprobs=0 if spec.get("logprobs", True) else None, seed=seed, detokenize=False)
                  for n, seed in zip(lengths, seeds)]
        preempted = _preemptions(llm)
        clock = StepClock(llm.llm_engine)
        t0 = time.perf_counter()
        with clock if bands else contextlib.nullcontext():
            outs = llm.generate(reqs, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        with_logprobs = sum(1 for o in outs if o.outputs[0].logprobs and len(o.outputs[0].logprobs) == len(
            o.outputs[0].token_ids))
        out = {"rollout_s": seconds, "output_tokens": tokens, "samples_with_logprobs": with_logprobs,
               "output_tok_per_s": tokens / seconds, **({"bands": clock.bands()} if bands else {})}
        if preempted is not None:  # --stats: requests vLLM preempted (KV cache full) during this rollout
            out["preemptions"] = _preemptions(llm) - preempted
        return out

    llm.generate([{"prompt_token_ids": [11] * 8}], SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False),
                 use_tqdm=False)  # warm-up outside the timed steps
    first = rollout(0, spec.get("first_max_len") or spec["max_len"])
    progress(f"first rollout {first['rollout_s']:.0f} s; syncing")
    # the first sync of a process pays one-time costs (the Triton INT8 kernel's JIT): the step uses
    # the second; a third with the in-place fast path off measures what it saves (issue 16)
    first_sync, sync = slowest_rank(llm.collective_rpc(sync_in_worker(spec["model"], native=False, repeats=2)))
    layerwise = slowest_rank(llm.collective_rpc(sync_in_worker(spec["model"], native=False, repeats=1,
                                                               inplace=False)))[0]
    progress(f"sync {sync['sync_s']:.2f} s; the timed rollout")
    second = rollout(1, spec["max_len"], bands=spec.get("step_bands", False))
    memory = llm.collective_rpc(_device_memory)[0]
    return {"engine_start_s": start_s, "kv_cache_tokens": kv_tokens,
            "full_length_seqs_in_kv": kv_tokens // (max(spec["prompt_lens"]) + spec["max_len"]),
            "quantization": llm.llm_engine.vllm_config.model_config.quantization,
            "kv_cache_dtype": llm.llm_engine.vllm_config.cache_config.cache_dtype,
            "rollout_1": first, "rollout_2": second, "sync_s": sync["sync_s"], "convert_s": sync["convert_s"],
            "first_sync_s": first_sync["sync_s"], "sync_layerwise_s": layerwise["sync_s"],
            "inplace_layers": sync["inplace_layers"],
            "syncs_completed": sync["syncs_completed"], "sync_peak_extra_bytes": sync["peak_extra_bytes"],
            "step_s": second["rollout_s"] + sync["sync_s"], "output_tokens": second["output_tokens"],
            "output_tok_per_s": second["output_tok_per_s"], **memory, **vllm_settings(llm)}


def progress(what: str) -> None:
    """A row's phase on stderr, at once (its log shows where a row cut off by a lease was)."""
    print(f"[rl_step {time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def tp_kwargs(spec: dict) -> dict:
    """vLLM's engine kwargs for `--tp N` (issue 76): N > 1 shards the model over N GPUs, its workers as processes."""
    tp = spec.get("tp") or 1
    return {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}


def slowest_rank(ranks: list[list[dict]]) -> list[dict]:
    """Per sync, the timing of the rank that took longest (a sync ends when every rank has loaded its shard); one
    rank's list as it is."""
    return [max(syncs, key=lambda r: r["sync_s"]) for syncs in zip(*ranks)]


def sampled_requests(spec: dict, step: int, cap: int, vocab: int) -> tuple[list[list[int]], list[int], list]:
    """One rollout's requests: each sample's prompt token ids (new prompts every step, the same for every config
    and engine), its length and its sampling seed (None with `--unseeded`: as verl and TRL sample; a seeded
    request costs vLLM's sampler a generator call of its own per step)."""
    rng = random.Random(1000 + step)
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in spec["prompt_lens"]]
    lengths = output_lengths(spec["prompts"] * spec["samples"], spec["max_len"], fixed=spec.get("fixed_len", False))
    ids = [prompts[i // spec["samples"]] for i in range(len(lengths))]
    seeds = [step * 100003 + i if spec.get("seeded", True) else None for i in range(len(lengths))]
    return ids, [min(n, cap) for n in lengths], seeds


def worker_sglang(spec: dict) -> dict:
    """The step on SGLang: the same requests, T=1 with each sampled token's logprob, per-request lengths and
    seeds; a full BF16 sync of the policy's shapes in flattened buckets (timed: the calls), then the rollout
    after it (with an FP8 KV cache its first request recalibrates the scales: inside the step)."""
    import torch

    from rollout_throughput import sglang_sync_seconds

    steps = Path(tempfile.mkdtemp()) / "steps"  # --step-bands: the scheduler's step log (step_bands.LoggedSteps)
    if spec.get("step_bands"):
        os.environ["FLASHRL_STEP_LOG"] = str(steps)  # read by the scheduler processes the engine starts
    t0 = time.perf_counter()
    engine = sglang_engine(spec, max(spec["prompt_lens"]) + spec["max_len"] + 8, tp_size=spec.get("tp") or 1)
    try:
        start_s = time.perf_counter() - t0
        info = engine.get_server_info()
        kv_tokens = int(info.get("max_total_num_tokens") or 0)
        vocab = min(1000, json.loads((Path(spec["model"]) / "config.json").read_text())["vocab_size"])
        logprobs = spec.get("logprobs", True)

        def rollout(step: int, cap: int, bands: bool = False) -> dict:
            ids, lengths, seeds = sampled_requests(spec, step, cap, vocab)
            params = [{"temperature": 1.0, "max_new_tokens": n, "ignore_eos": True,
                       **({} if seed is None else {"sampling_seed": seed})} for n, seed in zip(lengths, seeds)]
            clock = LoggedSteps(steps)
            t0 = time.perf_counter()
            with clock if bands else contextlib.nullcontext():
                outs = engine.generate(input_ids=ids, sampling_params=params, return_logprob=logprobs)
                seconds = time.perf_counter() - t0  # before the clock reads the step log
            tokens = sum(len(o["output_ids"]) for o in outs)
            with_logprobs = sum(1 for o in outs if len((o.get("meta_info") or {}).get("output_token_logprobs") or [])
                                == len(o["output_ids"]) > 0)
            return {"rollout_s": seconds, "output_tokens": tokens, "samples_with_logprobs": with_logprobs,
                    "output_tok_per_s": tokens / seconds, **({"bands": clock.bands()} if bands else {})}

        engine.generate(input_ids=[[11] * 8], sampling_params={"max_new_tokens": 4, "ignore_eos": True})
        first = rollout(0, spec.get("first_max_len") or spec["max_len"])
        progress(f"first rollout {first['rollout_s']:.0f} s; syncing")
        bucket = spec.get("sync_bucket_mb") or 512
        first_sync = sglang_sync_seconds(engine, spec["model"], bucket)  # one-time costs (JIT): reported apart
        sync = sglang_sync_seconds(engine, spec["model"], bucket)
        second = rollout(1, spec["max_len"], bands=spec.get("step_bands", False))
        free, total = torch.cuda.mem_get_info()
        return {"engine": "sglang", "engine_start_s": start_s, "kv_cache_tokens": kv_tokens,
                "full_length_seqs_in_kv": kv_tokens // (max(spec["prompt_lens"]) + spec["max_len"]),
                "quantization": info.get("quantization"), "kv_cache_dtype": str(engine.server_args.kv_cache_dtype),
                "attention_backend": spec.get("attention_backend") or "triton",
                "page_size": engine.server_args.page_size, "rollout_1": first, "rollout_2": second,
                "sync_s": sync["sync_s"], "first_sync_s": first_sync["sync_s"],
                "sync_layerwise_s": None, "sync_bucket_mb": bucket, "step_s": second["rollout_s"] + sync["sync_s"],
                "output_tokens": second["output_tokens"], "output_tok_per_s": second["output_tok_per_s"],
                "peak_allocated_bytes": None, "device_used_bytes": total - free,
                # SGLang's counterpart of vLLM's asynchronous scheduling: its overlap scheduler (on by default)
                "async_scheduling": not getattr(engine.server_args, "disable_overlap_schedule", False)}
    finally:
        engine.shutdown()


def run_one(spec: dict, config: str) -> dict:
    env = config_env(config)
    if isinstance(env, str):
        return {"error": env}
    env["FLASHRL_SYNC_TIMING"] = "1"
    return run_worker(__file__, spec, env, scan=runtime_log)


def add_ratios(rows: list[dict]) -> None:
    for r in rows:
        base = next((b for b in rows if b["shape"] == r["shape"] and b["config"] == "bf16" and "error" not in b), None)
        if base is None or "error" in r:
            continue
        r["rollout_vs_bf16"] = r["rollout_2"]["rollout_s"] / base["rollout_2"]["rollout_s"]
        r["sync_vs_bf16"] = r["sync_s"] / base["sync_s"]
        r["sync_layerwise_vs_bf16"] = r["sync_layerwise_s"] / base["sync_s"] if r["sync_layerwise_s"] else None
        r["step_vs_bf16"] = r["step_s"] / base["step_s"]
        # issue 45: the speed-up as a fraction of the 2.0x bound of 8-bit weights + 8-bit KV when decode reads bytes
        r["of_2x_bound"] = base["step_s"] / r["step_s"] / 2.0
        r["kv_vs_bf16"] = r["kv_cache_tokens"] / base["kv_cache_tokens"] if base["kv_cache_tokens"] else None


def print_table(rows: list[dict], header: str) -> None:
    print(f"\n{header}")
    print(f"{'shape':8} {'config':9} {'rollout s':>9} {'sync s':>8} {'step s':>8} {'step/bf16':>9} {'sync/bf16':>9} "
          f"{'reload s':>8} {'1st sync':>8} {'tok/s':>9} {'KV tokens':>10} {'KV/bf16':>7} {'peak GiB':>8} {'preempt':>7} "
          f"{'of 2.0x':>7} {'roofline':>8} {'async sch':>9} {'core proc':>9}")

    def ratio(value) -> str:  # "-" where this run had no bf16 row of the shape
        return f"{value:.2f}x" if value else "-"

    def f(value, spec: str) -> str:  # "-" where the engine has no such figure
        return "-" if value is None else format(value, spec)

    for r in rows:
        if "error" in r:
            print(f"{r['shape']:8} {r['config']:9} error: {r['error']}")
            continue
        peak = f"{r['device_used_bytes'] / 2**30:.1f}" if r.get("device_used_bytes") else "-"
        preempt = r["rollout_2"].get("preemptions", "-")
        bound = f"{r['of_2x_bound']:.2f}" if r.get("of_2x_bound") else "-"
        roof = (r.get("roofline") or {}).get("fraction")
        print(f"{r['shape']:8} {r['config']:9} {r['rollout_2']['rollout_s']:9.2f} {r['sync_s']:8.3f} "
              f"{r['step_s']:8.2f} {ratio(r.get('step_vs_bf16')):>9} {ratio(r.get('sync_vs_bf16')):>9} "
              f"{f(r['sync_layerwise_s'], '8.3f'):>8} {r['first_sync_s']:8.3f} {r['output_tok_per_s']:9.1f} "
              f"{r['kv_cache_tokens']:10d} {ratio(r.get('kv_vs_bf16')):>7} {peak:>8} {preempt:>7} "
              f"{bound:>7} {f(roof, '8.2f'):>8} "
              f"{str(r.get('async_scheduling', '-')):>9} {str(r.get('engine_core_process', '-')):>9}")


def main() -> None:
    if serve_worker(lambda spec: (worker_sglang if spec.get("engine") == "sglang" else worker)(spec)):
        return
    ap = bench_parser(__doc__, PRESETS, "7b,14b,32b,30b-a3b (dummy weights), tiny, default (embedded model)")
    ap.add_argument("--configs", help="bf16,fp8,int8,<yaml>; NAME+kv adds an FP8 KV cache")
    ap.add_argument("--prompts", type=int)
    ap.add_argument("--samples", type=int, help="samples per prompt (GRPO group size)")
    ap.add_argument("--prompt-len", help="tokens per prompt: N, or LO-HI drawn per prompt (the same for every config)")
    ap.add_argument("--max-len", type=int, help="cap of the output length distribution")
    ap.add_argument("--first-max-len", type=int, default=None,
                    help="cap of the output lengths of the rollout before the sync (default: --max-len; "
                         "a short one saves device time: the step is timed on the rollout after the sync)")
    ap.add_argument("--fixed-len", action="store_true",
                    help="every sample exactly --max-len tokens (with --prompts 1 --samples 1: the tail's floor)")
    ap.add_argument("--no-logprobs", action="store_true",
                    help="no sampling logprobs (what returning them costs; TIS needs them)")
    ap.add_argument("--stats", action="store_true",
                    help="vLLM's stat logging on; each rollout reports how many requests were preempted")
    ap.add_argument("--unseeded", action="store_true",
                    help="no per-request sampling seed (verl and TRL set none; the default seeds every request)")
    ap.add_argument("--step-bands", action="store_true",
                    help="time the rollout after the sync by how many requests are unfinished (step_bands.py)")
    ap.add_argument("--engine", choices=["vllm", "sglang"], default="vllm",
                    help="sglang (GPU, SGLang 0.5.17): its offline Engine, the sync as flattened BF16 buckets")
    ap.add_argument("--attention-backend",
                    help="the engine's attention backend (vLLM: FLASH_ATTN, FLASHINFER, ...; default its own choice; "
                         "SGLang: triton unless set)")
    ap.add_argument("--page-size", type=int, help="SGLang's page_size: KV slots per page (default: the runtime's 16 "
                    "for an FP8 cache on fa3, else SGLang's 1)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (GPUs) per engine (vLLM's "
                    "tensor_parallel_size, SGLang's tp_size); the sync's time is its slowest rank's")
    output_args(ap)
    a = ap.parse_args()
    import torch

    if error := page_size_error(a.engine, a.page_size):
        sys.exit(f"rl_step: {error}")
    opts, util, work = preset_options(a, PRESETS, gpu_util=0.85)
    lengths = output_lengths(opts["prompts"] * opts["samples"], opts["max_len"], fixed=a.fixed_len)
    try:
        plens = prompt_lengths(opts["prompts"], opts["prompt_len"])
    except ValueError as e:
        sys.exit(f"rl_step: {e}")
    rows = []
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    for shape in opts["shapes"].split(","):
        path, dummy = model_dir(shape, work)
        for config in opts["configs"].split(","):
            spec = {"model": str(path), "dummy": dummy, "prompts": opts["prompts"], "samples": opts["samples"],
                    "prompt_lens": plens, "max_len": opts["max_len"], "gpu_memory_utilization": util,
                    "first_max_len": a.first_max_len, "fixed_len": a.fixed_len, "stats": a.stats,
                    "logprobs": not a.no_logprobs, "seeded": not a.unseeded, "engine": a.engine,
                    "attention_backend": a.attention_backend, "step_bands": a.step_bands,
                    "page_size": a.page_size, "tp": a.tp}
            # issue 74's goal 5: each row carries its device and its share of the GPU
            r = {"shape": shape, "config": config, "tensor_parallel_size": a.tp, "device": device,
                 "gpu_memory_utilization": util, **run_one(spec, config)}
            if "error" not in r:  # issue 74's goal 5: the rollout's fraction of its least bytes at the peak bandwidth
                hf_config = json.loads((Path(path) / "config.json").read_text())
                r["roofline"] = roofline(hf_config, config, [plens[i // opts["samples"]] for i in range(len(lengths))],
                                         lengths, device, r["rollout_2"]["rollout_s"], gpus=a.tp,
                                         bands=r["rollout_2"].get("bands"))
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if not k.startswith("rollout_")}), flush=True)
    add_ratios(rows)
    import importlib

    version = importlib.import_module(a.engine).__version__
    engine = f"{'SGLang' if a.engine == 'sglang' else 'vLLM'} {version}"
    print_table(rows, f"RL step on {device}, {engine}: {opts['prompts']} prompts x {opts['samples']} "
                      f"samples, {opts['prompt_len']} tokens in, out {min(lengths)}..{max(lengths)} "
                      f"(mean {sum(lengths) / len(lengths):.0f}, cap {opts['max_len']}), T=1"
                      f"{'' if a.no_logprobs else ' + logprobs'}{', unseeded' if a.unseeded else ''}; "
                      f"step = rollout after the sync + full sync")
    print_bands(rows)
    if a.json:
        from flashrl_tools.fsutil import atomic_write_text

        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(a.json), json.dumps({
            "device": device, a.engine: version, "date": time.strftime("%Y-%m-%d"),
            "settings": {**opts, "logprobs": not a.no_logprobs, "seeded": not a.unseeded, "engine": a.engine,
                         "step_bands": a.step_bands, "tensor_parallel_size": a.tp},
            "gpu_memory_utilization": util, "output_lengths": {"count": len(lengths), "mean": sum(lengths) / len(lengths),
                                                               "max": max(lengths), "total": sum(lengths)},
            "rows": rows}, indent=1))
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
