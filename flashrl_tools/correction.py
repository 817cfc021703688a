"""Rollout-vs-trainer mismatch metrics (pure torch).

Conventions (as verl / TRL): `logp_train` and `logp_rollout` are log-probabilities of the
*sampled* tokens, shape [batch, tokens]; `mask` is 1 for response tokens, 0 for padding.
The per-token log-ratio is  delta = logp_train - logp_rollout  (positive: the trainer likes the
token more than the engine that sampled it), the importance weight is r = exp(delta) =
pi_train / pi_rollout, and the truncated IS (TIS) weight is min(r, C).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class MismatchMetrics:
    tokens: int
    sequences: int
    mean_abs_log_ratio: float  # mean |delta| per token
    p99_abs_log_ratio: float  # 99th percentile of |delta|
    kl_k3: float  # mean of r - 1 - log r: estimates KL(pi_rollout || pi_train) from rollout samples
    seq_log_ratio_mean: float  # per sequence: sum of delta over its tokens
    seq_log_ratio_std: float
    seq_log_ratio_min: float
    seq_log_ratio_max: float
    ppl_ratio: float  # perplexity of the sampled tokens under the trainer / under the rollout engine
    tis_truncated_frac: float  # fraction of tokens with r > C (their TIS weight is clipped at C)
    ess_token: float  # normalised effective sample size of the token weights r, in (0, 1]
    ess_seq: float  # the same for sequence weights exp(sum delta)

    def to_dict(self) -> dict:
        return asdict(self)


def log_ratio(logp_train: torch.Tensor, logp_rollout: torch.Tensor) -> torch.Tensor:
    return logp_train.double() - logp_rollout.double()


def normalized_ess(log_weights: torch.Tensor) -> float:
    """(sum w)^2 / (n sum w^2), computed in log space (weights can be huge)."""
    n = log_weights.numel()
    if n == 0:
        return float("nan")
    lw = log_weights.double()
    return float(torch.exp(2 * torch.logsumexp(lw, 0) - torch.logsumexp(2 * lw, 0)) / n)


def mismatch_metrics(logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
                     tis_cap: float = 2.0) -> MismatchMetrics:
    if logp_train.shape != logp_rollout.shape or mask.shape != logp_train.shape:
        raise ValueError(f"shapes differ: train {tuple(logp_train.shape)}, rollout "
                         f"{tuple(logp_rollout.shape)}, mask {tuple(mask.shape)}")
    m = mask.bool()
    delta = log_ratio(logp_train, logp_rollout)
    d = delta[m]
    if d.numel() == 0:
        raise ValueError("the mask selects no tokens")
    seq = (delta * m).sum(-1)[m.any(-1)]
    r = torch.exp(d)
    lp_train, lp_rollout = logp_train.double()[m], logp_rollout.double()[m]
    return MismatchMetrics(
        tokens=int(d.numel()),
        sequences=int(seq.numel()),
        mean_abs_log_ratio=float(d.abs().mean()),
        p99_abs_log_ratio=float(torch.quantile(d.abs(), 0.99)),
        kl_k3=float((r - 1 - d).mean()),
        seq_log_ratio_mean=float(seq.mean()),
        seq_log_ratio_std=float(seq.std(unbiased=False)),
        seq_log_ratio_min=float(seq.min()),
        seq_log_ratio_max=float(seq.max()),
        ppl_ratio=float(torch.exp(lp_rollout.mean() - lp_train.mean())),
        tis_truncated_frac=float((r > tis_cap).double().mean()),
        ess_token=normalized_ess(d),
        ess_seq=normalized_ess(seq),
    )
