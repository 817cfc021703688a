"""The `quantization_config` block of a checkpoint's config.json, built with compressed-tensors' classes.

vLLM reads this block to pick its compressed-tensors kernels, so the checkpoint loads without flags.
"""

from __future__ import annotations

from typing import Any

from compressed_tensors.config import CompressionFormat
from compressed_tensors.quantization import (
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    QuantizationStrategy,
    preset_name_to_scheme,
)

from flashrl_tools.quant.formats import LAYERS_4BIT
from flashrl_tools.quant.quantizer import QuantFn

TARGETS = ["Linear"]
IGNORE = ["lm_head"]
# Tensors a quantized checkpoint adds beside the weights it quantizes (not in the BF16 model).
QUANT_EXTRA_SUFFIXES = ("_scale", "_zero_point", ".input_scale", "_global_scale", ".weight_shape")
PACKED = ".weight_packed"  # pack-quantized (4-bit): `<linear>.weight_packed` stores `<linear>.weight`


def weight_name(name: str) -> str:
    """The BF16 name a checkpoint tensor stores (`....weight_packed` -> `....weight`; others: themselves)."""
    return name.removesuffix("_packed") if name.endswith(PACKED) else name


def scheme_for(fn: QuantFn) -> QuantizationScheme:
    """Weights and activations for each format (activations always dynamic: no calibration data)."""
    scheme = preset_name_to_scheme(fn.spec.preset, TARGETS)  # W8A8, FP8_DYNAMIC (channel), FP8_BLOCK
    if scheme.weights.strategy == QuantizationStrategy(fn.strategy.value):
        return scheme
    # fp8_tensor: the FP8_DYNAMIC preset with per-tensor weights and dynamic per-tensor activations
    weights = scheme.weights.model_copy(update={"strategy": QuantizationStrategy.TENSOR})
    acts = scheme.input_activations.model_copy(update={"strategy": QuantizationStrategy.TENSOR})
    return QuantizationScheme(targets=TARGETS, weights=weights, input_activations=acts)


def compression_format(fn: QuantFn) -> str:
    return (CompressionFormat.pack_quantized if fn.packed else
            CompressionFormat.int_quantized if fn.is_int else CompressionFormat.float_quantized).value


def quantization_config(fn: QuantFn, ignore: list[str] | None = None,
                        four_bit: list[str] | None = None) -> dict[str, Any]:
    """The dict stored under config.json's `quantization_config`. `four_bit`: modules (unfused names) stored
    W4A16 beside `fn`'s layers -- a second scheme group naming them (vLLM matches a layer's name, then a fused
    layer's members, before the `Linear` class), each group with its own format."""
    groups = {"group_0": scheme_for(fn)}
    fmt = compression_format(fn)
    if four_bit:
        groups["group_0"] = groups["group_0"].model_copy(update={"format": fmt})
        w4 = LAYERS_4BIT
        groups["group_1"] = scheme_for(w4).model_copy(update={"targets": list(four_bit),
                                                              "format": compression_format(w4)})
        fmt = CompressionFormat.mixed_precision.value
    cfg = QuantizationConfig(
        config_groups=groups,
        format=fmt,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=list(IGNORE if ignore is None else ignore),
    )
    return cfg.model_dump(mode="json")


def layer_formats(qc: dict[str, Any]) -> dict[str, QuantFn]:
    """Module name -> format for the modules a checkpoint's scheme groups name one by one (the 4-bit layers of
    a mixed checkpoint); the rest take the `Linear` group's format (profile/build.py `checkpoint_format`)."""
    out: dict[str, QuantFn] = {}
    for group in (qc or {}).get("config_groups", {}).values():
        w = group.get("weights") or {}
        fn = QuantFn.from_scheme(w.get("type"), w.get("num_bits"), w.get("strategy"))
        for target in group.get("targets", []):
            if fn is not None and target != "Linear" and not target.startswith("re:"):
                out[target] = fn
    return out


# config.json key (top level, beside quantization_config) of a checkpoint whose FP8 scales are
# powers of two: syncs must re-quantize the same way (runtime/convert.py reads it).
FP8_POW2_KEY = "flashrl_fp8_scale_pow2"


def has_pow2_scales(config: dict[str, Any]) -> bool:
    return bool(config.get(FP8_POW2_KEY))


def ignored_by(module: str, ignore: list[str]) -> bool:
    """Whether a compressed-tensors `ignore` list (exact module names or `re:` patterns) covers a module."""
    import re

    return any(re.fullmatch(e[3:], module) if e.startswith("re:") else e == module for e in ignore)
