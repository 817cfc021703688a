"""FLASHRL_LOGGING_LEVEL / FLASHRL_LOGGING_FILE (flash-llm-rl meanings), set up only when the
runtime is applied, never on import."""

from __future__ import annotations

import logging
import os

_configured = False


def configure_logging() -> logging.Logger:
    global _configured
    logger = logging.getLogger("flashrl_tools")
    if _configured:
        return logger
    _configured = True
    level = os.environ.get("FLASHRL_LOGGING_LEVEL", "INFO").upper()
    logger.setLevel(getattr(logging, level, logging.INFO))
    path = os.environ.get("FLASHRL_LOGGING_FILE")
    handler = logging.FileHandler(path) if path else logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[flashrl pid={os.getpid()}] %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    return logger
