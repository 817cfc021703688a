"""Rollout correction: hand-derived cases, and the same inputs through TRL's and verl's own code
(the installed packages: TRL's inline block is executed from its source, verl's helper imported)."""

from __future__ import annotations

import inspect
import math
import textwrap

import pytest
import torch

from flashrl_tools.correction import MODES, correction_metrics, importance_weights, mismatch_metrics

L = math.log


def _hand_case():
    """Two sequences. Seq 0: r = 1/2, 3 (two tokens). Seq 1: r = 5/4 then padding."""
    train = torch.tensor([[L(0.25), L(0.6)], [L(0.5), 0.0]])
    rollout = torch.tensor([[L(0.5), L(0.2)], [L(0.4), -7.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    return train, rollout, mask


@pytest.mark.parametrize("mode, clip_min, clip_max, expected", [
    ("token_truncate", None, 2.0, [[0.5, 2.0], [1.25, 1.0]]),         # padding: delta 0 -> 1
    ("token_truncate", 0.8, 2.0, [[0.8, 2.0], [1.25, 1.0]]),
    ("token_mask", 0.8, 2.0, [[0.0, 0.0], [1.25, 1.0]]),
    ("sequence_truncate", None, 2.0, [[1.5], [1.25]]),                 # 1/2 * 3 = 1.5
    ("sequence_truncate", None, 1.2, [[1.2], [1.2]]),
    ("sequence_mask", 0.5, 1.3, [[0.0], [1.25]]),
    ("geometric_truncate", None, 2.0, [[math.sqrt(1.5)], [1.25]]),     # geometric mean of 1/2, 3
    ("geometric_mask", 0.9, 1.2, [[0.0], [0.0]]),                      # sqrt(1.5) = 1.22 > 1.2
    ("geometric_mask", 0.9, 1.3, [[math.sqrt(1.5)], [1.25]]),
])
def test_weights_hand_derived(mode, clip_min, clip_max, expected):
    train, rollout, mask = _hand_case()
    w = importance_weights(train, rollout, mask, mode, clip_max=clip_max, clip_min=clip_min)
    assert torch.allclose(w.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6)


def test_metrics_hand_derived():
    train, rollout, mask = _hand_case()
    m = correction_metrics(train, rollout, mask, "token_truncate", clip_max=2.0)
    w = [0.5, 2.0, 1.25]  # the three response tokens; r = 3 truncated to 2
    assert m["is_ratio_mean"] == pytest.approx(sum(w) / 3)
    assert (m["is_ratio_min"], m["is_ratio_max"]) == (pytest.approx(0.5), pytest.approx(2.0))
    assert m["clipped_frac"] == pytest.approx(1 / 3)
    assert m["ess"] == pytest.approx(sum(w) ** 2 / (3 * sum(x * x for x in w)))
    d = [L(0.5), L(3), L(1.25)]
    assert m["kl_k1"] == pytest.approx(-sum(d) / 3)
    assert m["kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 3)
    assert m["abs_logp_diff_max"] == pytest.approx(L(3))
    # per sequence: mean rollout logp - mean train logp, then the mean over sequences
    seq0 = (L(0.5) + L(0.2)) / 2 - (L(0.25) + L(0.6)) / 2
    seq1 = L(0.4) - L(0.5)
    assert m["log_ppl_diff"] == pytest.approx((seq0 + seq1) / 2)
    s = correction_metrics(train, rollout, mask, "sequence_mask", clip_min=0.5, clip_max=1.3)
    assert s["clipped_frac"] == pytest.approx(0.5) and s["is_ratio_max"] == pytest.approx(1.25)


def test_bad_arguments_are_refused():
    train, rollout, mask = _hand_case()
    with pytest.raises(ValueError, match="unknown importance sampling mode"):
        importance_weights(train, rollout, mask, "token_clip")
    with pytest.raises(ValueError, match="clip_min 3 is above clip_max 2"):
        importance_weights(train, rollout, mask, "token_mask", clip_max=2, clip_min=3)
    with pytest.raises(ValueError, match="one shape"):
        importance_weights(train, rollout[:, :1], mask, "token_mask")


def _random_inputs(seed=0, b=6, t=9):
    g = torch.Generator().manual_seed(seed)
    train = -torch.rand(b, t, generator=g) * 3
    rollout = train + torch.randn(b, t, generator=g) * 0.4
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    rollout[0, 0] = float("nan")  # a token vLLM could not score
    return train, rollout, mask


def _trl_block():
    """TRL's own code for vllm_importance_sampling_mode, taken from the installed GRPOTrainer."""
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    src = inspect.getsource(trl_grpo.GRPOTrainer._generate_and_score_completions)
    start = src.index("            if self.use_vllm and self.vllm_importance_sampling_correction:\n"
                      "                mask = completion_mask")
    end = src.index("# Compute the per-token log probabilities for the reference model", start)
    return compile(textwrap.dedent(src[start:end]), "trl_grpo_trainer_block", "exec"), trl_grpo


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("clip_min, clip_max", [(None, 2.0), (0.7, 1.6), (0.5, None)])
def test_identical_to_trl(mode, clip_min, clip_max):
    code, trl_grpo = _trl_block()

    class Self:
        use_vllm = True
        vllm_importance_sampling_correction = True
        vllm_importance_sampling_mode = mode
        vllm_importance_sampling_clip_min = clip_min
        vllm_importance_sampling_clip_max = clip_max

    if "truncate" in mode and clip_min is None and clip_max is None:
        pytest.skip("torch.clamp needs a bound")
    train, rollout, mask = _random_inputs()
    scope = {"self": Self(), "completion_mask": mask, "tool_mask": None, "old_per_token_logps": train,
             "sampling_per_token_logps": rollout, "torch": torch, "math": math}
    exec(code, vars(trl_grpo) | scope, scope)
    ours = importance_weights(train, rollout, mask, mode, clip_max=clip_max, clip_min=clip_min)
    theirs = scope["vllm_importance_sampling_ratio"]
    assert ours.shape == theirs.shape
    assert torch.equal(ours, theirs)  # bit-identical, padding included


def _verl():
    pytest.importorskip("tensordict")
    try:
        from verl.trainer.ppo import rollout_corr_helper
    except ImportError as e:
        pytest.skip(f"verl not importable here: {e}")
    return rollout_corr_helper


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold, ours", [(2.0, (None, 2.0)), ("0.7_1.6", (0.7, 1.6))])
def test_identical_to_verl_weights(level, threshold, ours):
    h = _verl()
    train, rollout, mask = _random_inputs(seed=1)
    rollout = torch.nan_to_num(rollout, nan=-1.0)  # verl has no NaN convention
    theirs, metrics = h.compute_rollout_correction_weights(train - rollout, mask, rollout_is=level,
                                                           rollout_is_threshold=threshold)
    kind = "truncate" if ours[0] is None else "mask"
    w = importance_weights(train, rollout, mask, f"{level}_{kind}", clip_max=ours[1], clip_min=ours[0])
    w = w.expand_as(theirs)
    m = mask.bool()
    assert torch.allclose(w[m], theirs[m], rtol=1e-6, atol=0)
    got = correction_metrics(train, rollout, mask, f"{level}_{kind}", clip_max=ours[1], clip_min=ours[0])
    if level == "token":
        assert got["is_ratio_mean"] == pytest.approx(metrics["rollout_is_mean"], rel=1e-5)
        assert got["ess"] == pytest.approx(metrics["rollout_is_eff_sample_size"], rel=1e-5)


def test_identical_to_verl_offpolicy_metrics_and_geometric_filter():
    h = _verl()
    train, rollout, mask = _random_inputs(seed=2)
    rollout = torch.nan_to_num(rollout, nan=-1.0)
    theirs = h.compute_offpolicy_metrics(train, rollout, mask.float())
    ours = correction_metrics(train, rollout, mask)
    assert ours["kl_k1"] == pytest.approx(theirs["kl"], rel=1e-5)
    assert ours["kl_k3"] == pytest.approx(theirs["k3_kl"], rel=1e-5)
    assert ours["log_ppl_diff"] == pytest.approx(theirs["log_ppl_diff"], rel=1e-5, abs=1e-7)
    # verl's geometric filter is on pi_rollout / pi_train: bounds [lo, hi] there are [1/hi, 1/lo] here
    lo, hi = 0.9, 1.05
    keep, _ = h.compute_rollout_rejection_mask(train - rollout, mask, rollout_rs="seq_mean_k1",
                                               rollout_rs_threshold=f"{lo}_{hi}")
    w = importance_weights(train, rollout, mask, "geometric_mask", clip_min=1 / hi, clip_max=1 / lo)
    kept_ours = (w[:, 0] > 0)
    kept_verl = (keep * mask).sum(-1) > 0
    assert kept_ours.any() and not kept_ours.all()  # the bounds actually split this batch
    assert torch.equal(kept_ours, kept_verl)


def test_verl_hook_adds_token_metrics_to_verls_step_metrics(monkeypatch):
    """flashrl_tools/verl_metrics.py, the Ray setup hook issue 44's runs install: verl's own entry point (with
    TIS off, as an arm without correction runs it) returns verl's metrics plus the token-level mean and p99
    |d log p| and the share of ratios above 2, equal to mismatch_metrics; installing twice wraps once."""
    h = _verl()
    from flashrl_tools import verl_metrics

    monkeypatch.setattr(h, "compute_offpolicy_metrics", h.compute_offpolicy_metrics)  # restored after the test
    verl_metrics.install()
    wrapped = h.compute_offpolicy_metrics
    verl_metrics.install()
    assert h.compute_offpolicy_metrics is wrapped
    train, rollout, mask = _random_inputs(seed=3)
    rollout = torch.nan_to_num(rollout, nan=-1.0)
    _, _, metrics = h.compute_rollout_correction_and_rejection_mask(train, rollout, mask.float(), rollout_is=None)
    ours = mismatch_metrics(train, rollout, mask)
    assert metrics["rollout_corr/flashrl_abs_logp_diff_mean"] == pytest.approx(ours.mean_abs_log_ratio, rel=1e-6)
    assert metrics["rollout_corr/flashrl_abs_logp_diff_p99"] == pytest.approx(ours.p99_abs_log_ratio, rel=1e-6)
    assert metrics["rollout_corr/flashrl_ratio_above_2"] == pytest.approx(ours.tis_truncated_frac)
    assert 0 < ours.tis_truncated_frac < 1 and ours.p99_abs_log_ratio > ours.mean_abs_log_ratio
    assert "rollout_corr/kl" in metrics and "rollout_corr/rollout_is_mean" not in metrics  # verl's own, no TIS


def test_all_modes_listed():
    train, rollout, mask = _random_inputs()
    for mode in MODES:
        w = importance_weights(train, rollout, mask, mode, clip_max=2.0, clip_min=0.5)
        assert torch.isfinite(w).all() and (w >= 0).all()
