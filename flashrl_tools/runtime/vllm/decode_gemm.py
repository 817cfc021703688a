"""vLLM's INT8 W8A8 linears at decode shapes through flashrl's few-rows Triton GEMM (issue 45; opt-in with
FLASHRL_DECODE_GEMM=N: at most N rows, 1..64).

AROUND `CutlassInt8ScaledMMLinearKernel.apply_weights`: a layer with dynamic per-token symmetric activations
(compressed-tensors W8A8, what `FLASHRL_CONFIG=int8` serves) runs one custom op, `flashrl::int8_linear`: at most N
rows `quant.kernels.w8a8_gemm` on the 16-bit activations (vLLM's per-token quantization done inside the GEMM, bit
for bit), above that vLLM's own `scaled_int8_quant` and CUTLASS kernel. The op is opaque to torch.compile (its fake
returns the output's shape), so each captured CUDA graph takes the branch of its batch size. The Triton kernel's
output equals CUTLASS's bit for bit (int32 accumulation, CUTLASS's epilogue order: tests/test_kernels.py,
benchmarks/small_m_gemm.py), so a sequence's tokens and logprobs do not depend on the switch or on the batch it
decodes in. Static or asymmetric activation scales keep vLLM's path.
"""

from __future__ import annotations

import logging

import torch

from flashrl_tools.quant.kernels import w8a8_gemm

log = logging.getLogger("flashrl_tools.runtime")
max_rows = 0  # FLASHRL_DECODE_GEMM, set by the adapter's install (0: off; read while torch.compile traces)
_used: set[int] = set()  # non-empty once the Triton path ran (logged once)
_warmed: set[tuple] = set()  # the operand kinds and layer shapes whose tile variants are compiled


@torch.library.custom_op("flashrl::int8_linear", mutates_args=())
def int8_linear(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from vllm import _custom_ops as ops

    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    kind = (bias is None, w_s.numel() > 1, x.dtype, tuple(w_q.shape))  # the tiles depend on the layer's shape
    if max_rows and kind not in _warmed and x2.is_cuda and not torch.cuda.is_current_stream_capturing():
        w8a8_gemm.warm(x2, w_q, None, w_s, x.dtype, bias, max_rows)  # before a graph captures it (vLLM's profile run)
        _warmed.add(kind)
    if w8a8_gemm.served(x2, w_q, x.dtype, max_rows):
        out = w8a8_gemm.w8a8_mm(x2, w_q, None, w_s, x.dtype, bias)
        if not _used:
            log.info("INT8 linears at <= %d rows through flashrl's Triton GEMM (FLASHRL_DECODE_GEMM)", max_rows)
            _used.add(1)
    else:
        x_q, x_s, _ = ops.scaled_int8_quant(x2, None, None, symmetric=True)
        out = ops.cutlass_scaled_mm(x_q, w_q, scale_a=x_s, scale_b=w_s, out_dtype=x.dtype, bias=bias)
    return out.reshape(*x.shape[:-1], w_q.shape[1])


@int8_linear.register_fake
def _(x, w_q, w_s, bias):
    return x.new_empty((*x.shape[:-1], w_q.shape[1]))


def apply_weights(original, kernel, layer, x, bias=None, *args, **kwargs):
    """AROUND vLLM's CUTLASS INT8 kernel's `apply_weights`: dynamic symmetric per-token activations go through
    `flashrl::int8_linear` on CUDA when FLASHRL_DECODE_GEMM is on; everything else is vLLM's own path."""
    w_q, w_s, i_s, _i_zp, azp_adj = kernel._get_layer_params(layer)
    if not max_rows or args or kwargs or i_s is not None or azp_adj is not None or not x.is_cuda:
        return original(kernel, layer, x, bias, *args, **kwargs)
    return torch.ops.flashrl.int8_linear(x, w_q, w_s, bias)
