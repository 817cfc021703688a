"""Engine arguments: what a config changes in vLLM's `EngineArgs` (front-end process), and what it
refuses there with one clear error: which checkpoint the engine serves (the online-quantized cache,
a calibrated checkpoint), the policy's tokenizer, `quantization`, `logprobs_mode`, the KV-cache dtype,
and combinations that cannot work (a trainer that quantizes itself, 8-bit MoE or FP8 KV on a CPU
without the kernels)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from flashrl_tools.config.resolve import RuntimeConfig
from flashrl_tools.model_structure import is_moe

log = logging.getLogger("flashrl_tools.runtime")


def engine_overrides(rc: RuntimeConfig, policy_model: str) -> dict:
    """Which EngineArgs fields the config changes, for a trainer that asked for `policy_model`."""
    from flashrl_tools.quantizer import QuantFn

    entry, out = rc.entry, {}
    if entry.logprobs_mode is not None:
        out["logprobs_mode"] = entry.logprobs_mode
    if entry.fn.vllm_online_fp8 and not is_moe(policy_model):
        out["quantization"] = online_fp8_method(entry.quantization or "fp8")
    elif entry.fn.quantized:
        from flashrl_tools.mixed import KeepSpec

        keep = KeepSpec.of(entry)
        if entry.model is not None and keep:  # calibrated profile, some layers kept in BF16
            from flashrl_tools.errors import FlashRLError
            from flashrl_tools.runtime.online_cache import ensure_profile_applied

            if entry.profile is None:
                raise FlashRLError(f"FLASHRL_CONFIG={rc.source}: keep_bf16 / first_layers_bf16 / last_layers_bf16 "
                                   "with a `model` need its `profile` (to rebuild it with BF16 layers)", entry.model,
                                   "run `flashrl profile` on the checkpoint, or drop `model` to quantize online")
            out["model"] = str(ensure_profile_applied(Path(policy_model), Path(entry.profile), keep))
        elif entry.model is not None:  # a calibrated checkpoint (+ profile)
            out["model"] = entry.model
        else:  # online: quantize the policy once per node
            from flashrl_tools.runtime.online_cache import ensure_quantized

            # `fp8` on MoE: vLLM's online FP8 MoE did not re-derive expert scales on a reload
            # (synced engine 0.034 nats off a fresh one, H100, vLLM 0.26), so we serve our own
            # checkpoint. Per-channel weights, dynamic per-token activations: vLLM 0.26 serves
            # per-tensor FP8 experts with Marlin (weight-only, repacked, w1/w3 re-quantized to one
            # scale), per-channel ones with CUTLASS W8A8 in the layout loaded, which the in-place
            # sync writes directly (runtime/vllm/inplace.py); per-channel is also the finer format.
            fmt = entry.fn.quant_fn or QuantFn.fp8_channel  # vLLM's online fp8 -> fp8_channel on MoE
            out["model"] = str(ensure_quantized(Path(policy_model), fmt, keep, entry.fp8_scale_pow2))
    if "model" in out:
        out["tokenizer"] = policy_model
    if entry.fp8_kv_cache:
        out["kv_cache_dtype"] = entry.kv_cache_dtype
    if rc.lmhead_fp32:  # vLLM's own switch: lm_head matmul and logits in fp32
        out["hf_overrides"] = {"head_dtype": "float32"}
    return out


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
    except ImportError:  # older vLLM: no shorthand; verl's FP8 path would take over (refused at start)
        return requested
    return "fp8_per_tensor" if "fp8_per_tensor" in ONLINE_QUANT_SHORTHAND_NAMES else requested


def _refuse_trainer_quantization(rc: RuntimeConfig, requested: str | None) -> None:
    """A trainer that quantizes the pushed weights itself (verl's own FP8 rollout, `actor_rollout_ref.
    rollout.quantization=fp8`, which sets VERL_VLLM_FP8_QUANT_ENABLED=1 and block-FP8 hf_overrides)
    would hand this runtime pre-quantized tensors; a `quantization` argument other than the one an
    8-bit config serves would not load its checkpoint. Either is one clear error at start."""
    from flashrl_tools.errors import FlashRLError

    if os.environ.get("VERL_VLLM_FP8_QUANT_ENABLED", "0") == "1":
        raise FlashRLError(f"FLASHRL_CONFIG={rc.source} and verl's own FP8 rollout "
                           "(actor_rollout_ref.rollout.quantization=fp8, VERL_VLLM_FP8_QUANT_ENABLED=1) would both "
                           "quantize the pushed weights", None,
                           "unset verl's rollout.quantization (FLASHRL_CONFIG=fp8 serves FP8 rollouts and "
                           "re-quantizes every sync), or unset FLASHRL_CONFIG to use verl's FP8 path alone")
    if not rc.fn.quantized or requested is None:
        return
    serves = ("fp8", "fp8_per_tensor") if rc.fn.vllm_online_fp8 else ("compressed-tensors",)
    if requested not in serves:
        raise FlashRLError(f"quantization={requested!r} passed to vLLM conflicts with FLASHRL_CONFIG={rc.source} "
                           f"(it serves {serves[0]})", None,
                           "drop the quantization argument (or the trainer's rollout quantization setting), "
                           "or unset FLASHRL_CONFIG")


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def refuse_8bit_moe_on_cpu(rc: RuntimeConfig, model: str) -> None:
    """vLLM-CPU has BF16 MoE kernels only (no INT8 MoE backend, no FP8 at all): say so at start
    instead of a kernel-selection traceback deep in the model build."""
    from flashrl_tools.errors import FlashRLError

    if rc.fn.quantized and is_moe(model):
        raise FlashRLError(f"FLASHRL_CONFIG={rc.source}: vLLM on CPU cannot serve 8-bit ({rc.fn.value}) MoE "
                           "models (it has no INT8 or FP8 MoE kernels)", model,
                           "run 8-bit MoE rollouts on a GPU, or use FLASHRL_CONFIG=bf16 on CPU")


def fp8_kv(cache_dtype) -> bool:
    """Whether a vLLM KV-cache dtype is an FP8 one (whose scales the runtime calibrates)."""
    return str(cache_dtype or "auto").startswith("fp8")


def _refuse_fp8_kv_on_cpu(rc: RuntimeConfig, requested=None) -> None:
    """vLLM-CPU's attention has an FP8 KV cache only with AVX-512 or AMX: say so at start."""
    from flashrl_tools.errors import FlashRLError

    dtype = rc.entry.kv_cache_dtype if rc.entry.fp8_kv_cache else requested
    if fp8_kv(dtype) and not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        raise FlashRLError(f"kv_cache_dtype {dtype} (FLASHRL_CONFIG={rc.source}): vLLM on CPU "
                           "has an FP8 KV cache only on x86 CPUs with AVX-512 or AMX, and this one has neither",
                           None, "unset FLASHRL_KV_CACHE_DTYPE / kv_cache_dtype, or run on a GPU")


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


def configure_engine(rc: RuntimeConfig, args) -> dict:
    """Apply the config to a vLLM `EngineArgs` (in place, once); returns what it changed."""
    if getattr(args, "_flashrl_applied", False):
        return {}
    args._flashrl_applied = True
    policy_tokenizer = args.tokenizer if args.tokenizer is not None and args.tokenizer != args.model else args.model
    _refuse_trainer_quantization(rc, args.quantization)
    if _on_cpu():
        refuse_8bit_moe_on_cpu(rc, rc.entry.model or args.model)
        _refuse_fp8_kv_on_cpu(rc, args.kv_cache_dtype)
    overrides = engine_overrides(rc, args.model)
    if overrides.get("quantization", args.quantization) == "fp8":  # ours or the caller's
        overrides["quantization"] = online_fp8_method("fp8")
    if fp8_kv(overrides.get("kv_cache_dtype", args.kv_cache_dtype)):
        if not rc.entry.fp8_kv_cache:
            log.info("flashrl: kv_cache_dtype=%s set by the caller: its scales are recalibrated after every "
                     "weight sync, as with FLASHRL_KV_CACHE_DTYPE", args.kv_cache_dtype)
        # the runtime calibrates (runtime/kv_calibration.py); vLLM's one-off calculation would also
        # rewrite the scales inside the calibration pass itself
        if hasattr(args, "calculate_kv_scales"):  # vLLM <= 0.31
            overrides["calculate_kv_scales"] = False
    if "tokenizer" in overrides:
        overrides["tokenizer"] = policy_tokenizer
    if "hf_overrides" in overrides:
        overrides["hf_overrides"] = merge_hf_overrides(args.hf_overrides, overrides["hf_overrides"])
    if _on_cpu() and not args.enforce_eager:
        # vLLM-CPU engines run eager, as the project's CPU checks and references do: compiled and
        # eager differ by up to 0.34 nats on SmolLM2 with identical weights. (Syncs do reach a
        # compiled CPU engine: bf16 and int8 equal a fresh compiled engine, 2026-11-25; the drift
        # a first TRL run blamed on the traced graph was its FP32 trainer, docs/guide.md.)
        overrides["enforce_eager"] = True
    for key, value in overrides.items():
        setattr(args, key, value)
    if "quantization" in overrides:
        _resolve_online_quantization(args)
    log.info("flashrl %s: engine overrides %s", rc.fn.value, overrides)
    return overrides


def _resolve_online_quantization(args) -> None:
    """EngineArgs resolves an online shorthand (`fp8_per_tensor`) into `quantization_config` when
    it is built (vLLM 0.26: `__post_init__`), before this runtime changed `quantization`."""
    try:
        from vllm.config.quantization import resolve_quantization_config
    except ImportError:
        return
    if hasattr(args, "quantization_config"):
        args.quantization_config = resolve_quantization_config(args.quantization, args.quantization_config)


def hook_engine_args(rc: RuntimeConfig) -> None:
    """`EngineArgs.create_engine_config` (front end): `configure_engine` once per EngineArgs."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, "_flashrl", False):
        return

    def create_engine_config(self, *args, **kwargs):
        configure_engine(rc, self)
        return original(self, *args, **kwargs)

    create_engine_config._flashrl = True
    EngineArgs.create_engine_config = create_engine_config
