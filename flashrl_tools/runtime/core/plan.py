"""The serving plan: what an engine starts from for a config, decided once for every engine.

`start(rc, policy_model, caps)` is the start-up decision both adapters make in their front end
(vLLM's EngineArgs, SGLang's ServerArgs): refuse what the engine cannot serve (its declared
`Capabilities`, the format table's properties), refuse FLASHRL_* values it does not honour, warn
once about config keys nothing reads, and say which checkpoint it loads (the policy itself, an
online-quantized cache, a calibrated checkpoint, a calibrated checkpoint rebuilt with BF16 layers),
with which tokenizer, KV-cache dtype and lm-head precision. The adapter only translates the plan
into its engine's argument names.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from flashrl_tools.config.resolve import RuntimeConfig
from flashrl_tools.config.schema import RolloutConfig
from flashrl_tools.config.settings import settings
from flashrl_tools.errors import FlashRLError
from flashrl_tools.model_structure import is_moe
from flashrl_tools.quant.formats import LAYERS_4BIT, QuantFn
from flashrl_tools.quant.mixed import KeepSpec
from flashrl_tools.runtime.core.adapter import Capabilities, check_settings
from flashrl_tools.runtime.core.kv_math import is_fp8_kv

log = logging.getLogger("flashrl_tools.runtime")

# flash-llm-rl's keys: accepted (and written by `flashrl setup`) so its files load, read by nothing
UNREAD_KEYS = ("load_format", "distributed_executor_backend", "module_attribute_to_preserve", "params_to_ignore")
_warned: set[tuple] = set()


@dataclass(frozen=True)
class ServingPlan:
    served: QuantFn | None  # the 8-bit checkpoint format the engine loads (None: BF16 weights)
    engine_online_fp8: bool  # the engine quantizes the BF16 weights itself at load (vLLM's online FP8)
    checkpoint: str | None  # what the engine loads instead of the policy (None: the policy)
    tokenizer: str | None  # the policy's tokenizer, when the engine loads another checkpoint
    kv_cache_dtype: str | None  # the config's FP8 KV cache, in the engine's name for it
    lmhead_fp32: bool  # FLASHRL_LMHEAD_FP32
    logprobs_mode: str | None  # the config's (vLLM's logprobs_mode names)
    quantization: str | None  # the config's `quantization` key (the engine's online FP8 method)


def served_format(rc: RuntimeConfig, caps: Capabilities, moe: bool) -> tuple[QuantFn | None, bool]:
    """(the checkpoint format the engine serves for `rc`, whether the engine quantizes at load)."""
    fn = rc.entry.fn
    if fn.vllm_online_fp8:
        fmt = caps.fp8_moe if moe else caps.fp8_dense
        return fmt, fmt is None
    return (fn.quant_fn if fn.quantized else None), False


def refuse_unserved(rc: RuntimeConfig, caps: Capabilities, fmt: QuantFn | None, moe: bool, model: str) -> None:
    if fmt is None:
        return
    if rc.entry.w4a16_layers and LAYERS_4BIT not in caps.formats:
        raise FlashRLError(f"FLASHRL_CONFIG={rc.source}: {caps.engine} does not serve w4a16 layers (w4a16_layers)",
                           None, f"drop w4a16_layers on {caps.engine} (its layers then serve {fmt.value})")
    if fmt not in caps.formats:
        raise FlashRLError(f"FLASHRL_CONFIG={rc.source}: {caps.engine} does not serve {fmt.value} checkpoints"
                           f"{' (a MoE model)' if moe else ''} ({caps.formats_note})", None,
                           f"on {caps.engine} use {' | '.join(sorted(f.value for f in caps.formats)) or 'bf16'}")
    if moe and fmt not in caps.moe_formats:
        raise FlashRLError(f"FLASHRL_CONFIG={rc.source}: {caps.engine} does not serve {fmt.value} MoE experts "
                           f"({caps.moe_note})", model,
                           f"for MoE models on {caps.engine} use "
                           f"{' | '.join(sorted(f.value for f in caps.moe_formats)) or 'bf16'}")


# model types the runtime refuses at start, with the feature that is not served (tests/gpu/test_engine_arch_matrix.py)
UNSERVED_MODELS = {
    "gpt_oss": "attention sinks with fused MoE expert tensors (gpt-oss: no 8-bit conversion of [experts, ...] "
               "tensors; a BF16 sync differed from a fresh engine on vLLM 0.26)",
}


def refuse_model(rc: RuntimeConfig, model: str, kv_cache: bool = False) -> None:
    """Refuse at start a model type whose feature the runtime does not serve exactly (UNSERVED_MODELS); with an
    FP8 KV cache (`kv_cache`), multi-head latent attention (its latent cache has no K / V scales to calibrate)."""
    from flashrl_tools.model_structure import read_config

    path = Path(model)
    if not (path / "config.json").is_file():
        return
    config = read_config(path)
    kind = config.get("model_type", "")
    if kv_cache and config.get("kv_lora_rank"):
        raise FlashRLError(f"FLASHRL_KV_CACHE_DTYPE=fp8 (FLASHRL_CONFIG={rc.source}): multi-head latent attention "
                           f"(MLA, {kind}) is not served with an FP8 KV cache by flashrl's runtime", model,
                           "unset FLASHRL_KV_CACHE_DTYPE / kv_cache_dtype for this model")
    if kind in UNSERVED_MODELS:
        raise FlashRLError(f"FLASHRL_CONFIG={rc.source}: {UNSERVED_MODELS[kind]} is not served by flashrl's runtime",
                           model, "serve this model without FLASHRL_CONFIG")


def unread_keys(entry: RolloutConfig) -> dict[str, object]:
    """The flash-llm-rl keys set to something other than their default (which nothing reads)."""
    defaults = RolloutConfig(fn=entry.fn)
    return {k: getattr(entry, k) for k in UNREAD_KEYS if getattr(entry, k) != getattr(defaults, k)}


def warn_unread_keys(rc: RuntimeConfig, engine: str) -> None:
    keys = unread_keys(rc.entry)
    if keys and (rc.source, engine) not in _warned:
        _warned.add((rc.source, engine))
        log.warning("flashrl: FLASHRL_CONFIG=%s sets %s: flash-llm-rl keys, accepted for compatibility, with no "
                    "effect on %s", rc.source, ", ".join(f"{k}={v!r}" for k, v in keys.items()), engine)


def checkpoint_for(rc: RuntimeConfig, fmt: QuantFn | None, policy_model: str) -> str | None:
    """What the engine loads to serve `fmt` for the trainer's `policy_model` (None: the policy itself)."""
    from flashrl_tools.runtime.core.online_cache import ensure_profile_applied, ensure_quantized

    entry = rc.entry
    if fmt is None:
        return None
    keep = KeepSpec.of(entry)
    if entry.model is not None and keep:  # calibrated profile, some layers kept in BF16
        if entry.profile is None:
            raise FlashRLError(f"FLASHRL_CONFIG={rc.source}: keep_bf16 / first_layers_bf16 / last_layers_bf16 "
                               "with a `model` need its `profile` (to rebuild it with BF16 layers)", entry.model,
                               "run `flashrl profile` on the checkpoint, or drop `model` to quantize online")
        return str(ensure_profile_applied(Path(policy_model), Path(entry.profile), keep))
    if entry.model is not None:  # a calibrated checkpoint (+ profile)
        return entry.model
    return str(ensure_quantized(Path(policy_model), fmt, keep, entry.fp8_scale_pow2))  # online, once per node


def refuse_caller_args(rc: RuntimeConfig, caps: Capabilities, engine_online: bool, fmt: QuantFn | None,
                       quantization: str | None, kv_cache_dtype: str | None) -> None:
    """Engine arguments the caller (a trainer) set that conflict with the config: a `quantization`
    that would not load what the config serves, another KV-cache dtype than the config's."""
    if fmt is not None and quantization is not None:
        serves = caps.online_quantization if engine_online else (caps.checkpoint_quantization,)
        if quantization not in serves:
            raise FlashRLError(f"quantization={quantization!r} passed to {caps.engine} conflicts with "
                               f"FLASHRL_CONFIG={rc.source} (it serves {serves[0]})", None,
                               "drop the quantization argument (or the trainer's rollout quantization setting), "
                               "or unset FLASHRL_CONFIG")
    asked = str(kv_cache_dtype or "auto")
    if rc.entry.fp8_kv_cache and asked not in ("auto", rc.entry.kv_cache_dtype, caps.kv_dtype(rc.entry.kv_cache_dtype)):
        raise FlashRLError(f"kv_cache_dtype={asked!r} passed to {caps.engine} conflicts with "
                           f"FLASHRL_CONFIG={rc.source}'s {rc.entry.kv_cache_dtype} KV cache", None,
                           "drop the kv_cache_dtype argument, or unset FLASHRL_KV_CACHE_DTYPE")


def start(rc: RuntimeConfig, policy_model: str, caps: Capabilities, quantization: str | None = None,
          kv_cache_dtype: str | None = None) -> ServingPlan:
    """The start-up decision for an engine asked to serve `policy_model`, with the caller's own
    `quantization` / `kv_cache_dtype` arguments (refusals raise FlashRLError)."""
    check_settings(caps, settings(), f"FLASHRL_CONFIG={rc.source}")
    refuse_model(rc, rc.entry.model or policy_model)
    moe = is_moe(rc.entry.model or policy_model)
    fmt, engine_online = served_format(rc, caps, moe)
    # the engine's online FP8 is per-tensor FP8 of the BF16 weights: served where that format is
    refuse_unserved(rc, caps, QuantFn.fp8_tensor if engine_online else fmt, moe, policy_model)
    refuse_caller_args(rc, caps, engine_online, fmt, quantization, kv_cache_dtype)
    if rc.entry.logprobs_mode is not None and rc.entry.logprobs_mode not in caps.logprobs_modes:
        raise FlashRLError(f"FLASHRL_CONFIG={rc.source}: logprobs_mode {rc.entry.logprobs_mode} is not available on "
                           f"{caps.engine} (its rollout logprobs: {caps.logprobs})", None,
                           f"use logprobs_mode {' | '.join(caps.logprobs_modes)} on {caps.engine}")
    kv = caps.kv_dtype(rc.entry.kv_cache_dtype) if rc.entry.fp8_kv_cache else None
    if is_fp8_kv(kv or kv_cache_dtype):
        refuse_model(rc, rc.entry.model or policy_model, kv_cache=True)
        if not caps.fp8_kv_cache:
            raise FlashRLError(f"kv_cache_dtype {kv or kv_cache_dtype} (FLASHRL_CONFIG={rc.source}): "
                               f"{caps.engine} {caps.fp8_kv_note}", None,
                               "unset FLASHRL_KV_CACHE_DTYPE / kv_cache_dtype, or run on a GPU")
        if kv is None:
            log.info("flashrl: kv_cache_dtype=%s set by the caller: its scales are recalibrated after every "
                     "weight sync, as with FLASHRL_KV_CACHE_DTYPE", kv_cache_dtype)
    warn_unread_keys(rc, caps.engine)
    checkpoint = None if engine_online else checkpoint_for(rc, fmt, policy_model)
    return ServingPlan(served=fmt, engine_online_fp8=engine_online, checkpoint=checkpoint,
                       tokenizer=policy_model if checkpoint is not None else None, kv_cache_dtype=kv,
                       lmhead_fp32=rc.lmhead_fp32, logprobs_mode=rc.entry.logprobs_mode,
                       quantization=(rc.entry.quantization or "fp8") if engine_online else None)
