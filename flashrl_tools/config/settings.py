"""Every FLASHRL_* environment variable, read in one place: `settings()` returns them as one object
(read when called: a vLLM process's environment is fixed, tests change it between calls). The
README's environment-variable table lists the same names (tests/test_architecture.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# name -> (field, default)
VARIABLES: dict[str, tuple[str, str]] = {
    "FLASHRL_CONFIG": ("config", ""),
    "FLASHRL_CONFIG_INDEX": ("config_index", "0"),
    "FLASHRL_KV_CACHE_DTYPE": ("kv_cache_dtype", ""),
    "FLASHRL_LMHEAD_FP32": ("lmhead_fp32", "0"),
    "FLASHRL_INPLACE_SYNC": ("inplace_sync", "1"),
    "FLASHRL_HOME": ("home", ""),
    "FLASHRL_LOGGING_LEVEL": ("logging_level", "INFO"),
    "FLASHRL_LOGGING_FILE": ("logging_file", ""),
    "FLASHRL_TEST_RELOAD": ("test_reload", "0"),
    "FLASHRL_SYNC_DIGEST": ("sync_digest", ""),
    "FLASHRL_SYNC_TIMING": ("sync_timing", "0"),
    "FLASHRL_CODE_CHANGES": ("code_changes", "0"),
    "FLASHRL_DEBUG_STACKS": ("debug_stacks", ""),
    "FLASHRL_STEP_LOG": ("step_log", ""),
    "FLASHRL_TRITON": ("triton", "1"),
    "FLASHRL_DECODE_GEMM": ("decode_gemm", "auto"),
    "FLASHRL_FUSED_KV_STORE": ("fused_kv_store", "1"),
    "FLASHRL_DECODE_ATTN": ("decode_attn", "auto"),
    "FLASHRL_ALLOW_LEGACY_PICKLE": ("allow_legacy_pickle", "0"),
    "FLASHRL_ENGINE_ARGS": ("engine_args", ""),
    "FLASHRL_VERSION_CHECK": ("version_check", "1"),
    "FLASHRL_ZYGOTE": ("zygote", "1"),
}


def _flag(value: str) -> bool:
    """unset, empty, 0, false, no and off are off."""
    return value.strip().lower() not in ("", "0", "false", "no", "off")


def _switch(value: str, on: str, unset: str) -> str:
    """A variable that takes a value or a switch word: true / yes / on -> `on`, false / no / off -> "0",
    empty -> `unset`; anything else as written (checked where it is used)."""
    v = value.lower()
    return unset if v == "" else on if v in ("true", "yes", "on") else "0" if v in ("false", "no", "off") else v


@dataclass(frozen=True)
class Settings:
    config: str  # bf16 | fp8 | int8 | a YAML path | a Hub reference; "" leaves vLLM untouched
    config_index: str  # which entry of a multi-config YAML (validated where it is used)
    kv_cache_dtype: str  # "fp8" adds an FP8 KV cache to any config; "" / "auto": vLLM's default
    lmhead_fp32: bool
    inplace_sync: str  # "1" (default), "0" off, "tp" also for tensor-parallel layers (others refused at start)
    home: Path
    logging_level: str
    logging_file: str
    test_reload: bool
    sync_digest: str  # a directory: the engine's weight digest after every sync
    sync_timing: bool
    code_changes: bool  # per sync, the share of 4-bit codes it changed (runtime/core/code_changes.py)
    debug_stacks: str  # a directory: each engine process prints every thread's Python stack on SIGUSR1, its PID there
    step_log: str  # a file: SGLang's scheduler (TP rank 0) appends a line per model step (core/logs.py step_line)
    triton: bool  # the fused Triton INT8 quantizer on CUDA
    decode_gemm: str  # "N": vLLM's INT8 linears at <= N rows (1..64) through flashrl's Triton GEMM; "0" off;
    # "auto" (unset): 16 rows on Hopper (sm_90), off elsewhere (issue 45)
    fused_kv_store: bool  # SGLang, FP8 KV cache: fa3's decode stores K / V in one kernel (runtime/sglang/kv_store.py)
    decode_attn: str  # FP8 KV cache: decode batches' attention through flashrl's Triton kernel
    # (runtime/core/decode_attn.py): "1" on, "0" off, "auto" (unset): on Hopper (sm_90); "xqa": XQA's FP8 kernel
    # from 32 sequences up on Hopper (quant/kernels/xqa_decode.py), flashrl's below; "fp8qk": its FP8-score variant;
    # "lpt": a batch's sequences longest first; "balanced": its key tiles balanced over a fixed grid (<= 32 sequences)
    allow_legacy_pickle: bool
    engine_args: str  # JSON: extra engine arguments (vllm.LLM / sglang.Engine) for the engines `verify` starts
    version_check: bool  # an engine version not declared tested runs the start-up self-check (runtime/core/versions.py)
    zygote: bool  # CPU hosts: verify's / tune's engine jobs forked from a process that imported vLLM (verify/zygote.py)

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """`environ` (default: `os.environ` as it is now -- a library that replaces the mapping, not a stale one)."""
        environ = os.environ if environ is None else environ
        raw = {field: environ.get(name, default).strip() for name, (field, default) in VARIABLES.items()}
        flags = {"lmhead_fp32", "test_reload", "sync_timing", "code_changes", "triton", "allow_legacy_pickle", "fused_kv_store",
                 "version_check", "zygote"}
        values: dict = {k: _flag(v) if k in flags else v for k, v in raw.items()}
        values["inplace_sync"] = _switch(raw["inplace_sync"], on="1", unset="1")
        values["decode_gemm"] = _switch(raw["decode_gemm"], on="64", unset="auto")  # on: w8a8_gemm.MAX_ROWS rows
        values["decode_attn"] = _switch(raw["decode_attn"], on="1", unset="auto")
        values["logging_level"] = raw["logging_level"].upper()
        values["home"] = Path(raw["home"] or Path.home() / ".cache" / "flashrl").expanduser()
        return cls(**values)


def settings() -> Settings:
    return Settings.read()


def flashrl_home() -> Path:
    """$FLASHRL_HOME (default ~/.cache/flashrl): the default model, online-quantized checkpoints,
    configs fetched from the Hub."""
    return settings().home
