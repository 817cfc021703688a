"""Which tensors of a checkpoint get quantized, read from the model's own structure.

The model class transformers builds for the checkpoint's config is instantiated on the meta
device (no memory, no weights), and every `nn.Linear` in it is a candidate; the output
embedding (lm_head) is excluded. So Llama, Qwen2 (q/k/v bias), Qwen3 (q/k norm) and other
decoder architectures work without a hard-coded list of layer names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from flashrl_tools.errors import FlashRLError


@dataclass(frozen=True)
class ModelLayout:
    model_type: str
    linear_weights: frozenset[str]  # checkpoint names of the weights to quantize ("<module>.weight")
    excluded: tuple[str, ...]  # linear modules deliberately kept in high precision


def read_config(model_dir: Path) -> dict:
    if not Path(model_dir).is_dir():
        raise FlashRLError("model directory not found", str(model_dir),
                           "pass a directory holding config.json and *.safetensors, or 'default'")
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FlashRLError("config.json not found", str(model_dir),
                           "pass a Hugging Face model directory (config.json + *.safetensors)")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise FlashRLError(f"config.json is not valid JSON ({e})", str(path)) from None


def _meta_model(model_dir: Path, allow_quantized: bool = False):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = read_config(model_dir)
    if "quantization_config" in cfg_dict and not allow_quantized:
        raise FlashRLError("model is already quantized (config.json has quantization_config)",
                           str(model_dir), "pass the BF16 checkpoint")
    try:
        config = AutoConfig.from_pretrained(str(model_dir))
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with torch.device("meta"):
            return config, AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, OSError) as e:
        raise FlashRLError(f"transformers cannot build this model ({e})", str(model_dir),
                           "check config.json's model_type/architectures") from None


def has_weights(model_dir: Path) -> bool:
    """False for a config-only directory (vLLM `load_format="dummy"`: shapes without weights)."""
    return any(Path(model_dir).glob("*.safetensors"))


def unquantized_names(model_dir: Path) -> set[str]:
    """The tensor names save_pretrained would write for this config (BF16 layout): what a
    trainer's state dict holds. For config-only model directories."""
    config, model = _meta_model(model_dir, allow_quantized=True)
    names = set(model.state_dict())
    if getattr(config, "tie_word_embeddings", False):
        names -= {"lm_head.weight"}
    return names


def model_layout(model_dir: Path, allow_quantized: bool = False) -> ModelLayout:
    config, model = _meta_model(model_dir, allow_quantized)
    head = model.get_output_embeddings()
    linears, excluded = set(), []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if module is head:
            excluded.append(name)
            continue
        linears.add(f"{name}.weight")
    return ModelLayout(config.model_type, frozenset(linears), tuple(excluded))
