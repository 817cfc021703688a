"""This engine process's runtime state, the one registry for every engine: the config its hooks serve (or why it
could not be read: raised where the engine does not swallow it), the environment the plugin read it from, and
the sync sessions and FP8 KV states of the models it loaded (for an entry point that has no model object at
hand: SGLang's scheduler)."""

from __future__ import annotations

import os

from flashrl_tools.config.resolve import RuntimeConfig
from flashrl_tools.errors import FlashRLError

_state: dict = {}
ENV = ("FLASHRL_CONFIG", "FLASHRL_KV_CACHE_DTYPE")  # what the plugin reads the config from


def _env() -> tuple:
    return tuple(os.environ.get(k) or None for k in ENV)


def serve(rc: RuntimeConfig | None, error: FlashRLError | None = None) -> None:
    _state.clear()
    _state.update(rc=rc, error=error, sessions=[], kvs=[], env=_env())


def check_env(engine: str) -> None:
    """For an engine that loads its plugins once per process (SGLang): an engine started after FLASHRL_CONFIG /
    FLASHRL_KV_CACHE_DTYPE changed would be served the config read at load; refused in one line."""
    if "env" in _state and _env() != _state["env"]:
        raise RuntimeError(f"flashrl: FLASHRL_CONFIG / FLASHRL_KV_CACHE_DTYPE are {_env()} for this {engine} engine "
                           f"but were {_state['env']} when {engine} loaded its plugins in this process (once per "
                           "process); start each engine with another config in its own process")


def config() -> RuntimeConfig | None:
    """The config this process serves (None: the engine is left alone)."""
    if _state.get("error") is not None:
        raise RuntimeError(f"flashrl: {_state['error'].message}")
    return _state.get("rc")


def sessions() -> list:
    return _state.setdefault("sessions", [])


def kv_states() -> list:
    return _state.setdefault("kvs", [])


def reset() -> None:
    _state.clear()
