"""FLASHRL_LOGGING_LEVEL / FLASHRL_LOGGING_FILE (flash-llm-rl meanings), set up only when the
runtime is applied, never on import."""

from __future__ import annotations

import logging
import os

from flashrl_tools.config.settings import settings

_configured = False


def configure_logging() -> logging.Logger:
    global _configured
    logger = logging.getLogger("flashrl_tools")
    if _configured:
        return logger
    _configured = True
    s = settings()
    logger.setLevel(getattr(logging, s.logging_level, logging.INFO))
    path = s.logging_file
    handler = logging.FileHandler(path) if path else logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[flashrl pid={os.getpid()}] %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    return logger
