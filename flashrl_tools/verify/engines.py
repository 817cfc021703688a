"""Run one engine job in a subprocess with a given FLASHRL_CONFIG: vLLM (verify/engine_job.py) or
SGLang (verify/sglang_job.py), the same request and result."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from flashrl_tools.config.settings import settings
from flashrl_tools.errors import FlashRLError
from flashrl_tools.verify import zygote


def run_engine(model: Path, steps: list[dict], config: str | None, label: str,
               fault: str | None = None, engine_kwargs: dict | None = None, timeout: float = 3600,
               kv_cache_dtype: str | None = None, engine: str = "vllm", env: dict | None = None,
               log: Path | None = None) -> list[dict]:
    """Start an engine on `model` with FLASHRL_CONFIG=`config` (None: unset) and
    FLASHRL_KV_CACHE_DTYPE=`kv_cache_dtype` (None: as the caller's environment), run `steps`,
    return their results. In-process engine (one process per engine job); `env`: more variables for it;
    `log`: where to keep the engine's output (its processes' stdout and stderr)."""
    job = engine_job(engine)
    env = {**{k: v for k, v in os.environ.items() if k != "FLASHRL_CONFIG"}, **(env or {})}
    if config is not None:
        env["FLASHRL_CONFIG"] = config
    if kv_cache_dtype is not None:
        env["FLASHRL_KV_CACHE_DTYPE"] = kv_cache_dtype
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engine_kwargs = {**(engine_kwargs or {}), **extra_engine_args()}
    with tempfile.TemporaryDirectory(prefix="flashrl-verify-") as tmp:
        req, out = Path(tmp) / "req.json", Path(tmp) / "out.json"
        req.write_text(json.dumps({"model": str(model), "steps": steps, "fault": fault,
                                   "engine_kwargs": engine_kwargs}))
        try:
            run = zygote.run if engine == "vllm" else zygote.spawn  # the zygote imported vLLM, not SGLang
            res = run(["-m", job, str(req), str(out)], env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise FlashRLError(f"the {label} engine did not finish within {timeout:.0f} s", str(model)) from None
        result = json.loads(out.read_text()) if out.is_file() else {}
    if log is not None:
        Path(log).write_text(res.stdout + res.stderr)
    if res.returncode != 0 or "steps" not in result:
        reason = result.get("error") or error_line(res.stderr) or f"exit code {res.returncode}"
        raise FlashRLError(f"the {label} engine failed: {reason}",
                           f"model {model}, FLASHRL_CONFIG={config or '(unset)'}",
                           "run with FLASHRL_LOGGING_LEVEL=DEBUG for the engine's log")
    return result["steps"]


ENGINES = {"vllm": "flashrl_tools.verify.engine_job", "sglang": "flashrl_tools.verify.sglang_job"}


def engine_job(engine: str) -> str:
    """The job module for `engine`; one clear error when it is unknown or not installed."""
    import importlib.util

    if engine not in ENGINES:
        raise FlashRLError(f"unknown engine {engine!r}", None, f"use one of: {', '.join(ENGINES)}")
    if importlib.util.find_spec(engine) is None:
        raise FlashRLError(f"{engine} is not installed in this environment", sys.executable,
                           "vllm: bash scripts/install.sh [gpu]; sglang (GPU only): pip install sglang==0.5.17, or "
                           "scripts/gpu_stage_sglang.sh for a host without network")
    return ENGINES[engine]


def extra_engine_args() -> dict:
    """FLASHRL_ENGINE_ARGS: a JSON object of extra vllm.LLM arguments for every engine the verify
    and tune commands start (e.g. '{"gpu_memory_utilization": 0.1}' on a GPU shared with others)."""
    raw = settings().engine_args
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise FlashRLError("FLASHRL_ENGINE_ARGS is not a JSON object", raw,
                           "set it to vllm.LLM arguments as JSON, e.g. "
                           '\'{"gpu_memory_utilization": 0.1}\', or unset it')
    return value


_RAISED = re.compile(r"^[\w.]*(Error|Exception|Interrupt|Exit)\b")


def error_line(stderr: str) -> str | None:
    """The first traceback's exception (the cause: the other ranks then fail on it, and the engine's crash report
    follows), else the last line naming an error."""
    traceback = False
    for line in stderr.splitlines():
        if line.rstrip().endswith("Traceback (most recent call last):"):
            traceback = True
        elif traceback and _RAISED.match(line):
            return line.strip()
    lines = [ln for ln in stderr.splitlines() if "Error" in ln or "error:" in ln]
    return lines[-1].strip() if lines else None
