"""The runtime: with FLASHRL_CONFIG set, every vLLM process of the run serves the 8-bit policy and
keeps it in sync with the trainer's BF16 weights. Activated by vLLM's plugin mechanism
(entry point `vllm.general_plugins` -> `flashrl_tools.runtime.plugin:register`), or explicitly
with `apply()`. Importing this package changes nothing."""

from __future__ import annotations

from flashrl_tools.config.resolve import RuntimeConfig, from_env, resolve


def apply(config: str | RuntimeConfig | None = None) -> RuntimeConfig | None:
    """Install the runtime hooks for `config` (default: FLASHRL_CONFIG). Returns the active
    config, or None when FLASHRL_CONFIG is unset (vLLM left untouched)."""
    from flashrl_tools.runtime.logs import configure_logging
    from flashrl_tools.runtime.vllm import install

    rc = resolve(config) if isinstance(config, str) else (config or from_env())
    if rc is None:
        return None
    configure_logging()
    install(rc)
    return rc


__all__ = ["RuntimeConfig", "apply", "from_env", "resolve"]
