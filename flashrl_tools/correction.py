"""Rollout correction (pure torch): importance weights and the metrics trainers log.

Conventions (as TRL and verl): `logp_train` and `logp_rollout` are log-probabilities of the
*sampled* tokens, shape [batch, tokens]; `mask` is 1 for response tokens, 0 for padding.

Sign: the per-token log-ratio is  delta = logp_train - logp_rollout  (positive: the trainer likes
the token more than the engine that sampled it); the importance weight is r = exp(delta) =
pi_train / pi_rollout; TIS weights are min(r, C).

Modes of `importance_weights` (names as TRL's `vllm_importance_sampling_mode`):
  token_truncate      w_t = clamp(r_t, clip_min, clip_max)              TIS (FlashRL: C = 2)
  token_mask          w_t = r_t if clip_min <= r_t <= clip_max else 0    token MIS (verl "IcePop")
  sequence_truncate   w   = clamp(exp(sum_t delta_t), clip_min, clip_max)  one weight per sequence
  sequence_mask       w   = exp(sum_t delta_t) if inside the bounds else 0
  geometric_truncate  as sequence_truncate with the geometric-mean ratio exp(mean_t delta_t)
  geometric_mask      as sequence_mask with the geometric-mean ratio (verl's seq_mean_k1 filter)
Token modes return [batch, tokens]; sequence/geometric modes return [batch, 1] (broadcast over
the tokens, as TRL). Padding tokens contribute delta = 0, NaN logprobs (a token the engine could
not score) count as delta = 0 (TRL). `clip_min=None` means no lower bound.

Equivalences (tested in tests/test_correction.py):
- TRL 1.16 `GRPOTrainer` (`trl/trainer/grpo_trainer.py`, the `vllm_importance_sampling_mode`
  block): identical for all four of its modes, padding included.
- verl 0.9.1 `verl/trainer/ppo/rollout_corr_helper.py`: `compute_rollout_correction_weights`
  rollout_is="token"/"sequence" with threshold C == token/sequence_truncate(clip_max=C); with
  threshold "lo_hi" (IcePop) == token/sequence_mask(lo, hi); identical on response tokens (verl
  also zeroes padding and clamps log-ratios to +-20 before exp: equal while |sum delta| <= 20).
  verl's rejection filter seq_mean_k1 "lo_hi" keeps a sequence when mean(logp_rollout -
  logp_train) is in [ln lo, ln hi] -- the inverse ratio: == geometric_mask(1/hi, 1/lo).
"""

from __future__ import annotations

import math
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


MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask",
         "geometric_truncate", "geometric_mask")


def _check(logp_train, logp_rollout, mask, mode, clip_min, clip_max) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown importance sampling mode {mode!r}; use one of {', '.join(MODES)}")
    if logp_train.shape != logp_rollout.shape or mask.shape != logp_train.shape or logp_train.dim() != 2:
        raise ValueError(f"expected [batch, tokens] tensors of one shape: train {tuple(logp_train.shape)}, "
                         f"rollout {tuple(logp_rollout.shape)}, mask {tuple(mask.shape)}")
    if clip_max is not None and clip_max <= 0 or clip_min is not None and clip_min < 0:
        raise ValueError(f"bounds must be positive: clip_min={clip_min}, clip_max={clip_max}")
    if clip_min is not None and clip_max is not None and clip_min > clip_max:
        raise ValueError(f"clip_min {clip_min} is above clip_max {clip_max}")


def _bounds(clip_min: float | None, clip_max: float | None) -> tuple[float, float]:
    return (-math.inf if clip_min is None else clip_min), (math.inf if clip_max is None else clip_max)


def importance_log_ratio(logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
                         level: str = "token") -> torch.Tensor:
    """log r per token ([B, T]), per sequence (sum, [B, 1]) or geometric (mean, [B, 1])."""
    m = mask.to(logp_train.dtype)
    delta = torch.nan_to_num((logp_train - logp_rollout) * m, nan=0.0)
    if level == "token":
        return delta
    total = delta.sum(-1, keepdim=True)
    if level == "sequence":
        return total
    if level == "geometric":
        return total / m.sum(-1, keepdim=True).clamp_min(1)
    raise ValueError(f"unknown level {level!r}; use token, sequence or geometric")


def importance_weights(logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
                       mode: str = "token_truncate", clip_max: float | None = 2.0,
                       clip_min: float | None = None) -> torch.Tensor:
    """Rollout-correction weights (no gradient); multiply the per-token policy loss by them."""
    _check(logp_train, logp_rollout, mask, mode, clip_min, clip_max)
    level, kind = mode.split("_")
    with torch.no_grad():
        ratio = torch.exp(importance_log_ratio(logp_train, logp_rollout, mask, level))
        if kind == "truncate":
            return ratio if clip_min is None and clip_max is None else torch.clamp(ratio, clip_min, clip_max)
        lo, hi = _bounds(clip_min, clip_max)
        return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def correction_metrics(logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
                       mode: str = "token_truncate", clip_max: float | None = 2.0,
                       clip_min: float | None = None) -> dict[str, float]:
    """What a trainer logs per step. Token modes count tokens, sequence modes count sequences.

    is_ratio_mean/min/max  the applied weights (TRL: sampling/importance_sampling_ratio/*)
    clipped_frac           share whose raw ratio left [clip_min, clip_max] (truncated or masked)
    ess                    normalised effective sample size of the applied weights, 1/mean((w/mean w)^2)
    kl_k1, kl_k3           KL(pi_rollout || pi_train) estimates per token (verl: kl, k3_kl)
    log_ppl_diff           mean over sequences of (mean logp_rollout - mean logp_train) (verl)
    abs_logp_diff_mean/max |delta| over response tokens (TRL: sampling/sampling_logp_difference/*)
    """
    w = importance_weights(logp_train, logp_rollout, mask, mode, clip_max, clip_min)
    level = mode.split("_")[0]
    m = mask.bool()
    seqs = m.any(-1)
    if not seqs.any():
        raise ValueError("the mask selects no tokens")
    raw = torch.exp(importance_log_ratio(logp_train, logp_rollout, mask, level))
    if level == "token":
        w_sel, raw_sel = w[m], raw[m]
    else:
        w_sel, raw_sel = w[seqs, 0], raw[seqs, 0]
    lo, hi = _bounds(clip_min, clip_max)
    ess = normalized_ess(torch.log(w_sel.double())) if (w_sel > 0).any() else 0.0
    delta = (logp_train.double() - logp_rollout.double())
    d = delta[m & ~torch.isnan(delta)]
    mf = m.double()
    n = mf.sum(-1).clamp_min(1)
    seq_mean_train = (torch.nan_to_num(logp_train.double()) * mf).sum(-1) / n
    seq_mean_rollout = (torch.nan_to_num(logp_rollout.double()) * mf).sum(-1) / n
    return {
        "is_ratio_mean": float(w_sel.double().mean()),
        "is_ratio_min": float(w_sel.min()),
        "is_ratio_max": float(w_sel.max()),
        "clipped_frac": float(((raw_sel < lo) | (raw_sel > hi)).double().mean()),
        "ess": ess,
        "kl_k1": float((-d).mean()),
        "kl_k3": float((torch.exp(d) - 1 - d).mean()),
        "log_ppl_diff": float((seq_mean_rollout - seq_mean_train)[seqs].mean()),
        "abs_logp_diff_mean": float(d.abs().mean()),
        "abs_logp_diff_max": float(d.abs().max()),
    }
