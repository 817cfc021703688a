"""vLLM-CPU's INT8 linears (`CPUInt8ScaledMMLinearKernel`, oneDNN path): two fixes, installed in every vLLM
process by flashrl's plugin, FLASHRL_CONFIG set or not (`always`: a fresh engine on a pre-quantized
checkpoint, as verify starts, computes as the runtime's engines do).

- The oneDNN handler keeps raw pointers to the scale tensors it was built with; the layerwise reload of
  a sync frees them (every token id 0 afterwards): references are kept as long as the handler.
- On x86 hosts without VNNI (AVX2 only) oneDNN adds u8 x s8 pairs in int16 with saturation (vpmaddubsw):
  measured on an AVX2 AMD EPYC host (2026-11-27), full-range W8A8 products came out 14 % off and the
  INT8 SmolLM2 answered in French. Where a one-off probe of the kernel shows this, each linear computes
  exactly instead: vLLM's own activation quantization, the int8 x int8 products summed in float32
  against a float32 copy of the weight kept when vLLM processes the layer (exact while a sum stays
  below 2**24), then vLLM's scales, zero point and bias. Hosts whose kernel is exact are left as they are.
"""

from __future__ import annotations

import functools
import logging

import torch

from flashrl_tools.runtime.core.adapter import Hook, HookKind

log = logging.getLogger("flashrl_tools.runtime")
EXACT = "_flashrl_exact_weight"  # on the kernel: the layer's int8 weight as float32 [K, N]


@functools.cache
def saturates() -> bool:
    """Whether this host's oneDNN INT8 GEMM saturates: 64 products 127 x 127, scaled by 1 / 127, must sum
    to 64 * 127 (measured on an AVX2 host: 64.0)."""
    from vllm import _custom_ops as ops

    k, n = 64, 8
    weight = torch.full((n, k), 127, dtype=torch.int8)
    scale = torch.ones(n, 1, dtype=torch.float32)  # the handler points to it: alive until the GEMM ran
    handler = ops.create_onednn_scaled_mm(weight.t(), scale, torch.bfloat16, True, False, 1)
    x, x_scale = torch.full((1, k), 127, dtype=torch.int8), torch.full((1, 1), 1 / 127, dtype=torch.float32)
    out = torch.empty(1, n, dtype=torch.bfloat16)
    ops.onednn_scaled_mm(handler, x, out, x_scale, None, None, None)
    bad = not torch.allclose(out.float(), torch.full((1, n), 64 * 127.0, dtype=torch.float32), rtol=1e-2)
    if bad:
        log.warning("flashrl: vLLM-CPU's oneDNN INT8 GEMM saturates on this host (no VNNI); INT8 linears are "
                    "computed exactly in float32 instead (slower)")
    return bad


def process_for_onednn(original, kernel, layer, *args, **kwargs):
    """AROUND `process_weights_for_onednn`: keep the weight as float32 where the kernel saturates,
    then the scale tensors the handler points to."""
    weight = getattr(layer, kernel.layer_param_names[0])
    exact = weight.detach().t().float().contiguous() if saturates() else None
    result = original(kernel, layer, *args, **kwargs)
    setattr(kernel, EXACT, exact)
    kernel._flashrl_handler_tensors = tuple(getattr(layer, n, None) for n in kernel.layer_param_names)
    return result


def exact_linear(kernel, layer, x: torch.Tensor, bias: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
    """What `_apply_weights_onednn` computes, without int16 saturation: s_x * s_w * (x_q @ w) - s_x * zp_x * adj + b."""
    from vllm import _custom_ops as ops

    _, w_s, i_s, i_zp, azp_adj = kernel._get_layer_params(layer)
    rows = x.reshape(-1, x.shape[-1])
    x_q, x_s, x_zp = ops.onednn_scaled_int8_quant(rows, i_s, i_zp, kernel.config.input_symmetric)
    x_s = _per_row(x_s)
    out = (x_q.float() @ weight) * w_s.float().reshape(1, -1) * x_s
    if x_zp is not None:
        out -= x_s * _per_row(x_zp) * azp_adj.float().reshape(1, -1)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[1])


def _per_row(t: torch.Tensor) -> torch.Tensor:
    """A per-token (column) or per-tensor (scalar) activation scale / zero point, as float32."""
    return t.float().reshape(-1, 1) if t.numel() > 1 else t.float().reshape(())


def apply_onednn(original, kernel, layer, x, bias=None):
    """AROUND `_apply_weights_onednn`: the exact linear where the weight was kept (saturating hosts)."""
    weight = getattr(kernel, EXACT, None)
    return original(kernel, layer, x, bias) if weight is None else exact_linear(kernel, layer, x, bias, weight)


_KERNEL = "vllm.model_executor.kernels.linear.scaled_mm.cpu.CPUInt8ScaledMMLinearKernel"
HOOKS: tuple[Hook, ...] = (
    Hook("cpu_int8_kernel", f"{_KERNEL}.process_weights_for_onednn", process_for_onednn, HookKind.AROUND,
         "worker (CPU)", "vLLM-CPU's oneDNN INT8 kernel keeps its scale tensors alive, and a float32 weight "
         "where its GEMM saturates (no VNNI); also without FLASHRL_CONFIG", optional=True, always=True),
    Hook("cpu_int8_exact", f"{_KERNEL}._apply_weights_onednn", apply_onednn, HookKind.AROUND, "worker (CPU)",
         "INT8 linears computed exactly where vLLM-CPU's oneDNN GEMM saturates (x86 without VNNI); also without "
         "FLASHRL_CONFIG", optional=True, always=True),
)

