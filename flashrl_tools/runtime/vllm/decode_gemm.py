"""vLLM's INT8 W8A8 linears at decode shapes through flashrl's few-rows Triton GEMM (issue 45; FLASHRL_DECODE_GEMM:
the switch, `auto` and the kernel's exactness are core/decode_gemm.py).

AROUND `CutlassInt8ScaledMMLinearKernel.apply_weights`: a layer with dynamic per-token symmetric activations
(compressed-tensors W8A8, what `FLASHRL_CONFIG=int8` serves) runs one custom op, `flashrl::int8_linear`:
vLLM's own `scaled_int8_quant`, then the Triton GEMM for at most N rows and vLLM's CUTLASS kernel above. The op
is opaque to torch.compile (its fake returns the output's shape), so each captured CUDA graph takes the branch
of its batch size. Static or asymmetric activation scales keep vLLM's path. Under `auto` every CUDA INT8 linear
of this kind is the op and the op resolves `auto` when it first runs: a graph loaded from vLLM's compile cache
(its AOT cache skips tracing, so `apply_weights` never runs) still takes the Triton path, and it does not depend
on the chip that traced it. The switch is part of vLLM's compile-cache key (engine_args.compiled_switches).
"""

from __future__ import annotations

import torch

from flashrl_tools.runtime.core import decode_gemm as core


@torch.library.custom_op("flashrl::int8_linear", mutates_args=())
def int8_linear(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from vllm import _custom_ops as ops

    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    x_q, x_s, _ = ops.scaled_int8_quant(x2, None, None, symmetric=True)
    out = core.linear(x_q, w_q, x_s, w_s, x.dtype, bias, lambda: ops.cutlass_scaled_mm(
        x_q, w_q, scale_a=x_s, scale_b=w_s, out_dtype=x.dtype, bias=bias))
    return out.reshape(*x.shape[:-1], w_q.shape[1])


@int8_linear.register_fake
def _(x, w_q, w_s, bias):
    return x.new_empty((*x.shape[:-1], w_q.shape[1]))


def apply_weights(original, kernel, layer, x, bias=None, *args, **kwargs):
    """AROUND vLLM's CUTLASS INT8 kernel's `apply_weights`: dynamic symmetric per-token activations go through
    `flashrl::int8_linear` on CUDA when FLASHRL_DECODE_GEMM is on or `auto`; everything else is vLLM's own path."""
    w_q, w_s, i_s, _i_zp, azp_adj = kernel._get_layer_params(layer)
    if not core.active() or args or kwargs or i_s is not None or azp_adj is not None or not x.is_cuda:
        return original(kernel, layer, x, bias, *args, **kwargs)
    return torch.ops.flashrl.int8_linear(x, w_q, w_s, bias)
