"""`flashrl models`: the embedded default (GGUF -> BF16, cached by hash) and tiny models."""

from __future__ import annotations

import json
import shutil

import torch

from conftest import run_cli
from flashrl_tools.models import default as dm
from flashrl_tools.safetensors_io import CheckpointReader


def test_default_model_is_a_complete_bf16_llama(default_model):
    cfg = json.loads((default_model / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576 and cfg["tie_word_embeddings"]
    reader = CheckpointReader(default_model)
    assert {reader.dtype(n) for n in reader.names()} == {torch.bfloat16}
    assert sum(torch.Size(reader.shape(n)).numel() for n in reader.names()) == 134_515_008
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (default_model / f).is_file(), f
    assert "<|im_start|>" in (default_model / "chat_template.jinja").read_text()
    assert dm.is_materialised(default_model)


def test_default_model_answers_coherently(default_model):
    """The dequantized BF16 model is the real SmolLM2: it knows the capital of France."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.bfloat16)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1]:])


def test_cli_reuses_cache_and_rebuilds_when_a_file_changes(default_model, tmp_path):
    """Reuse is decided by file hashes: a corrupted weight file is detected and rebuilt."""
    home = tmp_path / "home"
    shutil.copytree(default_model, home / "models" / dm.MODEL_NAME)
    gguf = dm.flashrl_home() / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    env = {"FLASHRL_HOME": str(home)}
    weights = home / "models" / dm.MODEL_NAME / "model.safetensors"

    res = run_cli("models", "default", "--gguf", gguf, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(home / "models" / dm.MODEL_NAME)
    mtime = weights.stat().st_mtime_ns
    res = run_cli("models", "default", env=env)  # cached: no GGUF needed, nothing rewritten
    assert res.returncode == 0 and weights.stat().st_mtime_ns == mtime

    with open(weights, "r+b") as f:  # same size, one flipped byte deep in the data
        f.seek(100_000_000)
        b = f.read(1)
        f.seek(100_000_000)
        f.write(bytes([b[0] ^ 0xFF]))
    assert not dm.is_materialised(weights.parent)
    res = run_cli("models", "default", "--gguf", gguf, env=env)
    assert res.returncode == 0, res.stderr
    assert dm.is_materialised(weights.parent)
    assert dm.sha256_file(weights) == dm.sha256_file(default_model / "model.safetensors")


def test_wrong_gguf_is_refused(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF" + b"\0" * 100)
    res = run_cli("models", "default", "--gguf", fake, env={"FLASHRL_HOME": str(tmp_path / "h")})
    assert res.returncode != 0
    assert res.stderr.strip().startswith("error: GGUF file does not match the pinned sha256")
    assert not (tmp_path / "h" / "models" / dm.MODEL_NAME).exists()


def test_tiny_is_deterministic_and_arch_specific(tmp_path):
    for run in ("a", "b"):
        res = run_cli("models", "tiny", "--arch", "qwen2", "--tied", "-o", tmp_path / run)
        assert res.returncode == 0, res.stderr
    a, b = CheckpointReader(tmp_path / "a"), CheckpointReader(tmp_path / "b")
    assert a.names() == b.names() and all(torch.equal(a.get(n), b.get(n)) for n in a.names())
    assert "lm_head.weight" not in a.names() and "model.layers.0.self_attn.q_proj.bias" in a.names()
    res = run_cli("models", "tiny", "--arch", "llama", "--seed", "1", "-o", tmp_path / "c")
    c = CheckpointReader(tmp_path / "c")
    assert res.returncode == 0 and "lm_head.weight" in c.names()
    res = run_cli("models", "tiny", "--arch", "gpt9", "-o", tmp_path / "d")
    assert res.returncode != 0 and res.stderr.strip().startswith("error: unknown --arch 'gpt9'")
