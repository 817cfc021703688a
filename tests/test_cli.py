"""The `flashrl` entry point: help, versions."""

from __future__ import annotations

from conftest import run_cli


def test_help_lists_commands():
    res = run_cli("--help")
    assert res.returncode == 0
    for cmd in ("quantize", "models", "version"):
        assert cmd in res.stdout


def test_version_prints_stack_versions():
    import torch
    import transformers

    for args in (("version",), ("--version",)):
        res = run_cli(*args)
        assert res.returncode == 0, res.stderr
        lines = dict(line.split(" ", 1) for line in res.stdout.strip().splitlines())
        assert set(lines) == {"flashrl_tools", "torch", "vllm", "transformers", "compressed-tensors"}
        assert lines["torch"] == torch.__version__
        assert lines["transformers"] == transformers.__version__
        assert lines["vllm"] != "not installed"
