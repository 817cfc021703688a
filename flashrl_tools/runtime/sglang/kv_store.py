"""FP8 KV cache on SGLang's fa3 backend: a decode step's K / V store in one kernel (issue 45).

SGLang 0.5.17's fa3 backend stores K and V into an FP8 KV cache in five kernels per layer and decode step
(`MHATokenToKVPool.set_kv_buffer`: K and V divided by their scales in place, two casts, the byte store) where a
BF16 cache takes one. SGLang ships the fused kernel its TRT-LLM backend uses (`fused_fp8_qkv_kv_cache`: scale,
cast and store of K and V in one, reading the scale tensors, so captured decode graphs see recalibrated
scales). While fa3's `forward_decode` runs -- it reads K and V from the cache, not again after the store -- the
pool's store takes that kernel. Its values are SGLang's TRT-LLM backend's: K * (1 / scale) rounded once to FP8
and saturated at 448, where the five kernels divide, round to BF16, then to FP8 (NaN past 464): ~3 % of the
elements land one FP8 step apart (the BF16 rounding in between; tests/gpu/test_sglang_kv_store.py). Prefill
keeps SGLang's path (some of its paths read the divided K / V after the store). On by default (4 % off a Qwen3-8B
step on an H200; the engine test with it, tests/gpu/test_sglang.py `dense-int8+kv@fa3`, synced = fresh, passed
on an H200); FLASHRL_FUSED_KV_STORE=0 keeps SGLang's store."""

from __future__ import annotations

import logging

log = logging.getLogger("flashrl_tools.runtime")
LOG_LINE = "FP8 KV cache: fa3's decode stores K / V in one kernel"  # logged once per process (the GPU tests read it)

_decoding = 0  # > 0 while fa3's forward_decode runs (one scheduler thread per process)
_state: dict = {}  # "on": the switch, read once per process; "logged": the first fused store was logged


def in_decode(original, backend, *args, **kwargs):
    """AROUND fa3's `forward_decode`: its K / V store may take the fused kernel."""
    global _decoding
    _decoding += 1
    try:
        return original(backend, *args, **kwargs)
    finally:
        _decoding -= 1


_ARGS = ("layer", "loc_info", "k", "v", "k_scale", "v_scale")  # set_kv_buffer's first parameters (0.5.17)


def set_kv_buffer(original, pool, *args, **kwargs):
    """AROUND `MHATokenToKVPool.set_kv_buffer`: the fused store where `fusable` (its other parameters --
    layer_id_override, dcp_kv_mask -- unset), SGLang's otherwise."""
    if _decoding and 4 <= len(args) <= 6 and switched_on():
        named = dict(zip(_ARGS, args))
        scales = {k: kwargs[k] for k in ("k_scale", "v_scale") if k in kwargs and k not in named}
        rest = {k: v for k, v in kwargs.items() if k not in scales}
        if all(v is None for v in rest.values()):
            named.update(scales)
            if fusable(pool, named["k"], named["v"], named.get("k_scale"), named.get("v_scale")):
                return store(pool, **{"k_scale": None, "v_scale": None, **named})
    return original(pool, *args, **kwargs)


def on_device(t) -> bool:
    return t.is_cuda


def switched_on() -> bool:
    """FLASHRL_FUSED_KV_STORE, read once per process."""
    if "on" not in _state:
        from flashrl_tools.config.settings import settings

        _state["on"] = settings().fused_kv_store
    return _state["on"]


def fusable(pool, k, v, k_scale, v_scale) -> bool:
    """The plain token-major FP8 E4M3 pool, 16-bit K / V of one width on the GPU, scales as 1-element float32
    tensors (or none): what the fused kernel takes."""
    import torch

    return (type(pool).__name__ == "MHATokenToKVPool"
            and getattr(pool, "dtype", None) == torch.float8_e4m3fn
            and not getattr(pool, "is_quantized_kv_cache", False) and not getattr(pool, "use_hnd", False)
            and getattr(pool, "kv_cache_layout", "nhd") == "nhd"
            and k.dtype in (torch.bfloat16, torch.float16) and v.dtype == k.dtype and k.shape == v.shape
            and on_device(k)
            and all(s is None or (isinstance(s, torch.Tensor) and s.numel() == 1 and s.dtype == torch.float32)
                    for s in (k_scale, v_scale)))


def kernel():
    from sglang.kernels.ops.kvcache.fused_fp8_qkv_kv_cache import fused_fp8_qkv_kv_cache

    return fused_fp8_qkv_kv_cache


def store(pool, layer, loc_info, k, v, k_scale, v_scale) -> None:
    import torch

    loc = getattr(loc_info, "loc", loc_info)  # SGLang's KVWriteLoc, or a bare loc
    i = layer.layer_id - pool.start_layer
    kernel()(None, k, v, pool.k_buffer[i].view(torch.float8_e4m3fn), pool.v_buffer[i].view(torch.float8_e4m3fn),
             loc, k_scale, v_scale)
    if not _state.get("logged"):
        _state["logged"] = True
        log.info("%s (SGLang's fused_fp8_qkv_kv_cache)", LOG_LINE)
