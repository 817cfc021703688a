"""Shared fixtures: real artifacts (the embedded model, tiny checkpoints), built once per session."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


def run_cli(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `flashrl ARGS` as a user would (its own process, real exit code and streams)."""
    import os

    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "flashrl_tools", *map(str, args)],
                          capture_output=True, text=True, env=full_env, timeout=timeout)


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The BF16 SmolLM2-135M-Instruct checkpoint (built from the GGUF on first use)."""
    from flashrl_tools.models.default import ensure_default_model

    return ensure_default_model()


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
