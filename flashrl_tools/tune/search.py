"""Sensitivity of each unit, the KL-vs-8-bit-fraction curve, and the pick against a budget; then, from that pick,
the 4-bit step: the 8-bit units least sensitive at 4 bits moved there while the KL stays under the budget.

Pure functions over a `measure(quantized_units) -> KL` callable, so the search is testable with
a synthetic KL and runs on the fake-quantized model (fakequant.py) in `flashrl tune`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Point:
    kept: int  # number of units in BF16 (the most sensitive first)
    fraction_8bit: float  # of linear-weight bytes
    kl: float

    def to_dict(self) -> dict:
        return asdict(self)


def sensitivities(unit_names: list[str], measure: Callable[[set[str]], float],
                  progress: Callable[[int, int], None] = lambda i, n: None) -> dict[str, float]:
    """KL with only this unit quantized (the rest BF16), per unit."""
    out = {}
    for i, unit in enumerate(unit_names):
        out[unit] = measure({unit})
        progress(i + 1, len(unit_names))
    return out


def ranking(sens: dict[str, float]) -> list[str]:
    """Units, most sensitive first (ties: model order)."""
    order = list(sens)
    return sorted(order, key=lambda u: (-sens[u], order.index(u)))


def grid(n: int) -> list[int]:
    """How many units to keep at each curve point: 0, 1, 2, 3, 4, 6, 8, 12, 16, ... n."""
    ks, k = {0, n}, 1
    while k < n:
        ks.update({k, min(n, k + k // 2)} if k >= 2 else {k})
        k *= 2
    return sorted(x for x in ks if x <= n)


def curve(order: list[str], unit_bytes: dict[str, int], measure: Callable[[set[str]], float],
          ks: list[int], progress: Callable[[int, int], None] = lambda i, n: None) -> list[Point]:
    total = sum(unit_bytes.values())
    points = []
    for i, k in enumerate(ks):
        quantized = set(order[k:])
        points.append(Point(k, sum(unit_bytes[u] for u in quantized) / total, measure(quantized)))
        progress(i + 1, len(ks))
    return points


def pick(order: list[str], unit_bytes: dict[str, int], measure: Callable[[set[str]], float], points: list[Point],
         target: float) -> Point | None:
    """The fewest kept units whose KL <= target: the first curve point under the target, refined by
    bisection between it and the curve point before it (KL falls with k, near enough monotonically).
    None when even the last point misses."""
    ok = [p for p in points if p.kl <= target]
    if not ok:
        return None
    best = min(ok, key=lambda p: p.kept)
    below = max((p for p in points if p.kept < best.kept), key=lambda p: p.kept, default=None)
    lo = below.kept if below is not None else best.kept  # nothing below the curve's first point
    total = sum(unit_bytes.values())
    while best.kept - lo > 1:
        mid = (lo + best.kept) // 2
        quantized = set(order[mid:])
        p = Point(mid, sum(unit_bytes[u] for u in quantized) / total, measure(quantized))
        if p.kl <= target:
            best = p
        else:
            lo = mid
    return best


W4_BYTES = 0.5 + 2 / 128  # bytes per parameter of a W4A16 weight: packed codes + one BF16 scale per 128 columns


def bytes_vs_bf16(unit_bytes: dict[str, int], kept: set[str], four: set[str]) -> float:
    """Linear-weight bytes of a BF16 / 8-bit / 4-bit mix over the all-BF16 model's."""
    per = {u: 1.0 if u in kept else W4_BYTES / 2 if u in four else 0.5 for u in unit_bytes}
    return sum(unit_bytes[u] * per[u] for u in unit_bytes) / sum(unit_bytes.values())


@dataclass(frozen=True)
class FourPoint:
    four: int  # units moved from 8 to 4 bits (the least sensitive first)
    bytes_vs_bf16: float
    kl: float

    def to_dict(self) -> dict:
        return asdict(self)


def four_bit_curve(order: list[str], unit_bytes: dict[str, int], kept: set[str], measure: Callable[[set[str]], float],
                   progress: Callable[[int, int], None] = lambda i, n: None) -> list[FourPoint]:
    """KL with the first m units of `order` (least sensitive at 4 bits first) at 4 bits, m on `grid`."""
    points = []
    ms = grid(len(order))
    for i, m in enumerate(ms):
        four = set(order[:m])
        points.append(FourPoint(m, bytes_vs_bf16(unit_bytes, kept, four), measure(four)))
        progress(i + 1, len(ms))
    return points


def pick_four(points: list[FourPoint], target: float) -> list[FourPoint]:
    """The curve points under the target, most units at 4 bits first (the candidates to verify)."""
    return sorted((p for p in points if p.kl <= target and p.four > 0), key=lambda p: -p.four)
