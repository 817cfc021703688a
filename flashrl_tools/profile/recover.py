"""Recover SmoothQuant factors from a (BF16, calibrated INT8) pair, and score a profile.

For one smoothing group (the linears fed by one norm, or down_proj fed by up_proj) SmoothQuant
multiplied every input column j of the group's weights by a factor m_j, then the INT8 weights
were computed from the smoothed weights. Per column we
1. seed m_j with the ratio of the BF16 norm weight to the checkpoint's (exact up to one bf16
   rounding); where there is no norm (down_proj) or it is zero, with least squares of the
   dequantized INT8 column against the BF16 column over every row of the group (the
   `least_square` of flash-llm-rl);
2. refine it exactly: llmcompressor's factors are bf16 numbers (activation and weight ranges
   of a bf16 model), so we try the bf16 values next to the seed and keep the one whose
   re-quantization reproduces the most INT8 entries (ties: the norm weight, then the seed).
Columns are processed in chunks, so memory stays bounded for 7B-sized layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashrl_tools.quant.quantizer import (
    INT8_MAX,
    INT8_MIN,
    int8_quotient,
    requantize_int8,
    smooth_norm,
    smooth_weight,
)

_CHUNK_ELEMENTS = 1 << 22  # rows x columns handled at once (x a few fp32 temporaries)
_NEIGHBOURS = (0, -1, 1, -2, 2)  # bf16 steps around the seed, nearest first


@dataclass(frozen=True)
class Member:
    """One linear of a smoothing group: BF16 weight, the checkpoint's INT8 weight and scale,
    and the row divisor already known for it (up_proj's rows, from the down_proj group)."""

    weight: torch.Tensor
    qweight: torch.Tensor
    scale: torch.Tensor
    row_div: torch.Tensor | None = None


@dataclass(frozen=True)
class Stats:
    """How well re-quantizing the BF16 weight with the profile reproduces the checkpoint."""

    entries: int
    exact: int
    max_abs_diff: int  # in INT8 steps
    clipped: int  # entries whose quotient leaves [-128.5, 127.5)

    @property
    def exact_fraction(self) -> float:
        return self.exact / self.entries if self.entries else 1.0

    @property
    def clip_fraction(self) -> float:
        return self.clipped / self.entries if self.entries else 0.0

    def __add__(self, other: Stats) -> Stats:
        return Stats(self.entries + other.entries, self.exact + other.exact,
                     max(self.max_abs_diff, other.max_abs_diff), self.clipped + other.clipped)


def score(member: Member, col_mul: torch.Tensor | None) -> Stats:
    """Re-quantize member.weight with (scale, col_mul, row_div) and compare with member.qweight."""
    total = Stats(0, 0, 0, 0)
    for cols in _column_chunks(member.weight.shape):
        w = member.weight[:, cols]
        cm = None if col_mul is None else col_mul[cols]
        smoothed = smooth_weight(w, cm, member.row_div)
        q = requantize_int8(w, member.scale, cm, member.row_div)
        diff = (q.to(torch.int16) - member.qweight[:, cols].to(torch.int16)).abs()
        x = torch.round(int8_quotient(smoothed, member.scale))
        clipped = int(((x > INT8_MAX) | (x < INT8_MIN)).sum())
        total = total + Stats(diff.numel(), int((diff == 0).sum()), int(diff.max()) if diff.numel() else 0,
                              clipped)
    return total


def fit_factors(members: list[Member], norm: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Per-input-column smoothing factors (fp32 tensor of bf16 values) shared by `members`."""
    cols_total = members[0].weight.shape[1]
    factors = torch.ones(cols_total, dtype=torch.float32)
    rows = sum(m.weight.shape[0] for m in members)
    for cols in _column_chunks((rows, cols_total)):
        seed = _least_squares_seed(members, cols)
        if norm is not None:
            nb, nq = norm[0][cols].float(), norm[1][cols].float()
            usable = (nb != 0) & (nq != 0) & ((nb > 0) == (nq > 0))
            seed = torch.where(usable, nb / torch.where(usable, nq, 1), seed)
        candidates = _bf16_neighbours(seed)  # [K, c]
        votes = torch.zeros(candidates.shape, dtype=torch.float64)
        for k in range(candidates.shape[0]):
            for m in members:
                w = m.weight[:, cols]
                q = requantize_int8(w, m.scale, candidates[k], m.row_div)
                votes[k] += (q == m.qweight[:, cols]).sum(0).double()
            if norm is not None:  # tie-break: bf16(norm / m) must give the checkpoint's norm
                nb, nq = norm[0][cols], norm[1][cols]
                votes[k] += 0.5 * (smooth_norm(nb, candidates[k]) == nq).double()
        best = votes.argmax(0)  # first maximum: nearest to the seed wins ties
        factors[cols] = candidates.gather(0, best[None])[0]
    return factors


def _least_squares_seed(members: list[Member], cols: slice) -> torch.Tensor:
    num = den = 0
    for m in members:
        w = m.weight[:, cols].float()
        if m.row_div is not None:
            w = w / m.row_div.float()[:, None]
        deq = m.qweight[:, cols].float() * m.scale.float()
        num = num + (deq * w).sum(0)
        den = den + (w * w).sum(0)
    seed = torch.where(den > 0, num / torch.where(den > 0, den, 1), torch.ones_like(num))
    return torch.where(seed > 0, seed, torch.ones_like(seed))


def _bf16_neighbours(seed: torch.Tensor) -> torch.Tensor:
    """Candidate factors: bf16 numbers a few steps around the seed (positive, so bit steps)."""
    bits = seed.to(torch.bfloat16).view(torch.int16)
    steps = torch.tensor(_NEIGHBOURS, dtype=torch.int16)[:, None]
    return (bits[None, :] + steps).view(torch.bfloat16).float()


def _column_chunks(shape: tuple[int, ...]):
    rows, cols = shape
    step = max(1, _CHUNK_ELEMENTS // max(rows, 1))
    for start in range(0, cols, step):
        yield slice(start, min(cols, start + step))
