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
    excluded: tuple[str, ...]  # linear(-like) modules deliberately kept in high precision
    expert_weights: frozenset[str] = frozenset()  # the MoE experts' among linear_weights

    @property
    def is_moe(self) -> bool:
        return bool(self.expert_weights)


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
    from flashrl_tools.trainer_names import revert_all

    config, model = _meta_model(model_dir, allow_quantized=True)
    names = set(revert_all(model, dict(model.state_dict())))  # save-time names: experts per expert
    if getattr(config, "tie_word_embeddings", False):
        names -= {"lm_head.weight"}
    return names


def model_layout(model_dir: Path, allow_quantized: bool = False) -> ModelLayout:
    config, model = _meta_model(model_dir, allow_quantized)
    return layout_of(model, config.model_type)


def is_moe(model_dir: str | Path) -> bool:
    """A local model directory whose architecture has MoE blocks (False for a hub name or no config)."""
    return (Path(model_dir) / "config.json").is_file() and model_layout(Path(model_dir), allow_quantized=True).is_moe


def meta_model(model_dir: Path):
    """The transformers model of a (BF16 or 8-bit) checkpoint on the meta device."""
    return _meta_model(model_dir, allow_quantized=True)[1]


def layout_of(model: nn.Module, model_type: str) -> ModelLayout:
    from flashrl_tools.trainer_names import TrainerNames

    names = TrainerNames(model, frozenset())
    head = model.get_output_embeddings()
    blocks = _moe_blocks(model)
    linears, experts, excluded = set(), set(), []
    for name, module in model.named_modules():
        parent = name.rpartition(".")[0]
        weight = module._parameters.get("weight")
        if module is head or (parent in blocks and _linear_like(module)):  # output head, routers
            excluded += [n.removesuffix(".weight") for n in names.names_of(f"{name}.weight", tuple(weight.shape))]
        elif isinstance(module, nn.Linear):
            linears.update(names.names_of(f"{name}.weight", tuple(weight.shape)))
        else:
            for pname, p in _stacked_linears(module):
                experts.update(names.names_of(f"{name}.{pname}", tuple(p.shape)))
    return ModelLayout(model_type, frozenset(linears | experts), tuple(excluded), frozenset(experts))


def _stacked_linears(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """3D parameters [E, out, in] of a fused experts module (not a convolution's kernel)."""
    if isinstance(module, nn.modules.conv._ConvNd):
        return []
    return [(n, p) for n, p in module._parameters.items() if p is not None and p.dim() == 3]


def _linear_like(module: nn.Module) -> bool:
    """A leaf module computing x @ W.T with a 2D weight: nn.Linear or a router (`TopKRouter`)."""
    w = module._parameters.get("weight")
    return w is not None and w.dim() == 2 and not any(True for _ in module.children()) and \
        not isinstance(module, nn.Embedding)


def _moe_blocks(model: nn.Module) -> set[str]:
    """Names of sparse MoE blocks: parents of fused experts, or modules with an `experts` child."""
    blocks = set()
    for name, module in model.named_modules():
        if _stacked_linears(module):
            blocks.add(name.rpartition(".")[0])
        if "experts" in module._modules:
            blocks.add(name)
    return blocks
