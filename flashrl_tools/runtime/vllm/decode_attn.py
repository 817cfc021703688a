"""vLLM's FlashAttention backend over an FP8 KV cache: decode batches through flashrl's FP8 decode kernel
(issue 45; FLASHRL_DECODE_ATTN: unset / `auto` on Hopper, 1 on, 0 off).

AROUND `FlashAttentionImpl.forward`: a batch where every request has one query token (`max_query_len == 1`: what
vLLM's decode CUDA graphs capture) over an FP8 E4M3 cache with per-tensor scales runs
`quant.kernels.fp8_decode_attn` on the same cache, query (FP8 as the layer quantized it, with `_q_scale`) and
scales; anything else -- prefills, mixed batches, cascade, sliding windows, ALiBi, soft-capping, sinks, context
parallelism, a BF16 cache -- keeps FA3. The kernel reads the scale tensors on the device, so a recalibration needs
no graph capture. The cache write stays vLLM's (`do_kv_cache_update`). The choice depends only on the batch's
shape, so a synced engine and a fresh one started with the same settings run the same kernels on the same batches
(tests/gpu/test_vllm_runtime.py's `+kv` cases pass with it). Measured on an H200 (RESULTS "flashrl's FP8 decode
attention"): FA3's FP8 speed from 64 sequences up, 3-19 % faster at 16 (7B, 14B: 16-19 %); 1.9 % off a Qwen3-8B
colocated step; the attention's error against float32 ~13x smaller than FA3's (the probabilities stay FP16 where
FA3 rounds them to FP8).
"""

from __future__ import annotations

import functools
import logging

import torch

from flashrl_tools.config.settings import settings
from flashrl_tools.quant.kernels import fp8_decode_attn

log = logging.getLogger("flashrl_tools.runtime")
LOG_LINE = "FP8 KV decode attention through flashrl's Triton kernel"  # logged once per process (the GPU tests read it)
_state: dict = {}


def resolve(value: str, capability: tuple[int, int]) -> bool:
    """FLASHRL_DECODE_ATTN on a device of this capability: 1 on, 0 off, `auto` (unset) on Hopper (sm_90), where the
    kernel's tiles were swept and the engine test ran."""
    return value == "1" or value == "auto" and tuple(capability) == (9, 0)


def enabled(device: torch.device) -> bool:
    """FLASHRL_DECODE_ATTN, resolved once per process on its first CUDA batch (`resolve`)."""
    if "on" not in _state:
        _state["on"] = resolve(settings().decode_attn, torch.cuda.get_device_capability(device))
    return _state["on"]


def ran() -> bool:
    """Whether a decode batch of this process went through flashrl's kernel (the benchmarks record it per row)."""
    return bool(_state.get("logged"))


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def served(impl, layer, query, attn_metadata, args, kwargs) -> bool:
    """Whether this call is a decode batch the kernel computes exactly as specified (module docstring)."""
    if args or kwargs.get("output_scale") is not None or kwargs.get("output_block_scale") is not None:
        return False
    if attn_metadata is None or not query.is_cuda or attn_metadata.max_query_len != 1:
        return False
    if getattr(attn_metadata, "use_cascade", False) or getattr(impl, "dcp_world_size", 1) > 1:
        return False
    window = getattr(impl, "sliding_window", None)
    if window not in (None, (-1, -1), [-1, -1]) or getattr(impl, "alibi_slopes", None) is not None:
        return False
    if getattr(impl, "logits_soft_cap", 0) or getattr(impl, "sinks", None) is not None:
        return False
    if str(getattr(impl, "attn_type", "decoder")).lower().rsplit(".", 1)[-1] != "decoder":
        return False
    return str(impl.kv_cache_dtype) in ("fp8", "fp8_e4m3") and query.dtype in (torch.float8_e4m3fn, torch.bfloat16,
                                                                                torch.float16)


def forward(original, impl, layer, query, key, value, kv_cache, attn_metadata, output=None, *args, **kwargs):
    """AROUND FlashAttentionImpl.forward: decode batches over an FP8 cache through flashrl's kernel."""
    if output is None or not served(impl, layer, query, attn_metadata, args, kwargs) or not enabled(query.device):
        return original(impl, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
    fp8 = torch.float8_e4m3fn
    key_cache, value_cache = kv_cache.transpose(1, 2).split(impl.head_size, dim=-1)  # vLLM's (B, H, N, 2D) view
    n = attn_metadata.num_actual_tokens
    q = query[:n].view(n, impl.num_heads, impl.head_size)
    out = output[:n].view(n, impl.num_heads, impl.head_size)
    seq_lens = attn_metadata.seq_lens
    splits = fp8_decode_attn.splits_for(seq_lens.shape[0], impl.num_kv_heads, _sm_count(query.device.index or 0))
    fp8_decode_attn.fp8_decode_attention(
        q, key_cache.view(fp8), value_cache.view(fp8), out, attn_metadata.block_table, seq_lens,
        attn_metadata.query_start_loc, impl.scale, layer._k_scale, layer._v_scale,
        q_scale=layer._q_scale if query.dtype == fp8 else None, splits=splits)
    if "logged" not in _state:
        _state["logged"] = True
        log.info("%s (FLASHRL_DECODE_ATTN)", LOG_LINE)
    return output
