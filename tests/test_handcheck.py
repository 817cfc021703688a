"""The hand computations the SGLang GPU check compares sampled-token logprobs with."""

import math

import torch

from flashrl_tools.verify.handcheck import tempered, truncated


def test_tempered_equals_log_softmax_of_scaled_logits():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 3
    t1 = torch.log_softmax(logits.double(), -1).tolist()
    for temp in (0.3, 0.8, 1.0, 1.7):
        want = torch.log_softmax(logits.double() / temp, -1)
        assert all(abs(tempered(t1, tok, temp) - want[tok].item()) < 1e-12 for tok in range(50))


def test_truncated_renormalises_over_top_k_and_top_p():
    probs = [0.5, 0.2, 0.15, 0.1, 0.05]
    lp = [math.log(p) for p in probs]
    # top_p 0.6: 0.5 kept (0 before), 0.2 kept (0.5 before), 0.15 dropped (0.7 before)
    got, inside = truncated(lp, 1, top_k=10, top_p=0.6)
    assert inside and abs(got - math.log(0.2 / 0.7)) < 1e-12
    got, inside = truncated(lp, 0, top_k=1, top_p=1.0)  # top_k 1: greedy, log 1
    assert inside and abs(got) < 1e-12
    got, inside = truncated(lp, 3, top_k=2, top_p=1.0)  # outside the support: joins it
    assert not inside and abs(got - math.log(0.1 / 0.8)) < 1e-12
    got, _ = truncated(lp, 2, top_k=-1, top_p=1.0)  # no truncation: the distribution itself
    assert abs(got - lp[2]) < 1e-12


def test_a_wrong_temperature_or_support_is_seen():
    lp = torch.log_softmax(torch.tensor([2.0, 1.0, 0.5, -1.0], dtype=torch.float64), -1).tolist()
    assert abs(tempered(lp, 0, 0.7) - tempered(lp, 0, 1.0)) > 0.05
    assert abs(truncated(lp, 0, 2, 1.0)[0] - truncated(lp, 0, 3, 1.0)[0]) > 0.01


def test_verify_reload_reference_for_sglang_is_the_format_sglang_serves(default_model, tmp_path):
    """`verify reload --engine sglang` with `fp8`: SGLang serves per-channel FP8 checkpoints, so the
    fresh reference is the offline fp8_channel quantization (plain engine), not vLLM's online FP8."""
    from flashrl_tools.config.resolve import resolve
    from flashrl_tools.safetensors_io import CheckpointReader
    from flashrl_tools.verify.reload import reference_model

    rc = resolve("fp8")
    assert reference_model(rc, default_model, tmp_path / "v") == (default_model, "fp8")
    model, config = reference_model(rc, default_model, tmp_path / "s", "sglang")
    assert config is None and model == tmp_path / "s"
    scales = [n for n in CheckpointReader(model).names() if n.endswith("q_proj.weight_scale")]
    assert scales and CheckpointReader(model).shape(scales[0])[0] > 1  # one scale per output channel
