"""`flashrl verify`: the metrics against a hand-computed case, reload checks that pass on correct
configs and fail, naming the check, on each injected fault. (A calibrated mixed-precision config's reload and
`verify drift`: tests/test_verify_engines.py, a file of their own so that CI's two workers share the engines.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from flashrl_tools.correction import mismatch_metrics
from flashrl_tools.verify.drift import engine_report
from flashrl_tools.verify.score import token_logprobs


def test_metrics_on_two_tokens_with_known_logits():
    """Trainer logits at T=2: [0, ln 9] and [ln 16, 0] -> p = 3/4 and 4/5 for the sampled tokens
    (1, 0). The rollout engine gave them 1/2 and 2/5. So r = 1.5 and 2."""
    logits = torch.tensor([[0.0, math.log(9)], [math.log(16), 0.0]])
    lp_train = token_logprobs(logits, torch.tensor([1, 0]), temperature=2.0)
    assert torch.allclose(lp_train, torch.tensor([math.log(0.75), math.log(0.8)]), atol=1e-6)
    lp_rollout = torch.tensor([[math.log(0.5), math.log(0.4)]])
    m = mismatch_metrics(lp_train[None], lp_rollout, torch.ones(1, 2), tis_cap=2.1)
    assert m.tokens == 2 and m.sequences == 1
    assert m.mean_abs_log_ratio == pytest.approx((math.log(1.5) + math.log(2)) / 2, abs=1e-6)
    assert m.kl_k3 == pytest.approx(((0.5 - math.log(1.5)) + (1 - math.log(2))) / 2, abs=1e-6)
    assert m.seq_log_ratio_mean == pytest.approx(math.log(3), abs=1e-6)
    assert m.ppl_ratio == pytest.approx(math.sqrt((0.5 * 0.4) / (0.75 * 0.8)), abs=1e-6)
    assert m.tis_truncated_frac == 0.0  # no r above C = 2.1
    assert mismatch_metrics(lp_train[None], lp_rollout, torch.ones(1, 2), tis_cap=1.8).tis_truncated_frac == 0.5
    assert m.ess_token == pytest.approx(3.5 ** 2 / (2 * (1.5 ** 2 + 2 ** 2)), abs=1e-6)  # 0.98


def test_padding_is_masked_and_lengths_reported():
    # the second sequence has one token; its padding must not count
    train = [[math.log(0.75), math.log(0.8)], [math.log(0.5)]]
    rollouts = [{"token_ids": [1, 0], "logprobs": [math.log(0.5), math.log(0.4)]},
                {"token_ids": [7], "logprobs": [math.log(0.5)]}]
    r = engine_report(train, rollouts, cap=2.0)
    assert r["metrics"]["tokens"] == 3 and r["metrics"]["sequences"] == 2
    assert r["mean_response_length"] == 1.5
    assert r["metrics"]["seq_log_ratio_min"] == pytest.approx(0.0, abs=1e-9)
    assert sorted(r["log_ratios"]) == pytest.approx(sorted([math.log(1.5), math.log(2), 0.0]))


def test_bad_input_is_one_clear_error(tmp_path):
    res = run_cli("verify", "reload", "--config", "int9")
    assert res.returncode == 2 and "invalid FLASHRL_CONFIG='int9'" in res.stderr
    assert "Traceback" not in res.stderr
    res = run_cli("verify", "drift", "--config", "int8", "-m", "default", "--prompts", tmp_path / "nope.jsonl")
    assert res.returncode == 2 and "prompts file not found" in res.stderr and "Traceback" not in res.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
    res = run_cli("verify", "drift", "--config", "int8", "-m", "default", "--prompts", bad)
    assert res.returncode == 2 and "line 2" in res.stderr
    for raw in ("{not json", "[1, 2]"):  # extra engine arguments: one error before any engine starts
        res = run_cli("verify", "drift", "--config", "bf16", "-m", "default", "-n", "1",
                      env={"FLASHRL_ENGINE_ARGS": raw})
        assert res.returncode == 2 and "FLASHRL_ENGINE_ARGS is not a JSON object" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr


def test_an_engine_that_is_not_installed_or_unknown_is_one_clear_error(tmp_path):
    """`--engine sglang` on a machine without SGLang (this CPU one: SGLang is GPU-only) or an unknown
    engine: one message, exit 2, before anything is written to the work dir."""
    work = tmp_path / "work"
    for engine, message in (("sglang", "sglang is not installed"), ("tgi", "unknown engine 'tgi'")):
        res = run_cli("verify", "reload", "--config", "int8", "-m", "default", "--engine", engine,
                      "--work-dir", work)
        assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr
        res = run_cli("verify", "drift", "--config", "int8", "-m", "default", "--engine", engine)
        assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not any(work.iterdir())


def test_engine_args_from_the_environment(monkeypatch):
    from flashrl_tools.verify.engines import extra_engine_args

    monkeypatch.delenv("FLASHRL_ENGINE_ARGS", raising=False)
    assert extra_engine_args() == {}
    monkeypatch.setenv("FLASHRL_ENGINE_ARGS", '{"gpu_memory_utilization": 0.1, "kv_cache_memory_bytes": 1024}')
    assert extra_engine_args() == {"gpu_memory_utilization": 0.1, "kv_cache_memory_bytes": 1024}


def test_an_engine_crash_is_reported_by_its_first_tracebacks_exception():
    """SGLang at TP = 2 (2 x H200, 2026-11-30): rank 1 raised, rank 0 then lost its peer, and the crash report's
    last "Error" line was py-spy's absence: the cause is the first traceback's exception."""
    from flashrl_tools.verify.engines import error_line

    log = """[23:47:08 TP1] Scheduler hit an exception: Traceback (most recent call last):
  File "/x/int8_triton.py", line 74, in int8_channel
    _kernel()[(rows,)](w, q, scale)
ValueError: Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)

[23:47:11 TP0] Scheduler hit an exception: Traceback (most recent call last):
  File "/x/pair.cc", line 1, in recv
RuntimeError: [gloo] Connection closed by peer
[23:47:14] Pyspy failed (py-spy dump --pid 1987). Error: /bin/sh: 1: py-spy: not found
"""
    assert error_line(log) == "ValueError: Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)"
    assert error_line("loading\nCUDA error: out of memory\nbye") == "CUDA error: out of memory"
    assert error_line("all quiet") is None


def checks_of(report: Path) -> dict[str, bool]:
    return {c["name"]: c["passed"] for c in json.loads(report.read_text())["checks"]}


@pytest.fixture(scope="module")
def reload_work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("verify-reload")


@pytest.mark.vllm
def test_reload_passes_for_int8(default_model, reload_work):
    res = run_cli("verify", "reload", "--config", "int8", "-m", "default", "--work-dir", reload_work,
                  "--json", reload_work / "int8.json", timeout=1200)
    assert res.returncode == 0, res.stdout + res.stderr
    assert all(checks_of(reload_work / "int8.json").values())
    assert "all reload checks passed" in res.stdout


@pytest.mark.vllm
@pytest.mark.parametrize("fault,failing", [
    ("noop", {"sync of updated weights changes the outputs", "sync of updated weights = fresh engine"}),
    ("wrong_layer", {"sync of the policy's weights = fresh engine", "sync of updated weights = fresh engine"}),
    ("stale_scales", {"sync of updated weights = fresh engine"}),
])
def test_reload_catches_injected_faults(default_model, reload_work, fault, failing):
    """Reuses the fresh engines' outputs of test_reload_passes_for_int8 (same --work-dir)."""
    out = reload_work / f"{fault}.json"
    res = run_cli("verify", "reload", "--config", "int8", "-m", "default", "--work-dir", reload_work,
                  "--inject-fault", fault, "--json", out, timeout=1200)
    assert res.returncode == 1, res.stdout + res.stderr
    failed = {name for name, ok in checks_of(out).items() if not ok}
    assert failed == failing
    for name in failing:
        assert name in " ".join(res.stderr.split())
