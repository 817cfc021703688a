"""Every CLI command, given a missing input path or an output it cannot write: one line on stderr
(what, where, what to do), exit code 2, no traceback, nothing written -- and before any slow work."""

from __future__ import annotations

import pytest

from conftest import run_cli

NOPE = "/nonexistent/flashrl-input"
UNWRITABLE = "/proc/flashrl-out"  # not writable, even as root


def _one_line_error(res, *words) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr[-2000:]
    assert "Traceback" not in res.stderr + res.stdout
    for w in words:
        assert w in lines[0], lines[0]


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama-untied"]


def _cases(model, tmp):
    """command -> (args with a missing input, args with an unwritable output), each a full argv."""
    return {
        "quantize": (["quantize", "-m", NOPE, "-o", tmp / "q", "--fn", "int8"],
                     ["quantize", "-m", model, "-o", UNWRITABLE, "--fn", "int8"]),
        "profile": (["profile", "-m", model, "-qm", NOPE, "-o", tmp / "p.safetensors", "--fn", "int8"],
                    ["profile", "-m", model, "-qm", model, "-o", f"{UNWRITABLE}/p.safetensors", "--fn", "int8"]),
        "setup": (["setup", "-m", NOPE, "-p", f"{NOPE}.safetensors", "-o", tmp / "c.yaml"],
                  ["setup", "--fn", "int8", "-o", f"{UNWRITABLE}/c.yaml"]),
        "tune": (["tune", "-m", NOPE, "--fn", "int8", "-o", tmp / "t.yaml"],
                 ["tune", "-m", model, "--fn", "int8", "-o", f"{UNWRITABLE}/t.yaml"]),
        "verify reload": (["verify", "reload", "--config", "int8", "-m", NOPE],
                          ["verify", "reload", "--config", "int8", "-m", model, "--json", f"{UNWRITABLE}/r.json"]),
        "verify drift": (["verify", "drift", "--config", "int8", "-m", NOPE],
                         ["verify", "drift", "--config", "int8", "-m", model, "--plot", f"{UNWRITABLE}/d.png"]),
        "models tiny": (None, ["models", "tiny", "-o", f"{UNWRITABLE}/tiny"]),
        "publish": (["publish", f"{NOPE}/config.yaml", "--repo", "alice/x", "--dry-run"], None),
    }


@pytest.mark.parametrize("command", ["quantize", "profile", "setup", "tune", "verify reload", "verify drift",
                                     "models tiny", "publish"])
def test_a_missing_input_or_an_unwritable_output_is_one_line(command, model, tmp_path):
    missing, unwritable = _cases(model, tmp_path)[command]
    if missing is not None:
        _one_line_error(run_cli(*missing, timeout=120), NOPE)
    if unwritable is not None:
        _one_line_error(run_cli(*unwritable, timeout=120), UNWRITABLE, "cannot write here")
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_an_output_below_a_file_is_refused_and_nothing_is_written(model, tmp_path):
    """The case of the issue: quantize's final rename failed with FileNotFoundError."""
    (tmp_path / "file").write_text("x")
    res = run_cli("quantize", "-m", model, "-o", tmp_path / "file" / "out", "--fn", "int8")
    _one_line_error(res, "cannot write here")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
