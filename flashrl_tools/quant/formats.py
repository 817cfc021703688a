"""The formats, in one table (compressed-tensors style: a format is data with properties).

Two vocabularies share the names:
- `QuantFn`: a weight format the quantizer writes (`--fn` of quantize / profile / tune, the `fn` of
  a profile's metadata): its properties -- integer or float, weights per channel / tensor / 128x128
  block, the compressed-tensors preset scheme -- are its row of `FORMATS`.
- `ConfigFn`: what a rollout config (`fn:` in the YAML, the FLASHRL_CONFIG shortcuts) serves: BF16,
  vLLM's own online FP8, or one of the `QuantFn` formats; its row of `ROLLOUT` says which.
Code asks a format's properties (`fn.is_fp8`, `fn.strategy is Strategy.block`, `cfg.quant_fn`),
never compares it with a list of names. A new format is a new row (and its math in quantizer.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Strategy(str, Enum):
    """How weight scales are grouped (compressed-tensors' QuantizationStrategy names)."""

    channel = "channel"  # one scale per output row
    tensor = "tensor"  # one scale per tensor
    block = "block"  # one scale per 128x128 block
    group = "group"  # one scale per 128 input columns of a row (4-bit weights)


@dataclass(frozen=True)
class FormatSpec:
    kind: str  # compressed-tensors QuantizationType: "int" or "float"
    bits: int
    strategy: Strategy
    preset: str  # compressed-tensors preset scheme the checkpoint config starts from


class QuantFn(str, Enum):
    """A quantization format, named as on the command line (`--fn`)."""

    int8 = "int8"
    fp8_channel = "fp8_channel"
    fp8_tensor = "fp8_tensor"
    fp8_block = "fp8_block"
    w4a16 = "w4a16"

    @property
    def spec(self) -> FormatSpec:
        return FORMATS[self]

    @property
    def bits(self) -> int:
        return self.spec.bits

    @property
    def packed(self) -> bool:
        """Below 8 bits: stored packed in int32 words (compressed-tensors `pack-quantized`), BF16 activations."""
        return self.spec.bits < 8

    @property
    def calibratable(self) -> bool:
        """INT8: the one format whose checkpoints can be calibrated (SmoothQuant, GPTQ...), so whose profiles hold
        recovered per-linear factors."""
        return self.is_int and not self.packed

    @property
    def is_fp8(self) -> bool:
        return self.spec.kind == "float"

    @property
    def is_int(self) -> bool:
        """Integer weights (INT8 per channel, INT4 per group)."""
        return self.spec.kind == "int"

    @property
    def strategy(self) -> Strategy:
        return self.spec.strategy

    @classmethod
    def parse(cls, name: str) -> QuantFn:
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"unknown format '{name}' (known: {', '.join(f.value for f in cls)})") from None

    @classmethod
    def from_scheme(cls, kind, bits: int, strategy) -> QuantFn | None:
        """The format of a compressed-tensors weight scheme (type, num_bits, strategy: enums or their
        string values, as compressed-tensors versions differ), if any."""
        kind, strategy = getattr(kind, "value", kind), getattr(strategy, "value", strategy)
        for fn, spec in FORMATS.items():
            if (spec.kind, spec.bits, spec.strategy.value) == (kind, bits, strategy):
                return fn
        return None


FORMATS: dict[QuantFn, FormatSpec] = {
    QuantFn.int8: FormatSpec("int", 8, Strategy.channel, "W8A8"),  # int8 per-token activations
    QuantFn.fp8_channel: FormatSpec("float", 8, Strategy.channel, "FP8_DYNAMIC"),  # fp8 per-token activations
    # per-tensor weights and dynamic per-tensor activations, as vLLM's online FP8 (quant_config.py)
    QuantFn.fp8_tensor: FormatSpec("float", 8, Strategy.tensor, "FP8_DYNAMIC"),
    QuantFn.fp8_block: FormatSpec("float", 8, Strategy.block, "FP8_BLOCK"),  # 1x128 activation groups
    # symmetric INT4 per group of 128 input columns, BF16 activations (vLLM: Marlin / Machete; CPU: CPUWNA16)
    QuantFn.w4a16: FormatSpec("int", 4, Strategy.group, "W4A16"),
}


# the format a config's `w4a16_layers` serves beside its 8-bit `fn` (quant/mixed.py picks the layers)
LAYERS_4BIT = QuantFn.w4a16


class ConfigFn(str, Enum):
    """What a rollout config serves (`fn:` of a config entry)."""

    bf16 = "bf16"  # no quantization; accurate logprobs only
    fp8 = "fp8"  # vLLM's own online FP8
    int8 = "int8"  # W8A8: online (no profile) or from a calibrated checkpoint + profile
    fp8_channel = "fp8_channel"
    fp8_tensor = "fp8_tensor"
    fp8_block = "fp8_block"
    w4a16 = "w4a16"  # symmetric INT4 weights per group of 128, BF16 activations

    @property
    def quant_fn(self) -> QuantFn | None:
        """The checkpoint format the project writes for this config; None for BF16 and for vLLM's
        online FP8 (vLLM quantizes)."""
        return ROLLOUT[self]

    @property
    def quantized(self) -> bool:
        return self is not ConfigFn.bf16

    @property
    def vllm_online_fp8(self) -> bool:
        return self is ConfigFn.fp8

    @property
    def is_fp8(self) -> bool:
        return self.vllm_online_fp8 or (self.quant_fn is not None and self.quant_fn.is_fp8)

    @classmethod
    def parse(cls, name: str) -> ConfigFn:
        """A config name, flash-llm-rl's spellings included (`FN_ALIASES`)."""
        try:
            return cls(FN_ALIASES.get(name, name))
        except ValueError:
            known = ", ".join([f.value for f in cls] + list(FN_ALIASES))
            raise ValueError(f"unknown fn '{name}' (known: {known})") from None


ROLLOUT: dict[ConfigFn, QuantFn | None] = {
    ConfigFn.bf16: None, ConfigFn.fp8: None, ConfigFn.int8: QuantFn.int8, ConfigFn.fp8_channel: QuantFn.fp8_channel,
    ConfigFn.fp8_tensor: QuantFn.fp8_tensor, ConfigFn.fp8_block: QuantFn.fp8_block, ConfigFn.w4a16: QuantFn.w4a16,
}
# flash-llm-rl spellings that mean the same thing here.
FN_ALIASES = {"fp8_vllm": "fp8", "fp8_fast": "fp8", "fp8_vllm_fast": "fp8", "int8_wo_prune": "int8"}
