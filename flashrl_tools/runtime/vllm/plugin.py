"""vLLM's general plugin (entry point `vllm.general_plugins` -> `flashrl_tools.runtime.vllm.plugin:register`):
runs in every vLLM process (front end, engine core, workers, Ray actors)."""

from __future__ import annotations


def register() -> None:
    """Apply FLASHRL_CONFIG. An invalid value raises, so the engine refuses to start instead of
    silently running in BF16 when 8 bits were asked for."""
    from flashrl_tools.errors import FlashRLError
    from flashrl_tools.runtime import apply

    try:
        apply()
    except FlashRLError as e:
        raise RuntimeError(f"flashrl: {e.message}") from None
