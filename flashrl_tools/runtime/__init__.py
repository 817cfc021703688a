"""The runtime: with FLASHRL_CONFIG set, every engine process of the run serves the 8-bit policy and
keeps it in sync with the trainer's BF16 weights. `core/` is everything engine-neutral (the sync
session, conversion, the serving plan, FP8 KV calibration, admission, settings); `vllm/` and `sglang/`
are the two adapters, activated by each engine's plugin entry point, or for vLLM explicitly with
`apply()`. Importing this package changes nothing."""

from __future__ import annotations

from flashrl_tools.config.resolve import RuntimeConfig, from_env, resolve
from flashrl_tools.runtime.engines import engine_capabilities


def apply(config: str | RuntimeConfig | None = None) -> RuntimeConfig | None:
    """Install the vLLM runtime hooks for `config` (default: FLASHRL_CONFIG). Returns the active
    config, or None when FLASHRL_CONFIG is unset (then only the `always` hooks: vLLM-CPU's INT8 linears
    computed exactly where its oneDNN GEMM saturates, runtime/vllm/cpu_int8.py)."""
    from flashrl_tools.runtime.core.logs import configure_logging
    from flashrl_tools.runtime.vllm.adapter import install, install_always

    rc = resolve(config) if isinstance(config, str) else (config or from_env())
    if rc is None:
        install_always()
        return None
    configure_logging()
    install(rc)
    return rc


__all__ = ["RuntimeConfig", "apply", "engine_capabilities", "from_env", "resolve"]
