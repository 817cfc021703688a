"""This engine process's runtime state, for every engine: the config its hooks serve (or why it could not be
read: raised where the engine does not swallow it), and the sync sessions and FP8 KV states of the models
it loaded (for an entry point that has no model object at hand: SGLang's scheduler)."""

from __future__ import annotations

from flashrl_tools.config.resolve import RuntimeConfig
from flashrl_tools.errors import FlashRLError

_state: dict = {}


def serve(rc: RuntimeConfig | None, error: FlashRLError | None = None) -> None:
    _state.clear()
    _state.update(rc=rc, error=error, sessions=[], kvs=[])


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
