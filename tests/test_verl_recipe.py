"""The verl GRPO recipe (examples/verl/) and the learning-curve report (benchmarks/rl_curves.py),
as far as they run without a GPU: verl 0.9.1's own dataset class reads our parquet, its own
loader finds and calls our reward function, the recipe's command composes into a valid verl
config (hydra, every override key known), and the report turns TRL and verl logs into a plot and
a table. The training runs themselves need a GPU (README "RL integration")."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, prepare_verl

HAVE_VERL = importlib.util.find_spec("verl") is not None
needs_verl = pytest.mark.skipif(not HAVE_VERL, reason="verl is not installed (scripts/install.sh installs it)")


def _data_module():
    spec = importlib.util.spec_from_file_location("arith_data", REPO / "examples" / "verl" / "arith_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_verl
def test_verl_reads_the_dataset_and_scores_with_our_reward(default_model, tmp_path):
    prepare_verl()
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.utils.dataset.rl_dataset import RLHFDataset

    train, test = _data_module().write(tmp_path, 64, 16, seed=0)
    data = RLHFDataset([str(test)], AutoTokenizer.from_pretrained(default_model),
                       OmegaConf.create({"max_prompt_length": 64, "prompt_key": "prompt", "truncation": "error"}))
    assert len(data) == 16
    item = data[0]
    answer = item["reward_model"]["ground_truth"]
    assert item["data_source"] == "flashrl_arith" and answer.isdigit()
    score = get_custom_reward_fn(OmegaConf.create({"reward": {"custom_reward_function": {
        "path": str(REPO / "examples" / "verl" / "arith_reward.py"), "name": "compute_score"}}}))
    assert score("flashrl_arith", f"The answer is {answer}.", answer) == 1.0
    assert score("flashrl_arith", "I do not know.", answer) == 0.0


@needs_verl
def test_recipe_composes_into_a_verl_config(default_model, tmp_path):
    """The recipe's command with verl's hydra entry point in `--cfg job` mode: hydra refuses an
    unknown override key, so a typo in the recipe fails here; the composed values are checked."""
    wrapper = tmp_path / "main_ppo_cfg.py"
    wrapper.write_text(
        "import importlib.util, runpy, sys\n"
        f"spec = importlib.util.spec_from_file_location('sp', {str(REPO / 'tests' / 'probes' / 'sync_probe.py')!r})\n"
        "sp = importlib.util.module_from_spec(spec); spec.loader.exec_module(sp); sp.prepare_verl()\n"
        "sys.argv = ['main_ppo', '--cfg', 'job'] + sys.argv[1:]\n"
        "runpy.run_module('verl.trainer.main_ppo', run_name='__main__')\n")
    env = {**os.environ, "FLASHRL_CONFIG": "int8", "SEED": "3", "STEPS": "4", "OUT": str(tmp_path / "run"),
           "FINAL_CHECK": "1", "HELDOUT": "1", "LEVEL": "mul21", "TIS": "mis",
           "MODEL": str(default_model), "VERL_MAIN": f"{sys.executable} {wrapper}",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    res = subprocess.run(["bash", str(REPO / "examples" / "verl" / "run_grpo_smollm2.sh")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    import yaml

    cfg = yaml.safe_load(res.stdout[res.stdout.index("data:") if res.stdout.startswith("data:") else 0:])
    rollout = cfg["actor_rollout_ref"]["rollout"]
    assert rollout["name"] == "vllm" and rollout["n"] == 8 and rollout["seed"] == 3
    assert rollout["free_cache_engine"] is True  # verl's hybrid engine sleeps between rollouts
    # TIS=mis: token-level masking outside [0.5, 2] (verl's IcePop form), not truncation
    assert cfg["algorithm"]["rollout_correction"]["rollout_is"] == "token"
    assert cfg["algorithm"]["rollout_correction"]["rollout_is_threshold"] == "0.5_2.0"
    assert cfg["ray_kwargs"]["ray_init"]["runtime_env"]["worker_process_setup_hook"] == "flashrl_tools.verl_metrics.install"
    assert cfg["trainer"]["total_training_steps"] == 4 and cfg["trainer"]["n_gpus_per_node"] == 1
    assert cfg["reward"]["custom_reward_function"]["path"] == str(REPO / "examples" / "verl" / "arith_reward.py")
    env_vars = cfg["ray_kwargs"]["ray_init"]["runtime_env"]["env_vars"]
    assert env_vars["FLASHRL_CONFIG"] == "int8"
    # FINAL_CHECK=1: what examples/verl/final_check.py reads after the run, at absolute paths
    run = tmp_path / "run"
    assert env_vars["FLASHRL_SYNC_DIGEST"] == str(run / "digest-verl-int8-s3")
    assert cfg["trainer"]["save_freq"] == 4 and cfg["trainer"]["test_freq"] == 4
    assert cfg["trainer"]["default_local_dir"] == str(run / "ckpt-verl-int8-s3")
    assert cfg["trainer"]["validation_data_dir"] == str(run / "val-verl-int8-s3")
    assert cfg["actor_rollout_ref"]["actor"]["checkpoint"]["save_contents"] == ["hf_model"]
    assert cfg["trainer"]["max_actor_ckpt_to_keep"] is None  # HELDOUT=1: every checkpoint kept for the evaluation
    assert cfg["data"]["train_files"] == str(run / "data-mul21" / "train.parquet")
    import pandas as pd

    assert pd.read_parquet(run / "data-mul21" / "test.parquet")["prompt"].map(lambda p: " * " in p[0]["content"]).all()
    bad = subprocess.run(["bash", str(REPO / "examples" / "verl" / "run_grpo_smollm2.sh")], env={**env, "TIS": "yes"},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip() == "TIS=yes: use token, off or mis"


@needs_verl
def test_fully_async_recipe_composes_into_a_verl_config(default_model, tmp_path):
    """examples/verl/run_fully_async_smollm2.sh through hydra with the fully-async entry point's own config
    (`fully_async_ppo_trainer`, composed here without importing its module, which needs the GPU trainer's
    packages): every override key known, rollouter and trainer on a GPU each, verl's NCCL checkpoint engine,
    partial rollouts, and FLASHRL_CONFIG / FLASHRL_KV_CACHE_DTYPE in every Ray worker's environment."""
    wrapper = tmp_path / "fully_async_cfg.py"
    wrapper.write_text(
        "import importlib.util, os, sys\n"
        "import hydra\n"
        f"spec = importlib.util.spec_from_file_location('sp', {str(REPO / 'tests' / 'probes' / 'sync_probe.py')!r})\n"
        "sp = importlib.util.module_from_spec(spec); spec.loader.exec_module(sp); sp.prepare_verl()\n"
        "import verl.experimental.fully_async_policy as fa\n"
        "@hydra.main(config_path=os.path.join(os.path.dirname(fa.__file__), 'config'),\n"
        "            config_name='fully_async_ppo_trainer', version_base=None)\n"
        "def main(config):\n"
        "    pass\n"
        "sys.argv = ['fully_async_main', '--cfg', 'job'] + sys.argv[1:]\n"
        "main()\n")
    env = {**os.environ, "FLASHRL_CONFIG": "int8", "FLASHRL_KV_CACHE_DTYPE": "fp8", "STEPS": "4", "ROLLOUT_MAX_SEQS": "4",
           "OUT": str(tmp_path / "run"), "MODEL": str(default_model), "VERL_MAIN": f"{sys.executable} {wrapper}",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    res = subprocess.run(["bash", str(REPO / "examples" / "verl" / "run_fully_async_smollm2.sh")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    import yaml

    cfg = yaml.safe_load(res.stdout)
    rollout = cfg["actor_rollout_ref"]["rollout"]
    assert rollout["name"] == "vllm" and rollout["mode"] == "async" and rollout["calculate_log_probs"] is True
    assert rollout["max_num_seqs"] == 4  # a rollouter slower than the trainer: syncs land on requests in flight
    assert rollout["checkpoint_engine"]["backend"] == "nccl"
    assert cfg["actor_rollout_ref"]["hybrid_engine"] is False  # its trainer and rollouter assert it
    assert cfg["async_training"]["partial_rollout"] is True and cfg["async_training"]["trigger_parameter_sync_step"] == 1
    assert cfg["data"]["train_batch_size"] == 0 and cfg["data"]["gen_batch_size"] == 1  # the rollouter asserts both
    assert cfg["rollout"]["n_gpus_per_node"] == 1 and cfg["trainer"]["n_gpus_per_node"] == 1
    assert cfg["actor_rollout_ref"]["actor"]["use_rollout_log_probs"] is True
    assert cfg["algorithm"]["rollout_correction"]["rollout_is"] == "token"
    env_vars = cfg["ray_kwargs"]["ray_init"]["runtime_env"]["env_vars"]
    assert env_vars["FLASHRL_CONFIG"] == "int8" and env_vars["FLASHRL_KV_CACHE_DTYPE"] == "fp8"
    assert (tmp_path / "run" / "data" / "train.parquet").is_file()


def test_learning_curves_from_trl_and_verl_logs(tmp_path):
    """Three verl-format runs (bf16 twice, int8 once) and the committed TRL CPU logs: a PNG and a
    table with each config's final reward, spread and the comparison with bf16."""
    def verl_log(path, rewards, gen_s):
        with open(path, "w") as f:
            for step, (r, s) in enumerate(zip(rewards, gen_s), 1):
                f.write(json.dumps({"step": step, "data": {"critic/score/mean": r, "rollout_corr/kl": 0.01,
                                                           "rollout_corr/log_ppl_abs_diff": 0.05,
                                                           "rollout_corr/rollout_is_ratio_fraction_high": 0.02,
                                                           "rollout_corr/rollout_is_ratio_fraction_low": 0.0,
                                                           "timing_s/gen": s}}) + "\n")
                if step % 2 == 0:  # the BF16 held-out evaluation's line for this step
                    f.write(json.dumps({"step": step, "data": {"heldout/bf16_accuracy": r / 2}}) + "\n")
    verl_log(tmp_path / "b0.jsonl", [0.1, 0.2, 0.4, 0.5], [2.0] * 4)
    verl_log(tmp_path / "b1.jsonl", [0.1, 0.3, 0.5, 0.7], [2.0] * 4)
    verl_log(tmp_path / "i0.jsonl", [0.1, 0.2, 0.3, 0.3], [1.0] * 4)
    out = tmp_path / "report" / "curves"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "rl_curves.py"), "--out", str(out), "--last", "2",
                          "--target", "0.39", f"bf16/0={tmp_path / 'b0.jsonl'}", f"bf16/1={tmp_path / 'b1.jsonl'}",
                          f"int8/0={tmp_path / 'i0.jsonl'}"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    table = json.loads(out.with_suffix(".json").read_text())
    bf16, int8 = table["configs"]["bf16"], table["configs"]["int8"]
    assert (bf16["final_reward_min"], bf16["final_reward_max"]) == (0.45, 0.6)
    half = 12.706 * 0.075  # t(1 dof) x stdev(0.45, 0.6) / sqrt(2)
    assert bf16["final_reward_ci95"] == pytest.approx([0.525 - half, 0.525 + half])
    assert bf16["final_heldout_acc_mean"] == pytest.approx(0.3) and bf16["reward_auc_mean"] == pytest.approx(0.35)
    assert bf16["steps_to_target"] == [4, 3] and int8["steps_to_target"] == [None]  # mean of 2 steps >= 0.39
    assert int8["final_reward_mean"] == 0.3 and int8["vs_bf16"] == "0.15 below the bf16 seeds' lowest"
    assert int8["separable_from_bf16"] is None  # one int8 seed: no interval
    assert int8["rollout_s_vs_bf16"] == 0.5
    assert table["runs"]["bf16/0"]["mean_is_clipped_frac"] == pytest.approx(0.02)
    assert out.with_suffix(".png").stat().st_size > 10_000
    trl = subprocess.run([sys.executable, str(REPO / "benchmarks" / "rl_curves.py"), "--out", str(tmp_path / "trl"),
                          f"bf16/0={REPO / 'docs/trl/grpo-bf16.jsonl'}", f"int8/0={REPO / 'docs/trl/grpo-int8.jsonl'}"],
                         capture_output=True, text=True, timeout=300)
    assert trl.returncode == 0, trl.stderr
    runs = json.loads((tmp_path / "trl.json").read_text())["runs"]
    assert runs["int8/0"]["steps"] == 40 and runs["int8/0"]["final_engine_check"]["max_abs_logp_diff_vs_fresh_engine"] == 0.0
    bad = subprocess.run([sys.executable, str(REPO / "benchmarks" / "rl_curves.py"), "--out", str(tmp_path / "x"),
                          f"int8/0={tmp_path / 'missing.jsonl'}"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.startswith("error: cannot read") and "Traceback" not in bad.stderr
    assert not (tmp_path / "x.json").exists()


def test_a_directory_of_arm_logs_is_read_by_name():
    """`rl_curves.py --dir`: scripts/gpu_verl_runs.sh's log names give each run's arm and seed (a log that died empty
    is left out); none found is one error line."""
    import tempfile

    rc = _bench("rl_curves")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for name in ("verl-bf16-s0", "verl-bf16-s1", "verl-int8-notis-s2", "verl-int8+kv-s0"):
            (d / f"{name}.jsonl").write_text(json.dumps({"step": 1, "data": {"critic/score/mean": 0.5}}) + "\n")
        (d / "verl-fp8-s0.jsonl").write_text("")
        (d / "notes.jsonl").write_text("{}\n")
        specs = rc.run_specs(d)
        assert [x.split("=")[0] for x in specs] == ["bf16/0", "bf16/1", "int8+kv/0", "int8-notis/2"]
        assert rc.main(["--out", str(d / "out" / "c"), "--dir", str(d)]) == 0
        table = json.loads((d / "out" / "c.json").read_text())
        assert set(table["configs"]) == {"bf16", "int8+kv", "int8-notis"}
        empty = d / "empty"
        empty.mkdir()
        assert rc.main(["--out", str(d / "x"), "--dir", str(empty)]) == 2


def test_four_bit_arms_report_their_code_changes_and_kl_against_bf16(tmp_path):
    """Issue 75's arms: each run's RUN.log beside its RUN.jsonl (scripts/gpu_verl_runs.sh) holds the engines'
    FLASHRL_CODE_CHANGES lines (runtime/core/code_changes.py's wording); the table gives per arm the median % of 4-bit
    codes a sync changed and the syncs that changed none, and the token KL as a multiple of bf16's (the published
    "~100x without QAT" is such a ratio). Runs without the lines report none (no column when no arm has them)."""
    from flashrl_tools.runtime.core.code_changes import CodeChanges

    rc = _bench("rl_curves")

    def run(name, kl, shares):
        lines = [json.dumps({"step": s, "data": {"critic/score/mean": 0.5, "rollout_corr/kl": kl}}) for s in (1, 2)]
        (tmp_path / f"verl-{name}.jsonl").write_text("\n".join(lines) + "\n")
        log = ["(WorkerDict pid=1) INFO flashrl: 4-bit codes recorded (13 weights; the next sync reports the share)"]
        for share in shares:  # the summary line of a sync that changed `share` of 1000 codes
            cc = CodeChanges()
            cc.changed, cc.total, cc.shares = round(share * 1000), 1000, [share]
            log.append(f"(WorkerDict pid=1) INFO flashrl: {cc.summary()}")
        if shares:
            (tmp_path / f"verl-{name}.log").write_text("\n".join(log) + "\ntrain exit 0 (try 1)\n")
    run("bf16-s0", 0.001, [])
    run("bf16-s1", 0.003, [])
    run("down4-s0", 0.02, [0.0, 0.004, 0.01])
    run("down4-s1", 0.06, [0.002, 0.0])
    out = tmp_path / "out" / "arms"
    assert rc.main(["--out", str(out), "--dir", str(tmp_path)]) == 0
    table = json.loads(out.with_suffix(".json").read_text())
    assert table["runs"]["down4/0"]["codes_changed"] == {"syncs": 3, "median_pct": 0.4, "min_pct": 0.0,
                                                         "syncs_with_none": 1}
    down4, bf16 = table["configs"]["down4"], table["configs"]["bf16"]
    assert down4["codes_changed_median_pct"] == pytest.approx((0.4 + 0.1) / 2)
    assert (down4["codes_syncs_with_none"], down4["codes_syncs"]) == (2, 5) and bf16["codes_syncs"] == 0
    assert down4["token_kl_vs_bf16"] == pytest.approx(20.0)  # 0.04 / 0.002
    md = out.with_suffix(".md").read_text()
    assert "4-bit codes a sync changed" in md and "| 0.25 % (2 of 5) |" in md and "(20x)" in md
    for log in tmp_path.glob("*.log"):  # without any code-change line: no such column
        log.unlink()
    assert rc.main(["--out", str(out), "--dir", str(tmp_path)]) == 0
    assert "4-bit codes" not in out.with_suffix(".md").read_text()


def test_arms_are_separable_only_when_their_95_intervals_are_apart():
    """Issue 44's wording rule: an 8-bit arm is called different from bf16 only when the seeds' 95 % intervals
    (Student's t) of the final reward do not overlap."""
    spec = importlib.util.spec_from_file_location("rl_curves", REPO / "benchmarks" / "rl_curves.py")
    rc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rc)

    def run(final):
        return [{"step": s, **dict.fromkeys(rc.MEASURES), "reward": final} for s in (1, 2)]
    runs = {"bf16/0": run(0.60), "bf16/1": run(0.62), "bf16/2": run(0.61),
            "int8/0": run(0.40), "int8/1": run(0.41), "int8/2": run(0.42),  # apart
            "fp8/0": run(0.50), "fp8/1": run(0.70), "fp8/2": run(0.60)}  # overlapping
    table = rc.summarize(runs, {}, last=2)["configs"]
    assert table["int8"]["separable_from_bf16"] is True and table["fp8"]["separable_from_bf16"] is False
    lo, hi = table["bf16"]["final_reward_ci95"]
    assert lo == pytest.approx(0.61 - 4.303 * 0.01 / 3 ** 0.5) and hi == pytest.approx(0.61 + 4.303 * 0.01 / 3 ** 0.5)
    assert rc.interval([0.5]) is None


def test_final_engine_checks_are_judged_leaving_out_only_the_fp8_kv_scales():
    """The final check's verdict per run: KV-cache scales (vLLM's `_k_scale` ... and their CPU copies, which the
    engine recalibrates after each sync) are the only names a difference may have and still count as equal --
    final_check.py leaves the same names out (one list: runtime/core/digest.py)."""
    from flashrl_tools.runtime.core.digest import is_kv_scale

    rc = _bench("rl_curves")
    assert rc.check_verdict(None) is None and rc.check_verdict({"equal": True}) == "equal"
    scales = {"equal": False, "tensors_only_in_one": 0, "differing_by_name": {"_k_scale_cpu": 30, "_v_scale_cpu": 30}}
    assert rc.check_verdict(scales) == "equal but KV scales"
    weight = {**scales, "differing_by_name": {"_k_scale_cpu": 30, "weight": 1}}
    assert rc.check_verdict(weight) == "differs"
    assert rc.check_verdict({**scales, "tensors_only_in_one": 2}) == "differs"
    assert is_kv_scale("kernel:model.layers.0.self_attn.attn._v_scale_cpu") and is_kv_scale("model.layers.3.attn.k_scale")
    assert not is_kv_scale("model.layers.0.mlp.down_proj.weight_scale")
    runs = {"int8+kv/0": [{"step": 1, **dict.fromkeys(rc.MEASURES), "reward": 0.5}]}
    table = rc.summarize(runs, {"int8+kv/0": scales}, last=1)
    assert table["configs"]["int8+kv"]["engine_checks"] == {"equal but KV scales": 1}


def test_tis_effect_and_differences_from_bf16_carry_welch_intervals():
    """The analysis issue 44 asks for: each arm minus bf16 and each precision's TIS effect as a difference of seed
    means with a Welch 95 % interval (separable only when it excludes 0), on the final held-out accuracy, its area
    under the curve and the final reward; the first evaluated step reaching a held-out target."""
    spec = importlib.util.spec_from_file_location("rl_curves", REPO / "benchmarks" / "rl_curves.py")
    rc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rc)

    def run(curve):  # held-out accuracy at steps 0, 10, 20; reward = accuracy
        return [{"step": s, **dict.fromkeys(rc.MEASURES), "reward": a, "heldout_acc": a} for s, a in zip((0, 10, 20), curve)]
    runs = {"bf16/0": run((0.2, 0.35, 0.45)), "bf16/1": run((0.2, 0.36, 0.46)), "bf16/2": run((0.2, 0.34, 0.44)),
            "int8/0": run((0.2, 0.25, 0.30)), "int8/1": run((0.2, 0.26, 0.31)), "int8/2": run((0.2, 0.27, 0.29)),
            "int8-notis/0": run((0.2, 0.26, 0.33)), "int8-notis/1": run((0.2, 0.24, 0.29)),
            "int8-notis/2": run((0.2, 0.25, 0.31))}
    table = rc.summarize(runs, {}, last=1, target_acc=0.3)
    c = table["comparisons"]
    apart = c["int8 - bf16"]["final_heldout_acc"]
    assert apart["diff"] == pytest.approx(0.30 - 0.45) and apart["separable"] is True and apart["ci95"][1] < 0
    # Welch with equal variances (0.01^2 each, n = 3): se = sqrt(2) * 0.01 / sqrt(3), dof = 4 -> t = 2.776
    half = 2.776 * 2 ** 0.5 * 0.01 / 3 ** 0.5
    assert apart["ci95"] == pytest.approx([-0.15 - half, -0.15 + half])
    tis = c["int8 - int8-notis (TIS effect)"]["final_heldout_acc"]
    assert tis["diff"] == pytest.approx(0.30 - 0.31) and tis["separable"] is False and tis["ci95"][0] < 0 < tis["ci95"][1]
    assert c["int8 - bf16"]["heldout_auc"]["diff"] == pytest.approx((0.2 + 0.26 + 0.30) / 3 - (0.2 + 0.35 + 0.45) / 3)
    assert "int8-notis - bf16" in c and "bf16 - bf16-notis (TIS effect)" not in c
    assert table["configs"]["bf16"]["steps_to_heldout_target"] == [10, 10, 10]
    assert table["configs"]["int8"]["steps_to_heldout_target"] == [20, 20, None]
    assert rc.difference([0.5], [0.4, 0.3]) is None
    runs["bf16-notis/0"] = run((0.2, 0.3, 0.4))
    table = rc.summarize(runs, {}, last=1, target_acc=0.3)
    assert "bf16 - bf16-notis (TIS effect)" in table["comparisons"] and "bf16-notis - bf16" not in table["comparisons"]
    # the README / RESULTS table (OUT.md) is written from the same numbers
    md = rc.markdown({**table, "target_acc": 0.3})
    row = next(line for line in md.splitlines() if line.startswith("| int8, no TIS |"))
    assert "| 3 | 0.200 -> 0.330 / 0.290 / 0.310 |" in row and "| 20 / - / 20 |" in row
    assert "| int8 - bf16 | -0.150 (" in md and md.rstrip().endswith("the interval excludes 0")


def _example(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / "verl" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_heldout_evaluation_scores_every_checkpoint_into_a_sidecar_log(tmp_path):
    """examples/verl/heldout_eval.py without its engine (the GPU runs drive a BF16 vLLM engine through the same
    code): per run the start model (evaluated once for all runs) and every finished checkpoint in step order,
    scored at the split's level, appended to RUN.heldout.jsonl; a second pass evaluates only what is new; a
    checkpoint verl has not finished is not read; with --delete every evaluated checkpoint but the latest goes;
    rl_curves reads the sidecar beside the run's log; runs without checkpoints are refused in one line."""
    he = _example("heldout_eval")
    _data_module().write(tmp_path / "data-mul21", 8, 6, seed=0, level="mul21")
    prompts, answers, level = he.split(tmp_path / "data-mul21")
    assert level == "mul21" and len(prompts) == len(answers) == 6 and prompts[0][0]["role"] == "user"

    def ckpt(run, step, latest):
        (tmp_path / f"ckpt-{run}" / f"global_step_{step}" / "actor" / "huggingface").mkdir(parents=True)
        (tmp_path / f"ckpt-{run}" / "latest_checkpointed_iteration.txt").write_text(str(latest))
    ckpt("a", 5, 5)
    ckpt("a", 10, 5)  # being written: verl has not recorded it yet
    ckpt("b", 5, 5)
    right = {None: 1, ("a", 5): 3, ("a", 10): 6, ("b", 5): 2}  # prompts answered right by each model
    state = {"now": None}

    def load(path):
        state["now"] = (path.parents[2].name.removeprefix("ckpt-"), int(path.parent.parent.name.rsplit("_", 1)[1]))

    def generate():
        n = right[state["now"]]
        return [f"{a} * 1 = {a}" if i < n else f"It is {int(a) + 1}" for i, a in enumerate(answers)]
    ev = he.Evaluator(generate, load, answers, level)
    assert ev.run_pass(tmp_path, ["a", "b"], delete=True) == 4  # a: 0, 5; b: 0, 5
    (tmp_path / "ckpt-a" / "latest_checkpointed_iteration.txt").write_text("10")
    assert ev.run_pass(tmp_path, ["a", "b"], delete=True) == 1  # a: 10 only
    assert ev.run_pass(tmp_path, ["a", "b"], delete=True) == 0
    rows = [json.loads(x) for x in (tmp_path / "a.heldout.jsonl").read_text().splitlines()]
    assert [(r["step"], r["data"][he.KEY]) for r in rows] == [(0, 1 / 6), (5, 0.5), (10, 1.0)]
    assert not (tmp_path / "ckpt-a" / "global_step_5").exists() and (tmp_path / "ckpt-a" / "global_step_10").is_dir()
    assert (tmp_path / "ckpt-b" / "global_step_5").is_dir()  # the latest of b
    (tmp_path / "a.jsonl").write_text(json.dumps({"step": 5, "data": {"critic/score/mean": 0.25}}) + "\n")
    steps, _ = _bench("rl_curves").read_log(tmp_path / "a.jsonl")
    assert [(r["step"], r["reward"], r["heldout_acc"]) for r in steps] == [(0, None, 1 / 6), (5, 0.25, 0.5),
                                                                           (10, None, 1.0)]
    with pytest.raises(SystemExit, match="no checkpoints in .*: run the recipe with FINAL_CHECK=1"):
        he.main([str(tmp_path), "missing", "--data", str(tmp_path / "data-mul21")])


def _bench(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_run_logs_are_trimmed_without_changing_the_table(tmp_path):
    """benchmarks/trim_logs.py: per step only the kept keys (floats to 6 digits, held-out accuracies exact), the
    held-out sidecar merged, the final check last; rl_curves gives the same table from the trimmed logs; a
    directory without run logs is one error line."""
    import sys as _sys

    _sys.path.insert(0, str(REPO / "benchmarks"))
    trim = _bench("trim_logs")
    rc = _bench("rl_curves")
    src = tmp_path / "src"
    src.mkdir()
    for seed in (0, 1):
        rows = [{"step": s, "data": {"critic/score/mean": 0.1 * s + 0.0123456789 * seed, "rollout_corr/kl": 0.001 * s,
                                     "actor/pg_loss": 1.0, "global_seqlen/max": 99, "timing_s/gen": 2.5,
                                     "rollout_corr/flashrl_abs_logp_diff_mean": 0.05,
                                     "rollout_corr/log_ppl_diff_max": 3.0}} for s in (1, 2, 3)]
        lines = [json.dumps(r) for r in rows] + [json.dumps({"final_check": {"equal": True}})]
        (src / f"verl-int8-s{seed}.jsonl").write_text("\n".join(lines) + "\n")
        (src / f"verl-int8-s{seed}.heldout.jsonl").write_text(
            json.dumps({"step": 3, "data": {"heldout/bf16_accuracy": 117 / 256, "heldout/prompts": 256}}) + "\n")
    assert trim.main([str(src), str(tmp_path / "dst")]) == 0
    out = [json.loads(x) for x in (tmp_path / "dst" / "verl-int8-s1.jsonl").read_text().splitlines()]
    assert out[-1] == {"final_check": {"equal": True}} and len(out) == 5
    assert set(out[0]["data"]) == {"critic/score/mean", "rollout_corr/kl", "timing_s/gen",
                                   "rollout_corr/flashrl_abs_logp_diff_mean"}
    assert out[0]["data"]["critic/score/mean"] == 0.112346  # 6 significant digits
    assert out[3]["data"]["heldout/bf16_accuracy"] == 117 / 256  # exact
    def table(d):
        logs = {f"int8/{s}": rc.read_log(d / f"verl-int8-s{s}.jsonl") for s in (0, 1)}
        return rc.summarize({k: v[0] for k, v in logs.items()}, {k: v[1] for k, v in logs.items()}, last=2)
    a, b = table(src), table(tmp_path / "dst")
    assert b["configs"]["int8"]["final_heldout_acc_mean"] == a["configs"]["int8"]["final_heldout_acc_mean"] == 117 / 256
    assert b["configs"]["int8"]["final_reward_mean"] == pytest.approx(a["configs"]["int8"]["final_reward_mean"], rel=1e-5)
    assert b["runs"]["int8/1"]["final_engine_check"] == {"equal": True}
    (tmp_path / "empty").mkdir()
    assert trim.main([str(tmp_path / "empty"), str(tmp_path / "x")]) == 2
