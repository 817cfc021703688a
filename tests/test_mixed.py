"""Mixed precision (`keep_bf16`, `first_layers_bf16`, `last_layers_bf16`): which weights stay BF16,
the checkpoint and config that say so, the config keys, and the runtime's online checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli
from flashrl_tools.errors import FlashRLError
from flashrl_tools.quant.mixed import KeepSpec, kept_weights, parse_keep_args, unit_of, units
from flashrl_tools.quant.quantize import quantize
from flashrl_tools.quant.quantizer import QuantFn
from flashrl_tools.safetensors_io import CheckpointReader

LEAVES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
          "mlp.up_proj", "mlp.down_proj")
NAMES = {f"model.layers.{i}.{leaf}.weight" for i in range(4) for leaf in LEAVES}


def test_fused_partners_are_kept_together():
    kept = kept_weights(NAMES, KeepSpec(("model.layers.1.self_attn.k_proj",)))
    assert kept == {f"model.layers.1.self_attn.{x}_proj.weight" for x in "qkv"}
    kept = kept_weights(NAMES, KeepSpec(("*.up_proj",)))
    assert kept == {f"model.layers.{i}.mlp.{x}_proj.weight" for i in range(4) for x in ("gate", "up")}
    # a fused unit's own name works as a pattern too
    assert kept_weights(NAMES, KeepSpec(("model.layers.0.self_attn.qkv_proj",))) == \
        kept_weights(NAMES, KeepSpec(("model.layers.0.self_attn.q_proj",)))
    assert len(units(NAMES)) == 4 * 4 and unit_of("model.layers.3.mlp.experts.7.w1.weight") == "model.layers.3.mlp.experts"


def test_first_and_last_layers():
    kept = kept_weights(NAMES, KeepSpec(first_layers=1, last_layers=2))
    assert {int(n.split(".")[2]) for n in kept} == {0, 2, 3} and len(kept) == 3 * 7
    assert kept_weights(NAMES, KeepSpec()) == set()
    spec = KeepSpec(("*.o_proj", "a b"), 1, 2)
    assert parse_keep_args(spec.cli_args()) == spec


@pytest.mark.parametrize("spec, message", [
    (KeepSpec(("*.nothing",)), "matches no linear layer"),
    (KeepSpec(first_layers=3, last_layers=2), "the model has 4 layers"),
])
def test_bad_keep_specs_are_clear_errors(spec, message):
    with pytest.raises(FlashRLError, match=message):
        kept_weights(NAMES, spec, "model")


def test_moe_experts_cannot_be_kept_attention_can():
    names = {f"model.layers.0.mlp.experts.{e}.{x}_proj.weight" for e in range(4) for x in ("gate", "up", "down")}
    names |= {"model.layers.0.self_attn.q_proj.weight"}
    with pytest.raises(FlashRLError, match="MoE experts"):
        kept_weights(names, KeepSpec(first_layers=1))
    assert kept_weights(names, KeepSpec(("*.self_attn.*",))) == {"model.layers.0.self_attn.q_proj.weight"}


@pytest.mark.parametrize("fn", ["int8", "fp8_block"])
def test_quantize_keeps_layers_bf16_and_its_config_says_so(tiny_models, tmp_path, fn):
    """Every tensor of the output checked against the config: kept linears are the BF16 source
    tensors without scales and listed in `ignore`, the others 8-bit."""
    src = tiny_models["qwen2-untied"]
    res = quantize(src, tmp_path / "q", fn, keep=KeepSpec(("*.0.mlp.gate_proj",), last_layers=1))
    ignore = json.loads((res.out / "config.json").read_text())["quantization_config"]["ignore"]
    kept = {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"} | {
        f"model.layers.1.{leaf}" for leaf in LEAVES}
    assert set(ignore) == kept | {"lm_head"} and sorted(res.kept_bf16) == sorted(f"{m}.weight" for m in kept)
    bf16, q = CheckpointReader(src), CheckpointReader(res.out)
    for name in bf16.names():
        module = name.removesuffix(".weight")
        if module in kept:
            assert f"{name}_scale" not in q and torch.equal(q.get(name), bf16.get(name)), name
        elif name in res.quantized:
            assert q.get(name).dtype == (torch.int8 if fn == "int8" else torch.float8_e4m3fn), name
    assert len(res.quantized) == 2 * 7 - len(kept)


def test_setup_writes_keys_and_refuses_bad_values(tmp_path):
    cfg = tmp_path / "c.yaml"
    res = run_cli("setup", "--fn", "int8", "-o", cfg, "keep_bf16=*.down_proj", "first_layers_bf16=2")
    assert res.returncode == 0, res.stderr
    text = cfg.read_text()
    assert "- '*.down_proj'" in text and "first_layers_bf16: 2" in text
    res = run_cli("setup", "--fn", "int8", "-o", cfg, "keep_bf16=[*.down_proj, *.o_proj]", "--append")
    assert res.returncode == 0 and "- '*.o_proj'" in cfg.read_text()
    for bad, message in ((["--fn", "int8", "last_layers_bf16=-1"], "greater than or equal to 0"),
                         (["--fn", "bf16", "first_layers_bf16=1"], "need an 8-bit fn"),
                         (["--fn", "fp8", "keep_bf16=*.o_proj"], "fp8_tensor")):
        out = tmp_path / "bad.yaml"
        res = run_cli("setup", "-o", out, *bad)
        assert res.returncode == 2 and message in " ".join(res.stderr.split()) and not out.exists(), res.stderr


def test_runtime_serves_an_online_checkpoint_with_the_kept_layers(tiny_models, tmp_path, monkeypatch):
    """FLASHRL_CONFIG=<mixed yaml>: the engine is pointed at an online checkpoint whose kept layers
    are BF16; the sync converter quantizes exactly the others. Bad patterns stop it with one error."""
    from flashrl_tools.config.resolve import resolve
    from flashrl_tools.runtime.core.convert import WeightConverter
    from flashrl_tools.runtime import engine_capabilities
    from flashrl_tools.runtime.core.plan import start

    monkeypatch.setenv("FLASHRL_HOME", str(tmp_path / "home"))
    src = tiny_models["llama-untied"]
    cfg = tmp_path / "c.yaml"
    assert run_cli("setup", "--fn", "int8", "-o", cfg, "keep_bf16=*.o_proj").returncode == 0
    served = start(resolve(str(cfg)), str(src), engine_capabilities("vllm")).checkpoint
    reader = CheckpointReader(served)
    assert reader.dtype("model.layers.0.self_attn.o_proj.weight") == torch.bfloat16
    assert reader.dtype("model.layers.0.self_attn.q_proj.weight") == torch.int8
    conv = WeightConverter.for_checkpoint(resolve(str(cfg)).fn, served, None)
    assert conv.quantized == set(quantize(src, tmp_path / "full", QuantFn.int8).quantized) - {
        f"model.layers.{i}.self_attn.o_proj.weight" for i in range(2)}
    cfg.write_text(cfg.read_text().replace("'*.o_proj'", "'*.nope'"))
    with pytest.raises(FlashRLError, match="matches no linear layer"):
        start(resolve(str(cfg)), str(src), engine_capabilities("vllm"))


def test_profile_of_a_mixed_checkpoint_leaves_the_kept_layers_out(tiny_models, tmp_path):
    from flashrl_tools.profile.build import build_profile

    src = tiny_models["qwen3-untied"]
    res = quantize(src, tmp_path / "q", "int8", keep=KeepSpec(first_layers=1))
    profile = build_profile(src, res.out, "int8").profile
    assert sorted(profile.meta.quantized) == sorted(res.quantized) and len(res.quantized) == 7
    assert all(profile.linear(n) is None for n in res.kept_bf16)
