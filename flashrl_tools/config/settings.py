"""Where the toolkit keeps its files, and how a FLASHRL_* switch is read."""

from __future__ import annotations

import os
from pathlib import Path


def flashrl_home() -> Path:
    """$FLASHRL_HOME (default ~/.cache/flashrl): the default model, online-quantized checkpoints,
    configs fetched from the Hub."""
    return Path(os.environ.get("FLASHRL_HOME", Path.home() / ".cache" / "flashrl")).expanduser()


def env_flag(name: str) -> bool:
    """A boolean FLASHRL_* switch: unset, empty, 0, false, no and off are off."""
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no", "off")
