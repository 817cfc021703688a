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
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        from flashrl_tools.errors import FlashRLError

        raise FlashRLError("model directory not found" if not path.is_dir() else "no config.json in the model "
                           "directory", str(path), "pass a directory holding config.json and *.safetensors, "
                           "or 'default'")
    return path
