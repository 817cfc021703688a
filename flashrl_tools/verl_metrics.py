"""Token-level mismatch metrics in verl's step log, without changing verl's trainer.

verl 0.9.1 logs the rollout-vs-trainer mismatch per sequence (`rollout_corr/log_ppl_abs_diff`) and the
share of truncated IS weights only when TIS is on. Issue 44 compares arms with and without TIS on the
same per-token measures, so this Ray worker setup hook wraps verl's `compute_offpolicy_metrics` (what its
driver calls once per step, TIS or not) and adds, from `flashrl_tools.correction.mismatch_metrics`:

    rollout_corr/flashrl_abs_logp_diff_mean   mean |log p_train - log p_rollout| over response tokens
    rollout_corr/flashrl_abs_logp_diff_p99    its 99th percentile
    rollout_corr/flashrl_ratio_above_2        share of tokens with p_train / p_rollout > 2 (what TIS at
                                              C = 2 truncates; measured in every arm)

Training is untouched: the wrapper returns verl's own metrics plus these. Enable it with the verl override
`+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=flashrl_tools.verl_metrics.install`
(examples/verl/run_grpo_smollm2.sh does).
"""

from __future__ import annotations

import functools

PREFIX = "flashrl_"


def token_metrics(old_log_prob, rollout_log_prob, response_mask) -> dict[str, float]:
    from flashrl_tools.correction import mismatch_metrics

    m = mismatch_metrics(old_log_prob.detach().float().cpu(), rollout_log_prob.detach().float().cpu(),
                         response_mask.detach().cpu(), tis_cap=2.0)
    return {f"{PREFIX}abs_logp_diff_mean": m.mean_abs_log_ratio, f"{PREFIX}abs_logp_diff_p99": m.p99_abs_log_ratio,
            f"{PREFIX}ratio_above_2": m.tis_truncated_frac}


def install() -> None:
    """Ray's worker_process_setup_hook: runs once in every worker of the job (verl's driver included)."""
    try:
        from verl.trainer.ppo import rollout_corr_helper as helper
    except ImportError:  # a worker without verl (none in verl's jobs): nothing to wrap
        return
    original = helper.compute_offpolicy_metrics
    if getattr(original, "_flashrl", False):
        return

    @functools.wraps(original)
    def compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask):
        metrics = original(old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob,
                           response_mask=response_mask)
        if rollout_log_prob is not None and bool(response_mask.any()):
            metrics.update(token_metrics(old_log_prob, rollout_log_prob, response_mask))
        return metrics

    compute_offpolicy_metrics._flashrl = True
    helper.compute_offpolicy_metrics = compute_offpolicy_metrics
