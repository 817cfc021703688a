"""A continuous rollout stream with periodic in-flight weight updates, as asynchronous RL trainers run it
(PipelineRL, prime-rl, verl's fully-async): vLLM's AsyncLLM keeps `--concurrency` requests in flight (a
finished one is replaced at once: prompts of `--prompt-len` random tokens, output lengths long-tailed up
to `--max-len`, T=1 with logprobs), and every `--every` seconds the trainer pauses in keep mode
(`clear_cache=False`: kept requests keep their KV), pushes a full set of BF16 weights through
`model.load_weights` one tensor per call (the runtime re-quantizes them), and resumes.

SGLang (`--engine sglang`): `pause_generation(mode="in_place")` (its keep mode), the push as flattened buckets
through `update_weights_from_tensor`, `continue_generation`; with an FP8 KV cache the schedulers set the
requests kept in place aside for the calibration at the continue and rescale their entries (no drain; SGLang's
kernels take the scales as floats, so the decode CUDA graphs are captured again when they change).

Per config (each in a fresh process; `+kv`: FP8 KV cache, recalibrated at every resume with the kept
requests set aside): output tokens/s over the run, and per update the pause, push and resume times and
the bubble -- the longest stretch around the update in which no request got a token -- and the tokens
still in flight when the first token after the resume arrived (0 would mean a drain). Prints a table,
writes JSON. Same prompts and lengths for every config.

    python benchmarks/async_stream.py --shapes 7b --configs bf16,int8,int8+kv \
        --json benchmarks/results/inflight/async_stream_7b.json
    python benchmarks/async_stream.py --engine sglang --shapes 7b --configs bf16,int8,int8+kv   # SGLang 0.5.17 (GPU)
    python benchmarks/async_stream.py --preset smoke     # CPU, config-only tiny shape (CI)
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import bench_parser, config_env, output_args, preset_options, run_worker, serve_worker, sglang_engine  # noqa: E402
from rl_step import output_lengths  # noqa: E402
from shapes import model_dir  # noqa: E402
from weight_sync import sync_in_worker  # noqa: E402

PRESETS = {
    "gpu": dict(shapes="7b", configs="bf16,int8,int8+kv", concurrency=128, prompt_len=512, max_len=2048,
                seconds=60.0, every=15.0),
    "cpu": dict(shapes="default", configs="bf16,int8", concurrency=4, prompt_len=32, max_len=64, seconds=20.0,
                every=6.0),
    "smoke": dict(shapes="tiny", configs="bf16,int8", concurrency=3, prompt_len=16, max_len=24, seconds=6.0,
                  every=2.5),
}


async def stream(spec: dict) -> dict:
    """vLLM's AsyncLLM: keep-mode pause (`clear_cache=False`), a full BF16 push one tensor per `load_weights`."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    import torch

    gpu = torch.cuda.is_available()
    t0 = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=spec["model"], load_format="dummy" if spec["dummy"] else "auto", skip_tokenizer_init=True,
        dtype="bfloat16", max_model_len=spec["prompt_len"] + spec["max_len"] + 8, seed=0,
        gpu_memory_utilization=spec["gpu_memory_utilization"], enforce_eager=not gpu, enable_prefix_caching=True))
    start_s = time.perf_counter() - t0
    config = engine.vllm_config
    sync = sync_in_worker(spec["model"], native=False, repeats=1)

    async def generate(i: int, ids: list[int], n: int):
        params = SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, logprobs=0, seed=i, detokenize=False)
        async for out in engine.generate({"prompt_token_ids": ids}, params, str(i)):
            yield len(out.outputs[0].token_ids)

    async def push() -> dict:
        (pushed,) = (await engine.collective_rpc(sync))[0]
        return {"push_sync_s": pushed["sync_s"]}

    try:
        out = await run_stream(spec, generate, lambda: engine.pause_generation(mode="keep", clear_cache=False), push,
                               engine.resume_generation)
    finally:
        engine.shutdown()
    return {"start_s": start_s, **out, "pause_mode": "keep (clear_cache=False)",
            "async_scheduling": bool(getattr(config.scheduler_config, "async_scheduling", False)),
            "kv_cache_dtype": config.cache_config.cache_dtype}


def stream_sglang(spec: dict) -> dict:
    """SGLang's offline Engine (its TokenizerManager, as its server drives it): `pause_generation("in_place")`
    (requests keep their KV, SGLang's keep mode), a full BF16 push as flattened buckets of random weights through
    `update_weights_from_tensor` (only the calls timed), `continue_generation`."""
    t0 = time.perf_counter()
    engine = sglang_engine(spec, spec["prompt_len"] + spec["max_len"] + 8,
                           **({"disable_overlap_schedule": True} if spec.get("no_overlap") else {}))
    start_s = time.perf_counter() - t0
    tm = engine.tokenizer_manager

    async def generate(i: int, ids: list[int], n: int):
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(input_ids=ids, rid=str(i), stream=True, return_logprob=True,
                               sampling_params={"temperature": 1.0, "max_new_tokens": n, "ignore_eos": True,
                                                "sampling_seed": i})
        async for out in tm.generate_request(obj, None):
            yield len(out["output_ids"])

    async def pause():
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        await tm.pause_generation(PauseGenerationReqInput(mode="in_place"))

    async def resume():
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        await tm.continue_generation(ContinueGenerationReqInput())

    async def push() -> dict:
        return await sglang_push(engine, spec["model"], spec.get("bucket_mb", 512))

    try:
        out = engine.loop.run_until_complete(run_stream(spec, generate, pause, push, resume))
        kv = str(engine.server_args.kv_cache_dtype)
    finally:
        engine.shutdown()
    return {"start_s": start_s, **out, "pause_mode": "in_place", "async_scheduling": None, "kv_cache_dtype": kv,
            "overlap_schedule": not spec.get("no_overlap"),
            "attention_backend": spec.get("attention_backend") or "triton"}


async def sglang_push(engine, model_path: str, bucket_mb: int) -> dict:
    """Random BF16 weights of the policy's names and shapes as flattened buckets made on the GPU, through the
    TokenizerManager's `update_weights_from_tensor` (the engine is paused: straight to the schedulers)."""
    import torch
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

    from rollout_throughput import bucket_groups

    from flashrl_tools.verify.sglang_job import bucket_payload

    gen = torch.Generator(device="cuda").manual_seed(0)
    seconds = 0.0
    for group in bucket_groups(model_path, bucket_mb):
        tensors = [(n, torch.randn(s, generator=gen, device="cuda", dtype=torch.bfloat16).mul_(0.02)) for n, s in group]
        payload = bucket_payload(tensors)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ok, message = (await engine.tokenizer_manager.update_weights_from_tensor(UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[payload] * engine.server_args.tp_size, load_format="flattened_bucket",
            flush_cache=True), None))[:2]
        seconds += time.perf_counter() - t0
        if not ok:
            raise RuntimeError(f"SGLang refused a weight update: {message}")
        del tensors, payload
    return {"push_sync_s": seconds}


def dump_stacks() -> list[int]:
    """--stall-dump: every engine process's Python stacks into FLASHRL_DEBUG_STACKS's directory (DIR/PID.stacks)."""
    from flashrl_tools.config.settings import settings
    from flashrl_tools.runtime.core.logs import signal_stacks

    return signal_stacks(Path(settings().debug_stacks))


async def run_stream(spec: dict, generate, pause, push, resume) -> dict:
    """`--concurrency` lanes of requests (a finished one replaced at once), an update every `--every` s:
    `pause()`, `push()`, `resume()`; per update the times, the bubble, the first token after the resume and
    the tokens still in flight then."""
    vocab = min(1000, json.loads((Path(spec["model"]) / "config.json").read_text())["vocab_size"])
    lengths = output_lengths(100_000, spec["max_len"], seed=1)
    stamps: list[float] = []  # one per streamed output (every request's every token, async scheduling: chunks)
    counts = {"tokens": 0, "done": 0}
    left: dict[str, int] = {}
    stop = asyncio.Event()

    async def one(i: int) -> None:
        rng = random.Random(i)  # request i: the same prompt and length in every config
        ids = [rng.randrange(10, vocab) for _ in range(spec["prompt_len"])]
        total, seen = lengths[i % len(lengths)], 0
        left[str(i)] = total
        async for n in generate(i, ids, total):
            if n > seen:
                stamps.append(time.perf_counter())
                counts["tokens"] += n - seen
                seen = n
                left[str(i)] = total - n
        left.pop(str(i), None)
        counts["done"] += 1

    async def lane(first: int) -> None:
        i = first
        while not stop.is_set():
            await one(i)
            i += spec["concurrency"]

    await one(10**6)  # warm-up (and, with an FP8 KV cache, the first calibration)
    stamps.clear()
    counts.update(tokens=0, done=0)
    begin = time.perf_counter()
    lanes = [asyncio.create_task(lane(k)) for k in range(spec["concurrency"])]
    updates = []
    while time.perf_counter() - begin + spec["every"] < spec["seconds"]:
        await asyncio.sleep(spec["every"])
        u = {"t": time.perf_counter() - begin}
        t = time.perf_counter()
        await pause()
        u["pause_s"] = time.perf_counter() - t
        t = time.perf_counter()
        u.update(await push())
        u["push_s"] = time.perf_counter() - t
        t = time.perf_counter()
        await resume()
        resumed = time.perf_counter()
        u["resume_s"] = resumed - t
        n = len(stamps)
        while len(stamps) == n:
            await asyncio.sleep(0.0005)
            if spec.get("stall_dump") and "stall_dump_pids" not in u and time.perf_counter() - resumed > spec["stall_dump"]:
                u["stall_dump_pids"] = dump_stacks()  # no token yet: where every engine process waits
        u["first_token_after_resume_s"] = stamps[n] - resumed
        u["tokens_in_flight_at_first_token"] = sum(left.values())
        updates.append(u)
    stop.set()
    elapsed = time.perf_counter() - begin
    tokens = counts["tokens"]
    for task in lanes:
        task.cancel()
    await asyncio.gather(*lanes, return_exceptions=True)
    for u in updates:  # the longest gap between streamed tokens around each update
        at = begin + u["t"]
        window = [s for s in stamps if at - 0.5 <= s <= at + u["pause_s"] + u["push_s"] + u["resume_s"] + 5.0]
        u["bubble_s"] = max((b - a for a, b in zip(window, window[1:])), default=None)
    return {"seconds": elapsed, "output_tokens": tokens, "output_tok_per_s": tokens / elapsed,
            "requests_done": counts["done"], "updates": updates}


def worker(spec: dict) -> dict:
    if spec.get("engine") == "sglang":
        return stream_sglang(spec)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    return asyncio.run(stream(spec))


def run_one(spec: dict, config: str) -> dict:
    env = config_env(config)
    if isinstance(env, str):
        return {"error": env}
    return run_worker(__file__, spec, env)


def summarize(r: dict) -> None:
    ups = r.get("updates") or []
    for key in ("bubble_s", "pause_s", "push_s", "resume_s", "first_token_after_resume_s"):
        vals = [u[key] for u in ups if u.get(key) is not None]
        r[f"mean_{key}"] = sum(vals) / len(vals) if vals else None
    r["min_tokens_in_flight_at_first_token"] = min((u["tokens_in_flight_at_first_token"] for u in ups), default=None)


def print_table(rows: list[dict], header: str) -> None:
    print(f"\n{header}")
    print(f"{'shape':8} {'config':9} {'tok/s':>9} {'vs bf16':>7} {'updates':>7} {'bubble s':>8} {'pause s':>7} "
          f"{'push s':>7} {'resume s':>8} {'1st tok s':>9} {'in flight':>9} {'async sch':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:8} {r['config']:9} ERROR {r['error']}")
            continue

        def f(v, fmt="8.3f"):
            return format(v, fmt) if v is not None else "-"

        print(f"{r['shape']:8} {r['config']:9} {r['output_tok_per_s']:9.1f} {f(r.get('tok_s_vs_bf16'), '7.2f'):>7} "
              f"{len(r['updates']):7d} {f(r['mean_bubble_s']):>8} {f(r['mean_pause_s'], '7.3f'):>7} "
              f"{f(r['mean_push_s'], '7.3f'):>7} {f(r['mean_resume_s']):>8} {f(r['mean_first_token_after_resume_s'], '9.3f'):>9} "
              f"{r['min_tokens_in_flight_at_first_token'] or 0:9d} {str(r['async_scheduling']):>9}")


def main() -> None:
    if serve_worker(worker):
        return
    ap = bench_parser(__doc__, PRESETS)
    ap.add_argument("--configs")
    ap.add_argument("--concurrency", type=int)
    ap.add_argument("--prompt-len", type=int)
    ap.add_argument("--max-len", type=int)
    ap.add_argument("--seconds", type=float, help="length of the stream")
    ap.add_argument("--every", type=float, help="seconds between weight updates")
    ap.add_argument("--engine", choices=["vllm", "sglang"], default="vllm",
                    help="sglang (GPU): its offline Engine, in_place pauses, flattened-bucket pushes")
    ap.add_argument("--attention-backend", default="triton",
                    help="SGLang's attention backend (fa3 reads the FP8 KV scales from tensors: no graph capture per update)")
    ap.add_argument("--stall-dump", type=float, default=None,
                    help="seconds without a token after a resume before every engine process's Python stacks are "
                         "written (needs FLASHRL_DEBUG_STACKS=DIR: DIR/PID.stacks, kernel states in DIR/PID.states)")
    ap.add_argument("--log-level", default="error",
                    help="SGLang's log level (info: its scheduler's decode-batch lines, to see where a stream waits; "
                         "the runtime's own log: FLASHRL_LOGGING_LEVEL=INFO)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="SGLang without its overlap scheduler (disable_overlap_schedule: each batch's result processed "
                         "before the next is launched)")
    output_args(ap)
    a = ap.parse_args()
    if a.no_overlap and a.engine != "sglang":
        sys.exit("async_stream: --no-overlap turns SGLang's overlap scheduler off; add --engine sglang")
    if a.stall_dump is not None and not os.environ.get("FLASHRL_DEBUG_STACKS"):
        sys.exit("async_stream: --stall-dump needs FLASHRL_DEBUG_STACKS=DIR (the engine processes list their PIDs there; "
                 "a process without the handler would die of the signal)")
    import torch

    opts, util, work = preset_options(a, PRESETS, gpu_util=0.85)
    rows = []
    for shape in opts["shapes"].split(","):
        path, dummy = model_dir(shape, work)
        for config in opts["configs"].split(","):
            spec = {"model": str(path), "dummy": dummy, "gpu_memory_utilization": util, "engine": a.engine,
                    "attention_backend": a.attention_backend, "log_level": a.log_level, "stall_dump": a.stall_dump,
                    "no_overlap": a.no_overlap,
                    **{k: opts[k] for k in ("concurrency", "prompt_len", "max_len", "seconds", "every")}}
            r = {"shape": shape, "config": config, **run_one(spec, config)}
            if "error" not in r:
                summarize(r)
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "updates"}), flush=True)
    for r in rows:
        base = next((b for b in rows if b["shape"] == r["shape"] and b["config"] == "bf16" and "error" not in b), None)
        if base is not None and "error" not in r:
            r["tok_s_vs_bf16"] = r["output_tok_per_s"] / base["output_tok_per_s"]
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    import importlib

    engine = f"{'SGLang' if a.engine == 'sglang' else 'vLLM'} {importlib.import_module(a.engine).__version__}"
    print_table(rows, f"Async stream on {device}, {engine}: {opts['concurrency']} requests in flight, "
                      f"{opts['prompt_len']} tokens in, up to {opts['max_len']} out, T=1 + logprobs; keep-mode "
                      f"update (pause, full BF16 push, resume) every {opts['every']} s for {opts['seconds']} s")
    if a.json:
        from flashrl_tools.fsutil import atomic_write_text

        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(a.json), json.dumps({"device": device, "engine": engine,
                                                    "date": time.strftime("%Y-%m-%d"), "settings": opts,
                                                    "gpu_memory_utilization": util, "rows": rows}, indent=1))
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
