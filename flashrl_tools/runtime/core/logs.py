"""FLASHRL_LOGGING_LEVEL / FLASHRL_LOGGING_FILE (flash-llm-rl meanings), set up only when the
runtime is applied, never on import."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from flashrl_tools.config.settings import settings

_configured = False
_watching = False  # FLASHRL_DEBUG_STACKS was set when logging was configured (stall_watch runs per batch: no env read)


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
        global _watching
        _watching = True
        watch_stacks(Path(s.debug_stacks))
    return logger


_stack_file = None  # FLASHRL_DEBUG_STACKS: this process's DIR/PID.stacks (kept open: faulthandler writes to its fd)


def stacks_file(directory: Path, pid: int | None = None) -> Path:
    """Where process `pid` (default: this one) writes its stack dumps under FLASHRL_DEBUG_STACKS=DIR."""
    return directory / f"{pid or os.getpid()}.stacks"


def watch_stacks(directory: Path) -> None:
    """FLASHRL_DEBUG_STACKS=DIR: SIGUSR1 makes this process write every thread's Python stack to DIR/PID.stacks
    (where a stalled engine waits), and DIR/PID says so -- a process without the handler would die of the signal.
    A file, not stderr: an engine blocked writing to a full stderr pipe would block its dump there too."""
    import faulthandler
    import signal
    import sys

    global _stack_file
    directory.mkdir(parents=True, exist_ok=True)
    _stack_file = open(stacks_file(directory), "a")  # noqa: SIM115 (open for the process's life)
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)
    (directory / str(os.getpid())).write_text(" ".join(sys.argv)[:500])


_steps: dict = {}  # FLASHRL_STEP_LOG: "file", this process's open log (None: off), resolved on the first step


def stepping() -> bool:
    """Whether this process logs its steps (FLASHRL_STEP_LOG, resolved once; then a dictionary lookup)."""
    if "file" not in _steps:
        path = settings().step_log
        _steps["file"] = open(Path(path).expanduser(), "a", buffering=1) if path else None  # noqa: SIM115 (line-buffered, process life)
    return _steps["file"] is not None


def step_line(mode: str, requests: int, unfinished: int) -> None:
    """FLASHRL_STEP_LOG=PATH: one line per model step of this process, appended when its result was processed --
    monotonic seconds (the clock every process of a host shares), the step's kind (d decode, e extend, o other), its
    requests, the requests unfinished -- for `benchmarks/step_bands.py` (an engine whose steps run in another process
    than the caller's)."""
    if stepping():
        import time

        _steps["file"].write(f"{time.monotonic():.6f} {mode} {requests} {unfinished}\n")


STALL_S = 30.0  # FLASHRL_DEBUG_STACKS: an engine process that made no progress this long prints its stacks


def stall_watch(seconds: float = STALL_S) -> None:
    """FLASHRL_DEBUG_STACKS: (re-)arm a dump of every thread's stack `seconds` from now (to DIR/PID.stacks);
    called again before then (the engine made progress), the dump moves on. faulthandler's own watchdog thread
    writes it, without the GIL and without a signal: the SGLang scheduler that stood still after an fa3 + FP8 KV
    update (issue 42) printed nothing on SIGUSR1. An idle engine writes one dump too (debugging only)."""
    if _watching and _stack_file is not None:
        import faulthandler

        faulthandler.dump_traceback_later(seconds, repeat=False, file=_stack_file)


def task_states(pid: int) -> list[str]:
    """Each thread of `pid`: its state (R running, S sleeping, D uninterruptible: waiting in the kernel, e.g. a
    driver call) and kernel wait channel, from /proc -- where a process that handles no signal waits."""
    lines = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            stat = (task / "stat").read_text()
            state = stat[stat.rindex(")") + 2:].split()[0]
            wchan = (task / "wchan").read_text().strip() or "-"
            name = (task / "comm").read_text().strip()
        except (OSError, ValueError, IndexError):
            continue
        lines.append(f"pid {pid} tid {task.name} {name}: state {state} wchan {wchan}")
    return lines


def signal_stacks(directory: Path) -> list[int]:
    """Every live process listed in `directory` writes its stacks (SIGUSR1) to DIR/PID.stacks, this one too, and
    each one's threads' kernel states go to DIR/PID.states (and stderr): the PIDs signalled."""
    import faulthandler
    import signal
    import sys

    directory.mkdir(parents=True, exist_ok=True)
    with open(stacks_file(directory), "a") as own:
        faulthandler.dump_traceback(file=own, all_threads=True)
    done = []
    for entry in sorted(directory.iterdir()):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                os.kill(int(entry.name), signal.SIGUSR1)
                done.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                continue
            states = task_states(int(entry.name))
            with open(directory / f"{entry.name}.states", "a") as out:
                out.writelines(line + "\n" for line in states)
            for line in states:
                print(f"[flashrl stacks] {line}", file=sys.stderr, flush=True)
    return done
