"""The zygote process of verify/zygote.py: `python -m flashrl_tools.verify.zygote_server SOCKET`.

It imports vLLM, runs the CPU probes of inductor that an engine's first logprobs would (`_probe_once`) and freezes
its heap, then forks a child per connection to SOCKET: a job (`zygote.run`: its
session, directory, environment, streams and argv) or a process a job started with multiprocessing's spawn
(zygote_spawn). It reports each child's pid, then its exit code; kills a child whose client went away; and exits
when its owner closes its stdin.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading

from flashrl_tools.verify import zygote_spawn
from flashrl_tools.verify.zygote_spawn import signature


def _child(req: dict, host: tuple[str, tuple, tuple]) -> int:
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


def _mp_child(req: dict, fds: list[int], host: tuple[str, tuple, tuple]) -> int:
    """In the forked child: a process the job started with multiprocessing's spawn (zygote_spawn)."""
    _as_host(host)
    return zygote_spawn.child(req, fds)


def _as_host(host: tuple[str, tuple, tuple]) -> None:
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
    then its exit code; kill a job whose client went away; exit when stdin closes. Its READY line carries its
    environment's signature after the import (which changes this process's environment: RAY_CLIENT_MODE, ...)."""
    import gc

    path = sys.argv[1]
    before = signature(dict(os.environ))
    import vllm.entrypoints.llm  # noqa: F401 -- the import every job would pay

    _probe_once()
    host = (path, before, signature(dict(os.environ)))

    gc.collect()
    gc.freeze()  # the imported modules' objects: a job's collections (vLLM's engine start runs eight) skip them
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    jobs: dict[int, socket.socket] = {}  # pid -> its client's connection
    gone: set[int] = set()  # jobs whose client went away (killed, not reaped yet)
    print("READY", json.dumps(host[2]), flush=True)
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


def _probe_once() -> None:
    """What every engine job's first logprobs would work out again: vLLM's sampler ranks a token's logprob with a
    torch.compile'd op, whose first call in a process has inductor probe the CPU's vector ISAs (a compile and a
    Python subprocess per ISA) and hash Triton's sources (both cached per process; no torch work, no threads).
    Measured on one CPU core: SmolLM2's first observe 2.9 s -> 1.2 s; tests/test_verify.py 68 -> 61 CPU-seconds."""
    try:
        from torch._inductor import codecache, cpu_vec_isa

        cpu_vec_isa.valid_vec_isa_list()
        codecache.triton_key()
    except Exception:  # (then each job does it, as without the zygote)
        pass


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


if __name__ == "__main__":
    main()
