"""vLLM's W4A16 linears through flashrl's Triton GEMM (issue 75's tail; FLASHRL_W4A16_GEMM=1, opt-in until measured).

On Hopper vLLM serves compressed-tensors W4A16 linears with Machete, which repacks the codes into its own layout
after every load (`machete_prepack_B`) and reads them at ~1.7 TB/s in the tail of an RL step. Under the switch:
- AROUND `MacheteLinearKernel.process_weights_after_loading`: the layer keeps the checkpoint's layout -- `[N, K / 8]`
  packed codes, `[N, K / 128]` scales, as the sync writes them -- as plain Parameters (what Machete's transform
  leaves for torch.compile too); nothing is repacked, at start or after a sync's reload;
- AROUND `apply_weights`: such a layer runs `flashrl::w4a16_linear` (quant/kernels/w4a16_gemm.py) at every batch
  size, a custom op opaque to torch.compile; the tile variants of the layer's shape are compiled on its first call
  outside a CUDA graph capture (vLLM's profiling run), so each captured batch size finds its kernel built.
The kernel sums in a fixed order (no split-K, no atomics): a synced engine equals a fresh one on the same batches.
Layers Machete would serve with zero points, activation reordering or another group than 128 keep Machete.
The switch is part of vLLM's compile-cache key (engine_args.compiled_switches).
"""

from __future__ import annotations

import logging

import torch

from flashrl_tools.config.settings import settings
from flashrl_tools.quant.kernels import w4a16_gemm as kernel

log = logging.getLogger("flashrl_tools.runtime")
FLAG = "_flashrl_w4a16"  # set on a layer whose parameters stay in the checkpoint's layout
_warmed: set[tuple] = set()


@torch.library.custom_op("flashrl::w4a16_linear", mutates_args=())
def w4a16_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    kind = (tuple(w.shape), x2.dtype, bias is None)
    if kind not in _warmed and not (x2.is_cuda and torch.cuda.is_current_stream_capturing()):
        kernel.warm(x2, w, scale, bias)
        if not _warmed:
            log.info("%s (FLASHRL_W4A16_GEMM; every batch size, the checkpoint's layout)", kernel.LOG_LINE)
        _warmed.add(kind)
    return kernel.w4a16_mm(x2, w, scale, bias).reshape(*x.shape[:-1], w.shape[0])


@w4a16_linear.register_fake
def _(x, w, scale, bias):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def on_gpu(w: torch.Tensor) -> bool:
    return w.is_cuda


def serves(kernel_obj, layer) -> bool:
    """Whether flashrl's GEMM serves this Machete layer: the switch on, a CUDA layer of symmetric 4-bit codes in
    groups of 128 (compressed-tensors' `uint4b8`), no zero points, no activation order."""
    c = kernel_obj.config
    w, s = getattr(layer, kernel_obj.w_q_name, None), getattr(layer, kernel_obj.w_s_name, None)
    if not (settings().w4a16_gemm and w is not None and s is not None and on_gpu(w)):
        return False
    k, n = c.partition_weight_shape  # [in, out]: compressed-tensors' [N, K / 8] codes, [N, K / 128] scales (not GPTQ's)
    return (c.group_size == kernel.GROUP and not c.zero_points and not getattr(c, "has_g_idx", False)
            and str(c.weight_type) == "uint4b8" and c.act_type in (torch.bfloat16, torch.float16)
            and s.dtype == c.act_type and w.dtype == torch.int32 and kernel_obj.w_q_name == "weight_packed"
            and tuple(w.shape) == (n, k // 8) and tuple(s.shape) == (n, k // kernel.GROUP))


def process_weights_after_loading(original, kernel_obj, layer, *args, **kwargs):
    """AROUND Machete's processing: a layer flashrl's GEMM takes keeps the checkpoint's layout."""
    if not serves(kernel_obj, layer):
        setattr(layer, FLAG, False)
        return original(kernel_obj, layer, *args, **kwargs)
    for name in (kernel_obj.w_q_name, kernel_obj.w_s_name):
        param = getattr(layer, name)
        setattr(layer, name, torch.nn.Parameter(param.data.contiguous(), requires_grad=False))
    setattr(layer, FLAG, True)
    return None


def apply_weights(original, kernel_obj, layer, x, bias=None, *args, **kwargs):
    """AROUND Machete's `apply_weights`: a layer kept in the checkpoint's layout runs flashrl's GEMM."""
    if not getattr(layer, FLAG, False) or args or kwargs:
        return original(kernel_obj, layer, x, bias, *args, **kwargs)
    w, scale = getattr(layer, kernel_obj.w_q_name), getattr(layer, kernel_obj.w_s_name)
    return torch.ops.flashrl.w4a16_linear(x, w, scale, bias)
