"""GPU tests: every test under tests/gpu/ is marked `gpu` and skipped without CUDA, so the CPU suite
collects and skips them. On a GPU box: `python -m pytest tests/gpu` (README); FLASHRL_GPU_WORK keeps
the models and engine logs (default: a temp dir), FLASHRL_GPU_RESULTS where the results JSON go
(default benchmarks/results/gpu/), FLASHRL_GPU_JOBS how many engines run side by side (default 4)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    import torch

    skip = pytest.mark.skip(reason="needs a CUDA GPU (tests/gpu/)")
    for item in items:
        if Path(str(item.fspath)).resolve().parent == HERE:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_work() -> Path:
    work = Path(os.environ.get("FLASHRL_GPU_WORK") or tempfile.mkdtemp(prefix="flashrl-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    return work


@pytest.fixture(scope="session")
def gpu_jobs() -> int:
    return int(os.environ.get("FLASHRL_GPU_JOBS", "4"))
