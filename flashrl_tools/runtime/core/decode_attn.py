"""FLASHRL_DECODE_ATTN, the engine-neutral half (issue 45): whether this process's FP8 KV decode batches take
flashrl's kernel (`quant/kernels/fp8_decode_attn.py`), its launch, and the once-per-process log line the GPU
tests read. Each adapter decides which of its engine's attention calls are decode batches the kernel computes
exactly: `runtime/vllm/decode_attn.py` (FA3's `FlashAttentionImpl.forward`), `runtime/sglang/decode_attn.py`
(fa3's `flash_attn_with_kvcache` in its decode step)."""

from __future__ import annotations

import functools
import logging

import torch

from flashrl_tools.config.settings import settings
from flashrl_tools.quant.kernels import fp8_decode_attn

log = logging.getLogger("flashrl_tools.runtime")
LOG_LINE = "FP8 KV decode attention through flashrl's Triton kernel"  # logged once per process (the GPU tests read it)
_state: dict = {}  # "on": the switch, resolved once per process; "logged": a batch went through the kernel


def resolve(value: str, capability: tuple[int, int]) -> bool:
    """FLASHRL_DECODE_ATTN on a device of this capability: 1 on, 0 off, `auto` (unset) on Hopper (sm_90), where the
    kernel's tiles were swept and both adapters passed their GPU tests."""
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


def attend(q, k_cache, v_cache, out, block_table, seq_lens, query_start_loc, scale, k_scale, v_scale,
           q_scale=None, splits=None, via: str = "") -> torch.Tensor:
    """The kernel on one decode batch (its operands: `fp8_decode_attn.fp8_decode_attention`), at the measured
    defaults for this device; the first batch of the process is logged."""
    fp8_decode_attn.fp8_decode_attention(q, k_cache, v_cache, out, block_table, seq_lens, query_start_loc, scale,
                                         k_scale, v_scale, q_scale=q_scale, splits=splits,
                                         sm_count=_sm_count(q.device.index or 0))
    if "logged" not in _state:
        _state["logged"] = True
        log.info("%s (FLASHRL_DECODE_ATTN; %s)", LOG_LINE, via)
    return out
