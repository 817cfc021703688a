"""`flashrl tune`: the search on a synthetic KL, activation fake-quant math, and the command end to
end on a tiny model (fake-quant ranking, verify drift with vLLM, config + report + PNG)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli
from flashrl_tools.quantizer import FP8_MAX, QuantFn, fake_quant_activation
from flashrl_tools.tune import search

SENS = {"a": 0.001, "b": 0.05, "c": 0.0002, "d": 0.02, "e": 0.0001}
BYTES = {"a": 10, "b": 10, "c": 10, "d": 30, "e": 40}


def synthetic(quantized: set[str]) -> float:  # additive KL: each 8-bit unit adds its own share
    return sum(SENS[u] for u in quantized)


def test_search_keeps_the_most_sensitive_units_first():
    sens = search.sensitivities(list(SENS), synthetic)
    assert sens == SENS
    order = search.ranking(sens)
    assert order == ["b", "d", "a", "c", "e"]
    assert search.grid(5) == [0, 1, 2, 3, 4, 5] and search.grid(40)[:8] == [0, 1, 2, 3, 4, 6, 8, 12]
    points = search.curve(order, BYTES, synthetic, search.grid(5))
    assert [p.kept for p in points] == [0, 1, 2, 3, 4, 5]
    assert points[0].fraction_8bit == 1.0 and points[-1].fraction_8bit == 0.0 and points[-1].kl == 0.0
    assert points[2].fraction_8bit == pytest.approx(60 / 100)
    # the fewest kept units under the target; bisection finds it between grid points
    assert search.pick(order, BYTES, synthetic, points, 0.0015).kept == 2
    assert search.pick(order, BYTES, synthetic, points[::4], 0.0015).kept == 2  # grid [0, 4]: refined
    assert search.pick(order, BYTES, synthetic, points, 0.1).kept == 0
    assert search.pick(order, BYTES, synthetic, points, -1.0) is None


def test_activation_fake_quant_matches_the_formats():
    torch.manual_seed(0)
    x = torch.randn(3, 300) * torch.tensor([1.0, 10.0, 0.01])[:, None]
    q = fake_quant_activation(QuantFn.int8, x)
    scale = x.abs().amax(-1, keepdim=True) / 127
    assert torch.allclose(q, torch.round(x / scale) * scale) and len(torch.unique(q[0])) <= 256
    for fn in (QuantFn.fp8_channel, QuantFn.fp8_block):  # e4m3: 3 mantissa bits, per-token scales
        q = fake_quant_activation(fn, x)
        assert q.shape == x.shape and ((q - x).abs() <= x.abs() * 2 ** -4 + 1e-6).all(), fn
    # per tensor: the small row loses resolution, per token it does not
    tensor_err = (fake_quant_activation(QuantFn.fp8_tensor, x) - x)[2].abs().max()
    token_err = (fake_quant_activation(QuantFn.fp8_channel, x) - x)[2].abs().max()
    assert token_err < tensor_err
    # per 128-column group: a group's max maps to FP8_MAX exactly
    g = x[:, 128:256] / (x[:, 128:256].abs().amax(-1, keepdim=True) / FP8_MAX)
    assert g.abs().amax() == pytest.approx(FP8_MAX)


def test_bad_budget_is_one_clear_error(tmp_path):
    res = run_cli("tune", "-m", "default", "-o", tmp_path / "c.yaml", "--max-kl", "-1")
    assert res.returncode == 2 and "--max-kl must be > 0" in res.stderr
    res = run_cli("tune", "-m", "default", "-o", tmp_path / "c.txt")
    assert res.returncode == 2 and ".yaml" in res.stderr
    res = run_cli("tune", "-m", "default", "-o", tmp_path / "c.yaml", "--max-kl", "0.1", "--max-kl-ratio", "2")
    assert res.returncode == 2 and "not both" in res.stderr
    assert not list(tmp_path.iterdir())
