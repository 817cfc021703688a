"""What this SGLang process keeps beside the core's process state (core/process.py): the environment the
plugin read (SGLang loads plugins once per process: an engine started after FLASHRL_CONFIG /
FLASHRL_KV_CACHE_DTYPE changed is refused)."""

from __future__ import annotations

import os

_state: dict = {}


def env() -> tuple:
    return tuple(os.environ.get(k) or None for k in ("FLASHRL_CONFIG", "FLASHRL_KV_CACHE_DTYPE"))


def remember_env() -> None:
    _state["env"] = env()


def check_env() -> None:
    if env() != _state.get("env"):
        raise RuntimeError(f"flashrl: FLASHRL_CONFIG / FLASHRL_KV_CACHE_DTYPE are {env()} for this SGLang engine "
                           f"but were {_state.get('env')} when SGLang loaded its plugins in this process (once per "
                           "process); start each engine with another config in its own process")


def reset() -> None:
    _state.clear()
