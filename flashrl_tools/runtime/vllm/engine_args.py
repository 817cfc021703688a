"""Engine arguments (front end): the core's serving plan (core/plan.py) written into vLLM's `EngineArgs`
-- which checkpoint it loads, the policy's tokenizer, `quantization`, `logprobs_mode`, the KV-cache
dtype, the lm-head dtype -- plus what only vLLM needs: verl's own FP8 rollout refused next to a config,
vLLM's online FP8 under a name verl does not take over, eager engines on CPU."""

from __future__ import annotations

import logging
import os

from flashrl_tools.config.resolve import RuntimeConfig
from flashrl_tools.errors import FlashRLError
from flashrl_tools.runtime.core.kv_math import is_fp8_kv
from flashrl_tools.runtime.core.plan import start

log = logging.getLogger("flashrl_tools.runtime")


def online_fp8_method(requested: str) -> str:
    """vLLM's online per-tensor FP8 under a name verl does not take over. `quantization="fp8"`
    makes vLLM's config an `Fp8Config`, and verl (0.9, `is_quantized_model`) then patches vLLM's
    FP8 layers and pushes block-FP8 tensors it quantized itself, which this runtime would receive
    pre-quantized. vLLM >= 0.26 serves the same linear method (`Fp8PerTensorOnlineLinearMethod`:
    same weights, scales and kernels) under its online shorthand `fp8_per_tensor`, whose config is
    not an `Fp8Config`: verl then pushes BF16 and the runtime re-quantizes it as for every config."""
    if requested != "fp8":
        return requested
    try:
        from vllm.config.quantization import ONLINE_QUANT_SHORTHAND_NAMES
    except ImportError:  # older vLLM: no shorthand
        return requested
    return "fp8_per_tensor" if "fp8_per_tensor" in ONLINE_QUANT_SHORTHAND_NAMES else requested


def refuse_verl_fp8(rc: RuntimeConfig) -> None:
    """verl's own FP8 rollout (`actor_rollout_ref.rollout.quantization=fp8`, which sets
    VERL_VLLM_FP8_QUANT_ENABLED=1 and block-FP8 hf_overrides) would hand this runtime tensors it
    quantized itself: one clear error at start."""
    if os.environ.get("VERL_VLLM_FP8_QUANT_ENABLED", "0") == "1":
        raise FlashRLError(f"FLASHRL_CONFIG={rc.source} and verl's own FP8 rollout "
                           "(actor_rollout_ref.rollout.quantization=fp8, VERL_VLLM_FP8_QUANT_ENABLED=1) would both "
                           "quantize the pushed weights", None,
                           "unset verl's rollout.quantization (FLASHRL_CONFIG=fp8 serves FP8 rollouts and "
                           "re-quantizes every sync), or unset FLASHRL_CONFIG to use verl's FP8 path alone")


def merge_hf_overrides(current, extra: dict):
    """EngineArgs.hf_overrides may be None, a dict or a callable on the HF config."""
    if current is None:
        return dict(extra)
    if isinstance(current, dict):
        return {**current, **extra}

    def merged(config):
        config = current(config)
        for key, value in extra.items():
            setattr(config, key, value)
        return config

    return merged


def configure_engine(rc: RuntimeConfig, args, caps=None) -> dict:
    """Apply the config to a vLLM `EngineArgs` (in place, once); returns what it changed. `caps`: the
    capabilities to plan with (default: this platform's)."""
    from flashrl_tools.runtime.vllm.capabilities import capabilities, on_cpu

    if getattr(args, "_flashrl_applied", False):
        return {}
    args._flashrl_applied = True
    refuse_verl_fp8(rc)
    plan = start(rc, args.model, caps or capabilities(), args.quantization, args.kv_cache_dtype)
    overrides: dict = {}
    if plan.logprobs_mode is not None:
        overrides["logprobs_mode"] = plan.logprobs_mode
    if plan.engine_online_fp8:
        overrides["quantization"] = plan.quantization
    if plan.checkpoint is not None:  # the policy's tokenizer (or the caller's own)
        overrides["model"] = plan.checkpoint
        overrides["tokenizer"] = args.tokenizer if args.tokenizer not in (None, args.model) else args.model
    if plan.kv_cache_dtype is not None:
        overrides["kv_cache_dtype"] = plan.kv_cache_dtype
    if plan.lmhead_fp32:  # vLLM's own switch: lm_head matmul and logits in fp32
        overrides["hf_overrides"] = merge_hf_overrides(args.hf_overrides, {"head_dtype": "float32"})
    if overrides.get("quantization", args.quantization) == "fp8":  # ours or the caller's
        overrides["quantization"] = online_fp8_method("fp8")
    if is_fp8_kv(overrides.get("kv_cache_dtype", args.kv_cache_dtype)) and hasattr(args, "calculate_kv_scales"):
        # vLLM <= 0.31's one-off calculation would rewrite the scales inside the calibration pass itself
        overrides["calculate_kv_scales"] = False
    if on_cpu() and not args.enforce_eager:
        # vLLM-CPU engines run eager, as the project's CPU checks and references do: compiled and
        # eager differ by up to 0.34 nats on SmolLM2 with identical weights (syncs do reach a
        # compiled CPU engine exactly: docs/internals/vllm.md).
        overrides["enforce_eager"] = True
    if isinstance(getattr(args, "additional_config", None), dict):
        # part of vLLM's compile-cache key: a graph traced under other switches is not loaded
        overrides["additional_config"] = {**args.additional_config, "flashrl": compiled_switches()}
    for key, value in overrides.items():
        setattr(args, key, value)
    if "quantization" in overrides:
        _resolve_online_quantization(args)
    log.info("flashrl %s: engine overrides %s", rc.fn.value, overrides)
    return overrides


def compiled_switches() -> dict:
    """The FLASHRL_* values torch.compile bakes into vLLM's graph (decode_gemm.apply_weights is traced): vLLM's
    compile cache (the AOT one included, which skips tracing) keys on them through `additional_config`."""
    from flashrl_tools.config.settings import settings

    return {"decode_gemm": settings().decode_gemm}


def _resolve_online_quantization(args) -> None:
    """EngineArgs resolves an online shorthand (`fp8_per_tensor`) into `quantization_config` when
    it is built (vLLM 0.26: `__post_init__`), before this runtime changed `quantization`."""
    try:
        from vllm.config.quantization import resolve_quantization_config
    except ImportError:
        return
    if hasattr(args, "quantization_config"):
        args.quantization_config = resolve_quantization_config(args.quantization, args.quantization_config)


def create_engine_config(self, *args, **kwargs) -> None:
    """BEFORE `EngineArgs.create_engine_config` (front end): `configure_engine` once per EngineArgs."""
    from flashrl_tools.runtime.core.process import config

    configure_engine(config(), self)
