"""SGLang's `ServerArgs`: which checkpoint the engine serves for a config (the same online-quantized
cache or calibrated checkpoint as for vLLM), the policy's tokenizer, the FP8 KV cache
(FLASHRL_KV_CACHE_DTYPE; its scales: kv_scales.py), and refusals at start for what the SGLang side
does not serve."""

from __future__ import annotations

import logging
from pathlib import Path

from flashrl_tools.config.resolve import RuntimeConfig
from flashrl_tools.errors import FlashRLError
from flashrl_tools.model_structure import is_moe
from flashrl_tools.quantizer import QuantFn

log = logging.getLogger("flashrl_tools.runtime")

# the quantized layouts SGLang keeps in the storage it loaded (runtime/sglang/weight_sync.py):
# per-channel INT8 and FP8. Per-tensor FP8 of fused layers is requantized to one scale at load.
SERVED = {QuantFn.int8, QuantFn.fp8_channel}


def sglang_format(rc: RuntimeConfig) -> QuantFn | None:
    """The checkpoint format an SGLang engine serves for `rc` (None: BF16). `fp8` (vLLM's online
    per-tensor FP8) is served as per-channel FP8 checkpoints, as on MoE models under vLLM."""
    fn = rc.entry.fn
    if fn.vllm_online_fp8:
        return QuantFn.fp8_channel
    return fn.quant_fn if fn.quantized else None


def overrides(rc: RuntimeConfig, policy_model: str) -> dict:
    """`ServerArgs` fields the config changes for an engine asked to serve `policy_model`."""
    from flashrl_tools.mixed import KeepSpec
    from flashrl_tools.runtime.online_cache import ensure_profile_applied, ensure_quantized

    entry, fmt = rc.entry, sglang_format(rc)
    kv = {"kv_cache_dtype": kv_cache_dtype(rc)} if entry.fp8_kv_cache else {}
    if fmt is None:
        return kv
    if fmt not in SERVED:
        raise FlashRLError(f"FLASHRL_CONFIG={rc.source}: {fmt.value} checkpoints are not served on SGLang "
                           "(it re-quantizes fused per-tensor layers at load; block FP8 is unchecked)", None,
                           "use int8, fp8 or fp8_channel with SGLang")
    if not fmt.is_fp8 and is_moe(policy_model):
        raise FlashRLError(f"FLASHRL_CONFIG={rc.source}: SGLang 0.5.17 serves compressed-tensors INT8 MoE experts on "
                           "NPU only (CompressedTensorsConfig.get_moe_scheme)", policy_model,
                           "use FLASHRL_CONFIG=fp8 (per-channel FP8 experts) with SGLang, or vLLM for int8 MoE")
    keep = KeepSpec.of(entry)
    if entry.model is not None and keep:
        out = {"model_path": str(ensure_profile_applied(Path(policy_model), Path(entry.profile), keep))}
    elif entry.model is not None:
        out = {"model_path": entry.model}
    else:
        out = {"model_path": str(ensure_quantized(Path(policy_model), fmt, keep, entry.fp8_scale_pow2))}
    out["tokenizer_path"] = policy_model
    return {**out, **kv}


def kv_cache_dtype(rc: RuntimeConfig) -> str:
    """SGLang's name of the config's FP8 KV-cache dtype (its `--kv-cache-dtype` choices)."""
    return {"fp8": "fp8_e4m3"}.get(rc.entry.kv_cache_dtype, rc.entry.kv_cache_dtype)


def apply_overrides(rc: RuntimeConfig, args) -> dict:
    """Change `args` (a ServerArgs before its __post_init__) in place; returns what changed."""
    if getattr(args, "quantization", None) not in (None, "compressed-tensors") and sglang_format(rc) is not None:
        raise FlashRLError(f"quantization={args.quantization!r} passed to SGLang conflicts with "
                           f"FLASHRL_CONFIG={rc.source} (it serves compressed-tensors checkpoints)", None,
                           "drop the quantization argument, or unset FLASHRL_CONFIG")
    if getattr(args, "load_format", "auto") == "flash_rl":
        raise FlashRLError(f"load_format='flash_rl' (SGLang's own online FP8) and FLASHRL_CONFIG={rc.source} "
                           "would both quantize the pushed weights", None, "drop load_format, or unset FLASHRL_CONFIG")
    asked = getattr(args, "kv_cache_dtype", "auto")
    if rc.entry.fp8_kv_cache and asked not in ("auto", kv_cache_dtype(rc)):
        raise FlashRLError(f"kv_cache_dtype={asked!r} passed to SGLang conflicts with FLASHRL_CONFIG={rc.source}'s "
                           f"{rc.entry.kv_cache_dtype} KV cache", None,
                           "drop the kv_cache_dtype argument, or unset FLASHRL_KV_CACHE_DTYPE")
    if not rc.entry.fp8_kv_cache and str(asked).startswith("fp8"):  # as on vLLM: recalibrated all the same
        log.info("flashrl: kv_cache_dtype=%s set by the caller: its scales are recalibrated after every weight "
                 "sync, as with FLASHRL_KV_CACHE_DTYPE", asked)
    changed = overrides(rc, args.model_path)
    if args.tokenizer_path:  # the caller's own tokenizer stays
        changed.pop("tokenizer_path", None)
    if getattr(args, "_declarations_materialized", False) and hasattr(args, "override"):
        # SGLang 0.5.17 freezes ServerArgs after __post_init__: a late application (verl builds the
        # arguments before the plugins load) goes through its one mutation point
        args.override("flashrl_tools", **changed)
    else:
        for key, value in changed.items():
            setattr(args, key, value)
    return changed
