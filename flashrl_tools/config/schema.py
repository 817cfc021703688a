"""The patcher config (YAML), parsed once at the edge into typed objects.

Compatible with flash-llm-rl's file: `configs: [ {fn, model, profile, load_format,
distributed_executor_backend, module_attribute_to_preserve, quantization, ...} ]`, plus
`version:`. The same schema is used by `flashrl setup` (writing) and the runtime (reading).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, NonNegativeInt, ValidationError, model_validator

from flashrl_tools.errors import FlashRLError
from flashrl_tools.quant.formats import FN_ALIASES, ConfigFn

CONFIG_VERSION = 1


LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
# vLLM's KV-cache dtypes we serve; "auto" (or no key) is vLLM's default (the model dtype). FP8 KV
# scales are recalibrated after every weight sync (runtime/kv_calibration.py).
KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]


class RolloutConfig(BaseModel):
    """One entry of `configs:`."""

    model_config = ConfigDict(extra="forbid")
    fn: ConfigFn
    model: str | None = None  # the 8-bit checkpoint the profile was made from
    profile: str | None = None  # profile file (`flashrl profile`)
    load_format: str = "auto"
    distributed_executor_backend: str | None = "external_launcher"
    module_attribute_to_preserve: list[str] = []
    quantization: str | None = None
    params_to_ignore: list[str] = []
    logprobs_mode: LogprobsMode | None = None  # what vLLM returns as sampling logprobs
    profile_sha256: str | None = None  # checked before the profile is used
    kv_cache_dtype: KVCacheDtype | None = None  # FLASHRL_KV_CACHE_DTYPE overrides it
    # mixed precision (flashrl_tools/quant/mixed.py): linear layers kept in BF16 (fused partners too)
    keep_bf16: list[str] = []  # glob patterns of module names
    first_layers_bf16: NonNegativeInt = 0
    last_layers_bf16: NonNegativeInt = 0
    # 4-bit layers of an 8-bit config: glob patterns of module names served W4A16 (fused partners too;
    # keep_bf16 wins where both match)
    w4a16_layers: list[str] = []
    fp8_scale_pow2: bool = False  # FP8 formats quantized online: scales rounded up to powers of two

    @property
    def fp8_kv_cache(self) -> bool:
        return self.kv_cache_dtype not in (None, "auto")

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("fn") in FN_ALIASES:
            data = {**data, "fn": FN_ALIASES[data["fn"]]}
        for key in ("keep_bf16", "w4a16_layers"):
            if isinstance(data, dict) and isinstance(data.get(key), str):  # one pattern
                data = {**data, key: [data[key]]}
        if isinstance(data, dict) and data.get("fn") == "int8_prune":
            raise ValueError("fn 'int8_prune' (flash-llm-rl dead-neuron pruning) is not supported; use 'int8'")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> RolloutConfig:
        if self.profile is not None and self.model is None:
            raise ValueError("a profile needs `model`: the 8-bit checkpoint it was made from")
        if not self.fn.quantized and (self.profile or self.quantization):
            raise ValueError("fn 'bf16' takes no profile and no quantization")
        if not self.fn.quantized and (self.keep_bf16 or self.first_layers_bf16 or self.last_layers_bf16):
            raise ValueError("fn 'bf16' keeps every layer in BF16 already: keep_bf16 / first_layers_bf16 / "
                             "last_layers_bf16 need an 8-bit fn")
        if self.fn.vllm_online_fp8 and (self.keep_bf16 or self.first_layers_bf16 or self.last_layers_bf16):
            raise ValueError("fn 'fp8' is vLLM's online FP8, which quantizes every linear layer: for mixed "
                             "precision use fn 'fp8_tensor' (the same format, from our checkpoint), 'fp8_channel' "
                             "or 'fp8_block'")
        if any(not p.strip() for p in self.keep_bf16):
            raise ValueError("keep_bf16 has an empty pattern")
        if self.w4a16_layers:
            if self.fn.quant_fn is None or self.fn.quant_fn.packed:
                raise ValueError(f"w4a16_layers mixes 4-bit layers into an 8-bit config: fn '{self.fn.value}' is not one "
                                 "(use fn int8, fp8_channel, fp8_tensor or fp8_block; fn w4a16 serves every layer in 4 bits)")
            if self.model is not None:
                raise ValueError("w4a16_layers applies to online quantization: a given `model` (and its profile) "
                                 "serves its own formats")
            if any(not p.strip() for p in self.w4a16_layers):
                raise ValueError("w4a16_layers has an empty pattern")
        if self.fp8_scale_pow2 and not (self.fn.quant_fn is not None and self.fn.quant_fn.is_fp8):
            raise ValueError(f"fp8_scale_pow2 needs fn fp8_channel, fp8_tensor or fp8_block (fn '{self.fn.value}'"
                             + (" is vLLM's online FP8, which computes its own scales)" if self.fn.vllm_online_fp8
                                else " has no FP8 scales)"))
        if self.fp8_scale_pow2 and self.model is not None:
            raise ValueError("fp8_scale_pow2 applies to online quantization: a given `model` serves its own scales "
                             "(write it with `flashrl quantize --pow2-scales`)")
        return self


class ConfigFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int = CONFIG_VERSION
    configs: list[RolloutConfig]

    @model_validator(mode="after")
    def _nonempty(self) -> ConfigFile:
        if not self.configs:
            raise ValueError("`configs` is empty")
        if self.version > CONFIG_VERSION:
            raise ValueError(f"version {self.version} is newer than this flashrl_tools reads ({CONFIG_VERSION})")
        return self


def parse_config(data: Any, source: str) -> ConfigFile:
    """Validate a loaded YAML document; errors name the key and the allowed ones."""
    if not isinstance(data, dict):
        raise FlashRLError("config must be a mapping with a `configs:` list", source)
    try:
        return ConfigFile.model_validate(data)
    except ValidationError as e:
        raise FlashRLError(_explain(e.errors()[0]), source) from None


def load_config(path: Path) -> ConfigFile:
    path = Path(path)
    if not path.is_file():
        raise FlashRLError("config file not found", str(path), "write one with `flashrl setup`")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise FlashRLError(f"config is not valid YAML ({str(e).splitlines()[0]})", str(path)) from None
    return parse_config(data, str(path))


def dump_config(config: ConfigFile) -> str:
    data = config.model_dump(mode="json", exclude_defaults=False)
    return yaml.safe_dump(data, sort_keys=False)


def _explain(err: dict) -> str:
    loc = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        key = err["loc"][-1]
        model = RolloutConfig if "configs" in err["loc"] else ConfigFile
        allowed = ", ".join(model.model_fields)
        return f"unknown key '{key}' at {loc}; allowed keys: {allowed}"
    if err["type"] == "enum":
        allowed = ", ".join([f.value for f in ConfigFn] + list(FN_ALIASES))
        return f"invalid value {err.get('input')!r} for {loc}; allowed: {allowed}"
    msg = err["msg"].removeprefix("Value error, ")
    return f"{msg} (at {loc})" if loc else msg
