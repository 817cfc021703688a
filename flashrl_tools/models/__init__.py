"""Models without a hub: the embedded default (SmolLM2-135M-Instruct) and tiny random ones."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

DEFAULT_NAME = "default"


def resolve_model(name: str | Path, step: Callable[[str], None] = lambda s: None) -> Path:
    """A model argument as a directory: 'default' is the embedded model, built on first use."""
    if str(name) == DEFAULT_NAME:
        from flashrl_tools.models.default import ensure_default_model

        return ensure_default_model(step=step)
    return Path(name)
