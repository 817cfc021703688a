"""`flashrl quantize` on real checkpoints of several architectures: which tensors get quantized,
the written config parses with vLLM's own classes, sharded output, bad input, streaming memory."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from conftest import run_cli
from flashrl_tools.quant.quantize import quantize
from flashrl_tools.quant.quantizer import QuantFn
from flashrl_tools.safetensors_io import CheckpointReader

PROJ = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")


@pytest.mark.parametrize("key", ["llama-untied", "llama-tied", "qwen2-untied", "qwen2-tied",
                                 "qwen3-untied", "qwen3-tied"])
def test_quantizes_exactly_the_decoder_linears(key, tiny_models, tmp_path):
    src = tiny_models[key]
    out = tmp_path / "q"
    quantize(src, out, QuantFn.int8)
    before, after = CheckpointReader(src), CheckpointReader(out)
    weights = [n for n in before.names() if PROJ.search(n)]
    assert len(weights) == 2 * 7
    for name in before.names():
        if name in weights:
            assert after.dtype(name) == torch.int8
            assert after.shape(f"{name}_scale") == (before.shape(name)[0], 1)
        else:  # embeddings, norms (incl. qwen3 q/k norm), biases (qwen2), lm_head
            assert after.dtype(name) == before.dtype(name), name
            assert torch.equal(after.get(name), before.get(name)), name
    if key.startswith("qwen2"):
        assert any(n.endswith("q_proj.bias") for n in before.names())
    if key.startswith("qwen3"):
        assert any(n.endswith("q_norm.weight") for n in before.names())
    assert ("lm_head.weight" in before.names()) == key.endswith("untied")
    names = set(after.names())
    assert names == set(before.names()) | {f"{n}_scale" for n in weights}
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (out / f).read_bytes() == (src / f).read_bytes()


@pytest.mark.parametrize("fn", list(QuantFn))
def test_config_is_accepted_by_vllm(fn, tiny_models, tmp_path):
    """vLLM's own ModelConfig and CompressedTensorsConfig read the checkpoint and pick the scheme."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    out = tmp_path / fn.value
    quantize(tiny_models["qwen2-untied"], out, fn)
    model_config = ModelConfig(model=str(out))
    assert model_config.quantization == "compressed-tensors"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    ct = CompressedTensorsConfig.from_config(qc)
    assert ct.ignore == ["lm_head"]
    parts = ct.target_scheme_map["Linear"]
    vllm_config = VllmConfig()
    vllm_config.model_config = model_config
    with set_current_vllm_config(vllm_config):  # scheme choice reads the model's dtype
        scheme = ct._get_scheme_from_parts(parts["weights"], parts["input_activations"],
                                           layer_name="model.layers.0.self_attn.q_proj")
    expected = {
        QuantFn.int8: ("CompressedTensorsW8A8Int8", "channel"),
        QuantFn.fp8_channel: ("CompressedTensorsW8A8Fp8", "channel"),
        QuantFn.fp8_tensor: ("CompressedTensorsW8A8Fp8", "tensor"),
        QuantFn.fp8_block: ("CompressedTensorsW8A8Fp8", "block"),
        QuantFn.w4a16: ("CompressedTensorsWNA16", "group"),
    }[fn]
    strategy = getattr(scheme.strategy, "value", scheme.strategy)  # enum or str by scheme
    assert (type(scheme).__name__, strategy) == expected
    if fn is QuantFn.fp8_block:
        assert scheme.weight_block_size == [128, 128]


def test_sharded_output_round_trips(tiny_models, tmp_path):
    src = tiny_models["llama-untied"]
    one, many = tmp_path / "one", tmp_path / "many"
    quantize(src, one, QuantFn.fp8_block)
    quantize(src, many, QuantFn.fp8_block, max_shard_bytes=64 * 1024)
    assert (many / "model.safetensors.index.json").is_file()
    assert len(list(many.glob("model-*-of-*.safetensors"))) > 3
    a, b = CheckpointReader(one), CheckpointReader(many)
    assert sorted(a.names()) == sorted(b.names())
    for name in a.names():
        assert torch.equal(a.get(name).view(torch.uint8), b.get(name).view(torch.uint8)), name
    # and a sharded *input* is read back through its index
    again = tmp_path / "again"
    quantize(_bf16_sharded(src, tmp_path), again, QuantFn.int8)
    assert CheckpointReader(again).dtype("model.layers.0.mlp.up_proj.weight") == torch.int8


def _bf16_sharded(src, tmp_path):
    """A copy of `src` saved by transformers in several shards."""
    from transformers import AutoModelForCausalLM

    dst = tmp_path / "bf16-sharded"
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    model.save_pretrained(dst, max_shard_size="100KB")
    assert (dst / "model.safetensors.index.json").is_file()
    return dst


def _one_line_error(res: subprocess.CompletedProcess, *words: str) -> None:
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    assert "Traceback" not in res.stderr
    for w in words:
        assert w in lines[0], lines[0]


def _no_leftovers(parent, name):
    return [p.name for p in parent.iterdir() if name in p.name]


def test_missing_model_dir(tmp_path):
    res = run_cli("quantize", "-m", tmp_path / "nope", "-o", tmp_path / "out", "--fn", "int8")
    _one_line_error(res, "model directory not found", "nope")
    assert _no_leftovers(tmp_path, "out") == []


def test_not_a_safetensors_model(tiny_models, tmp_path):
    src = tmp_path / "bin-model"
    src.mkdir()
    (src / "config.json").write_bytes((tiny_models["llama-untied"] / "config.json").read_bytes())
    (src / "pytorch_model.bin").write_bytes(b"not safetensors")
    res = run_cli("quantize", "-m", src, "-o", tmp_path / "out", "--fn", "int8")
    _one_line_error(res, "no *.safetensors", str(src))
    assert _no_leftovers(tmp_path, "out") == []


def test_corrupt_safetensors(tiny_models, tmp_path):
    src = tmp_path / "corrupt"
    src.mkdir()
    (src / "config.json").write_bytes((tiny_models["llama-untied"] / "config.json").read_bytes())
    (src / "model.safetensors").write_bytes(b"version https://git-lfs.github.com/spec/v1\n")
    res = run_cli("quantize", "-m", src, "-o", tmp_path / "out", "--fn", "int8")
    _one_line_error(res, "not a readable safetensors file")
    assert _no_leftovers(tmp_path, "out") == []


def test_unknown_fn(tiny_models, tmp_path):
    res = run_cli("quantize", "-m", tiny_models["llama-untied"], "-o", tmp_path / "out", "--fn", "int4")
    _one_line_error(res, "int4", "fp8_block")
    assert _no_leftovers(tmp_path, "out") == []


def test_existing_output_needs_force(tiny_models, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    res = run_cli("quantize", "-m", tiny_models["llama-untied"], "-o", out, "--fn", "int8")
    _one_line_error(res, "already exists", "--force")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert _no_leftovers(tmp_path, "out") == ["out"]
    res = run_cli("quantize", "-m", tiny_models["llama-untied"], "-o", out, "--fn", "int8", "--force")
    assert res.returncode == 0, res.stderr
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


def test_failure_midway_leaves_nothing(tiny_models, tmp_path, monkeypatch):
    """A crash while writing removes the temp dir; no partial output appears."""
    import flashrl_tools.quant.quantize as q

    def boom(*args, **kwargs):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(q, "quantize_weight", boom)
    with pytest.raises(RuntimeError, match="simulated crash"):
        q.quantize(tiny_models["llama-untied"], tmp_path / "out", QuantFn.int8)
    assert list(tmp_path.iterdir()) == []


def test_peak_memory_is_about_one_tensor(tmp_path):
    """Quantizing a 128 MiB checkpoint whose largest tensor is 2 MiB adds far less than the model
    to peak RSS: tensors are read, quantized and written one at a time."""
    script = f"""
import json, resource, torch
from flashrl_tools.safetensors_io import PlannedTensor, write_checkpoint
from transformers import LlamaConfig
src = {str(tmp_path / 'src')!r}
cfg = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=2048, num_hidden_layers=16,
                  num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True)
import os; os.makedirs(src); cfg.save_pretrained(src)
shapes = {{"model.embed_tokens.weight": (256, 512), "model.norm.weight": (512,)}}
for i in range(16):
    p = f"model.layers.{{i}}."
    for n in ("q", "k", "v", "o"): shapes[p + f"self_attn.{{n}}_proj.weight"] = (512, 512)
    shapes[p + "mlp.gate_proj.weight"] = (2048, 512); shapes[p + "mlp.up_proj.weight"] = (2048, 512)
    shapes[p + "mlp.down_proj.weight"] = (512, 2048)
    shapes[p + "input_layernorm.weight"] = (512,); shapes[p + "post_attention_layernorm.weight"] = (512,)
plan = [PlannedTensor(n, s, torch.bfloat16) for n, s in shapes.items()]
write_checkpoint(src, plan, lambda: ((n, torch.randn(s).to(torch.bfloat16)) for n, s in shapes.items()))
from flashrl_tools.quant.quantize import quantize
from flashrl_tools.model_structure import model_layout
model_layout(src)  # warm imports/caches so the baseline holds them
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"): return int(line.split()[1]) * 1024
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"): return int(line.split()[1]) * 1024
base = rss()
with open("/proc/self/clear_refs", "w") as f: f.write("5")  # reset the high-water mark
quantize(src, {str(tmp_path / 'out')!r}, "int8")
print(json.dumps({{"base": base, "peak": hwm(),
                  "model": sum(PlannedTensor(n, s, torch.bfloat16).nbytes for n, s in shapes.items())}}))
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    m = json.loads(res.stdout.strip().splitlines()[-1])
    extra = m["peak"] - m["base"]
    assert m["model"] > 120 * 2**20
    # one 2 MiB tensor in, its fp32 temporaries and int8 out: a few tensors' worth, not the model
    print(f"peak RSS grew {extra / 2**20:.1f} MiB quantizing a {m['model'] / 2**20:.0f} MiB model")
    assert extra < 40 * 2**20, f"peak grew by {extra / 2**20:.1f} MiB for a {m['model'] / 2**20:.0f} MiB model"


@pytest.mark.parametrize("fn", [QuantFn.int8, QuantFn.fp8_channel])
def test_fp32_checkpoint_quantizes_as_the_sync_of_its_tensors(fn, tiny_models, tmp_path):
    """verl saves the trainer's FP32 master weights (`hf_model`) and pushes the same FP32 tensors to
    the rollout engine. A fresh engine on that checkpoint must hold the bytes the sync wrote:
    `quantize` and the sync both quantize the BF16 rounding (quantizer.served_dtype). Measured on
    the H100 before this rule: a verl int8 run's engine differed from a fresh one in 420 tensors."""
    from safetensors.torch import save_file

    from flashrl_tools.runtime.core.convert import WeightConverter
    from flashrl_tools.config.schema import ConfigFn

    src = tiny_models["qwen3-untied"]
    fp32 = tmp_path / "fp32"
    fp32.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json" and f.is_file():
            (fp32 / f.name).write_bytes(f.read_bytes())
    reader = CheckpointReader(src)
    gen = torch.Generator().manual_seed(0)
    master = {n: (t.float() + 1e-4 * torch.randn(t.shape, generator=gen)) if PROJ.search(n) else t.float()
              for n, t in reader.iter_tensors()}  # not representable in BF16, as trained weights
    save_file(master, fp32 / "model.safetensors")
    out = quantize(fp32, tmp_path / "q", fn).out
    after = CheckpointReader(out)
    converter = WeightConverter.for_checkpoint(ConfigFn(fn.value), out, None)
    synced = dict(pair for name in master if PROJ.search(name) for pair in converter.convert(name, master[name]))
    assert len(synced) == 2 * 14
    for name, tensor in synced.items():
        assert tensor.dtype == after.dtype(name) and torch.equal(tensor, after.get(name)), name
    # the same bytes as quantizing the BF16 rounding of the checkpoint
    from flashrl_tools.quant.quantizer import quantize_weight

    name = next(n for n in master if PROJ.search(n))
    assert torch.equal(quantize_weight(fn, master[name].to(torch.bfloat16)).weight, after.get(name))
