"""SGLang's general plugin (entry point group `sglang.srt.plugins` -> `flashrl_tools.runtime.sglang.plugin:register`):
runs in the engine, the server launcher and every scheduler (TP rank) process."""

from __future__ import annotations


def register(registry=None, hook_type=None) -> None:
    """With FLASHRL_CONFIG set, register the adapter's hooks with SGLang's HookRegistry (adapter.py)."""
    from flashrl_tools.runtime.sglang.adapter import register as register_hooks

    register_hooks(registry, hook_type)
