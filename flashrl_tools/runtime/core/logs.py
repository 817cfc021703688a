"""FLASHRL_LOGGING_LEVEL / FLASHRL_LOGGING_FILE (flash-llm-rl meanings), set up only when the
runtime is applied, never on import."""

from __future__ import annotations

import logging
import os
from pathlib import Path

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
    if s.debug_stacks:
        watch_stacks(Path(s.debug_stacks))
    return logger


def watch_stacks(directory: Path) -> None:
    """FLASHRL_DEBUG_STACKS=DIR: SIGUSR1 makes this process print every thread's Python stack (to stderr: where a
    stalled engine waits), and DIR/PID says so -- a process without the handler would die of the signal."""
    import faulthandler
    import signal
    import sys

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / str(os.getpid())).write_text(" ".join(sys.argv)[:500])


def signal_stacks(directory: Path) -> list[int]:
    """Every live process listed in `directory` prints its stacks (SIGUSR1), and this one too: the PIDs signalled."""
    import faulthandler
    import signal
    import sys

    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    done = []
    for entry in sorted(directory.iterdir()) if directory.is_dir() else []:
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                os.kill(int(entry.name), signal.SIGUSR1)
                done.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                pass
    return done
