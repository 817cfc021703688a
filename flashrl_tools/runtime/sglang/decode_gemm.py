"""SGLang's INT8 W8A8 linears at decode shapes through flashrl's few-rows Triton GEMM (issue 45; FLASHRL_DECODE_GEMM:
the switch, `auto` and the kernel's exactness are core/decode_gemm.py).

AROUND `CompressedTensorsW8A8Int8.apply_weights` (what `FLASHRL_CONFIG=int8` serves): a layer with dynamic
per-token symmetric activations runs SGLang's own `per_token_quant_int8`, then the Triton GEMM for at most N rows
and sgl-kernel's `int8_scaled_mm` above, on the operands SGLang would pass it. SGLang runs the model eagerly
inside CUDA graphs captured per batch size, so each graph holds the branch of its size; the tile variants compile
in SGLang's warm-up runs before each capture. Static or asymmetric activation scales keep SGLang's path."""

from __future__ import annotations

from flashrl_tools.runtime.core import decode_gemm as core


def scheme_apply_weights(original, scheme, layer, x, bias=None):
    """AROUND the scheme's `apply_weights`: dynamic symmetric per-token activations on CUDA go through
    `core.linear` when FLASHRL_DECODE_GEMM is on or `auto`; everything else is SGLang's own path."""
    if not core.active() or not x.is_cuda or x.dim() != 2 or scheme.is_static_input_scheme or not scheme.input_symmetric:
        return original(scheme, layer, x, bias)
    from sgl_kernel import int8_scaled_mm
    from sglang.kernels.ops.quantization.int8_kernel import per_token_quant_int8

    x_q, x_s = per_token_quant_int8(x)
    return core.linear(x_q, layer.weight, x_s, layer.weight_scale, x.dtype, bias, lambda: int8_scaled_mm(
        x_q, layer.weight, x_s, layer.weight_scale, out_dtype=x.dtype, bias=bias))
