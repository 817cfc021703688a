"""Engine jobs forked from a process that imported vLLM once (a zygote), on CPU hosts.

Importing vLLM costs a job process ~15 s on two CPU cores, more than starting the engine on a small model (~8 s);
`verify reload` starts three engine jobs, `tune` one per verification. `run(argv, env, timeout)` behaves as
`subprocess.run([sys.executable, *argv], capture_output=True, text=True)`, but forks the job from a zygote: a child
of this process, started with the job's environment, that imported vLLM (and nothing of flashrl's: FLASHRL_* is
read in the job) and waits for jobs on its stdin. The job gets its own session, working directory, environment and
argv; its exit code, stdout and stderr come back as a subprocess's do.

Zygotes are kept per environment as far as an import may read it (all but FLASHRL_*, PYTEST_* and the vLLM switches
in LAZY; importing vLLM changes a process's own environment: LD_PRELOAD, thread counts), two at most: the first
environment's at once, another's at its second job. Other jobs, a second job while one runs (another thread), a
zygote that failed, or FLASHRL_ZYGOTE=0 start a plain subprocess. Off where CUDA is visible (not checked on a GPU
yet). The zygote does no torch work before it forks (OpenMP's threads do not survive a fork: DEVELOPERS "Torch CPU
work in a process that then forks").
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

LAZY = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION", "VLLM_CPU_OMP_THREADS_BIND",
        "VLLM_CPU_KVCACHE_SPACE")  # read when an engine starts, not at import (vLLM's logging level: not sure)


def _may_differ(key: str) -> bool:
    return key.startswith(("FLASHRL_", "PYTEST_")) or key in LAZY  # pytest names the running test in PYTEST_*


def signature(env: dict) -> tuple:
    """What of an environment a process's imports may read: all of it but FLASHRL_*, PYTEST_* and LAZY."""
    return tuple(sorted((k, v) for k, v in env.items() if not _may_differ(k)))


class Zygote:
    """A zygote started with the environment `env`: its children are what `python` started with `env` would be."""

    def __init__(self, env: dict) -> None:
        self.lock = threading.Lock()
        self.proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, bufsize=0, env=env)
        self.pending = b""
        self.ok = self._line(None) == "READY"

    def _line(self, timeout: float | None) -> str | None:
        """The zygote's next line; None on a timeout; "" once it has exited."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            if not select.select([fd], [], [], timeout)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return ""
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return line.decode().strip()

    def run(self, argv: list[str], env: dict, timeout: float | None, cwd: str) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="flashrl-job-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            req = {"argv": argv, "env": env, "cwd": cwd, "stdout": str(out), "stderr": str(err)}
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
            pid = json.loads(self._line(None))["pid"]
            line = self._line(timeout)
            timed_out = line is None
            if timed_out:  # the job's whole session: an engine's own worker processes too
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                line = self._line(None)
            rc = json.loads(line)["rc"]
            stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        args = [sys.executable, *argv]
        if timed_out:
            raise subprocess.TimeoutExpired(args, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(args, rc, stdout, stderr)


POOL = 2  # zygotes a process keeps; one that failed or died is not started again
_ZYGOTES: dict[tuple, Zygote | None] = {}
_SEEN: set[tuple] = set()


def enabled() -> bool:
    from flashrl_tools.config.settings import settings

    if not settings().zygote or not hasattr(os, "fork"):
        return False
    import torch

    return not torch.cuda.is_available()


def _zygote_for(env: dict) -> Zygote | None:
    key = signature(env)
    if key not in _ZYGOTES and (key in _SEEN or not _ZYGOTES) and len(_ZYGOTES) < POOL:
        _ZYGOTES[key] = Zygote(env)
    _SEEN.add(key)
    return _ZYGOTES.get(key)


def run(argv: list[str], env: dict | None = None, timeout: float | None = None,
        cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """`python ARGV` (a script, `-m module` or `-c code`), its output captured as text."""
    env = dict(os.environ if env is None else env)
    cwd = str(cwd or os.getcwd())
    z = _zygote_for(env) if enabled() else None
    if z is not None and z.ok and z.proc.poll() is None and z.lock.acquire(blocking=False):
        try:
            return z.run([str(a) for a in argv], env, timeout, cwd)
        except (OSError, ValueError, KeyError, TypeError):  # the zygote died under this job: a plain one instead
            z.ok = False
        finally:
            z.lock.release()
    return spawn(argv, env, timeout, cwd)


def spawn(argv: list[str], env: dict | None = None, timeout: float | None = None,
          cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """`python ARGV` in a process of its own (what `run` does without the zygote)."""
    return subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=cwd)


# -- the zygote -----------------------------------------------------------------------------------------

def _child(req: dict) -> None:
    """In the forked job: its session, directory, environment, streams and argv; then the job; never returns."""
    import atexit
    import runpy
    import traceback

    code = 1
    try:
        os.setsid()
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], os.O_WRONLY | os.O_CREAT),
                                (2, req["stderr"], os.O_WRONLY | os.O_CREAT)):
            os.dup2(os.open(path, flags, 0o644), fd)
        sys.stdin = open(os.devnull)
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
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:  # what the interpreter's own exit does: wait for the job's threads, run its exit handlers
            threading._shutdown()
            atexit._run_exitfuncs()
        except BaseException:
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    import vllm.entrypoints.llm  # noqa: F401 -- the import every job would pay

    print("READY", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(req)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
