"""Which processed layouts of vLLM 0.26's quantized layers the in-place sync knows (read from its
kernels; DEVELOPERS.md "In-place fast sync"): the layer's storage is the checkpoint tensor as
loaded, transposed (dense) or as is (MoE experts), so re-quantized rows can be written into it.

- compressed-tensors W8A8 INT8, channel weight scales, dynamic symmetric activations, Cutlass or
  Triton kernel: `weight` = `weight.t()` of the [N, K] checkpoint storage; `weight_scale` [N, 1]
  float32 as loaded.
- compressed-tensors W8A8 FP8, channel weight scales, dynamic activations, Cutlass kernel: the
  same, with N and K zero-padded to multiples of 16 (scale padded with 1.0) when they are not.
- compressed-tensors W8A8 INT8 MoE experts (TRITON backend) and W8A8 FP8 channel MoE experts
  (VLLM_CUTLASS or TRITON backend): `w13_weight` [E, 2I, H] (gate rows, then up), `w2_weight`
  [E, H, I] and the [E, N, 1] channel scales as loaded; per (expert, shard).
- vLLM's online per-tensor FP8 (`FLASHRL_CONFIG=fp8` on a dense model: `Fp8PerTensorOnlineLinear
  Method`, Cutlass kernel): the layer's BF16 weight is quantized whole with one scale, so its
  shards are staged and quantized with the same vLLM call once all are in (runtime/vllm/inplace.py).
Anything else (FP8 tensor / block checkpoints, per-tensor FP8 experts, unknown kernels, ROCm, CPU)
is not known: those layers sync through vLLM's layerwise reload.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the engine objects read here (by their attributes: nothing of vLLM is imported at run time)
    from vllm.model_executor.layers.linear import LinearBase

# kernel classes whose process_weights_after_loading leaves weight.t() (+ padding) and the
# channel scale as loaded (vLLM 0.26: kernels/linear/scaled_mm/cutlass.py, triton.py)
INT8_KERNELS = frozenset({"CutlassInt8ScaledMMLinearKernel", "TritonInt8ScaledMMLinearKernel"})
FP8_KERNELS = frozenset({"CutlassFP8ScaledMMLinearKernel"})
ONLINE_FP8 = "OnlineFp8PerTensor"  # the layout name of vLLM's online per-tensor FP8 linears
ONLINE_METHOD = "Fp8PerTensorOnlineLinearMethod"


def layout(layer: LinearBase) -> str | None:
    """The known processed layout of a loaded layer, or None."""
    method = type(getattr(layer, "quant_method", None)).__name__
    if method not in ("CompressedTensorsLinearMethod", ONLINE_METHOD):
        return None
    if not torch.cuda.is_available() or getattr(torch.version, "hip", None):
        return None  # ROCm rescales FP8 (fnuz); CPU kernels prepack
    online = method == ONLINE_METHOD
    kernel, dtype = _online_fp8_kernel(layer) if online else _compressed_tensors_kernel(layer)
    if kernel is None or not _stored_as(layer, dtype, one_scale=online):
        return None
    return ONLINE_FP8 if online else type(kernel).__name__


def _compressed_tensors_kernel(layer: LinearBase) -> tuple[object | None, torch.dtype | None]:
    """A compressed-tensors W8A8 linear with channel weight scales and dynamic activations on a
    kernel whose layout is known: (kernel, weight dtype), else (None, None)."""
    scheme = getattr(layer, "scheme", None)
    strategy = getattr(scheme, "strategy", None)
    if scheme is None or getattr(strategy, "value", strategy) != "channel" \
            or getattr(scheme, "is_static_input_scheme", True):
        return None, None
    scheme_name = type(scheme).__name__
    if scheme_name == "CompressedTensorsW8A8Int8":
        kernel = getattr(scheme, "kernel", None)
        if getattr(scheme, "input_symmetric", False) and type(kernel).__name__ in INT8_KERNELS:
            return kernel, torch.int8
    elif scheme_name == "CompressedTensorsW8A8Fp8":
        kernel = getattr(scheme, "fp8_linear", None)
        if type(kernel).__name__ in FP8_KERNELS:
            return kernel, torch.float8_e4m3fn
    return None, None


def _online_fp8_kernel(layer: LinearBase) -> tuple[object | None, torch.dtype | None]:
    """vLLM 0.26's online per-tensor FP8 linear (quantization/online/fp8.py): `process_weights_
    after_loading` = `ops.scaled_fp8_quant(weight)` of the whole [N, K] BF16 weight (one scale for
    all shards of a fused layer), `weight` = that `.t()`, `weight_scale` [1] float32, then the
    Cutlass FP8 kernel's padding of N and K to multiples of 16 (the scale is not padded)."""
    if hasattr(layer.quant_method, "get_weight_for_quantization"):
        return None, None  # later vLLM (0.32): scale from a TP-wide amax / a requantization source
    kernel = getattr(layer.quant_method, "fp8_linear", None)
    return (kernel, torch.float8_e4m3fn) if type(kernel).__name__ in FP8_KERNELS else (None, None)


def _stored_as(layer: torch.nn.Module, dtype: torch.dtype, one_scale: bool) -> bool:
    """weight = the .t() view of an [N(+pad), K(+pad)] `dtype` storage, float32 weight_scale
    ([N(+pad), 1] channel scales, or one scale), nothing but those and a bias."""
    weight, scale = getattr(layer, "weight", None), getattr(layer, "weight_scale", None)
    if weight is None or scale is None or weight.dim() != 2 or weight.dtype != dtype \
            or not weight.t().is_contiguous() or scale.dtype != torch.float32 or not scale.is_contiguous() \
            or (one_scale and scale.numel() != 1):
        return False
    return not {n for n, _ in layer.named_parameters(recurse=False)} - {"weight", "weight_scale", "bias"}


def moe_layout(layer: torch.nn.Module) -> str | None:
    """The known processed layout of a loaded routed-expert layer, or None. vLLM 0.26 on CUDA
    keeps the experts as loaded -- w13_weight [E, 2I, H] (w1 rows, then w3), w2_weight [E, H, I]
    and [E, N, 1] float32 channel scales -- for compressed-tensors W8A8 INT8 on the TRITON backend
    (`convert_to_int8_moe_kernel_format` returns them: fused_moe/oracle/int8.py) and for W8A8 FP8
    with channel weights and dynamic per-token activations on the VLLM_CUTLASS or TRITON backends
    (`convert_to_fp8_moe_kernel_format` leaves them; no w1/w3 re-quantization, which per-tensor
    FP8 does: fused_moe/oracle/fp8.py, compressed_tensors_moe_w8a8_fp8.py)."""
    return moe_layout_reason(layer)[0]


def moe_layout_reason(layer: torch.nn.Module) -> tuple[str | None, str]:
    """(layout, "") or (None, why not)."""
    method = getattr(layer, "quant_method", None)
    kind = MOE_METHODS.get(type(method).__name__)
    if kind is None:
        return None, f"{type(method).__name__} experts"
    if not torch.cuda.is_available() or getattr(torch.version, "hip", None):
        return None, "not CUDA"
    backend_attr, backends, dtype = kind
    backend = getattr(method, backend_attr, None)
    backend = getattr(backend, "value", backend)
    if backend not in backends:
        return None, f"{type(method).__name__} on the {backend} backend"
    if dtype == torch.float8_e4m3fn:
        strategy = getattr(getattr(method, "weight_quant", None), "strategy", None)
        if getattr(strategy, "value", strategy) != "channel" or getattr(method, "static_input_scales", True) \
                or getattr(method, "block_quant", True):
            return None, f"FP8 experts with {getattr(strategy, 'value', strategy)} weight scales"
    if not getattr(layer.moe_config, "is_act_and_mul", False):
        return None, "experts without a gated activation"
    tensors = dict(layer.named_parameters(recurse=False))
    if set(tensors) != MOE_TENSORS:
        return None, "expert tensors other than w13/w2 and their scales"
    for name, t in tensors.items():
        want = torch.float32 if name.endswith("_scale") else dtype
        if t.dtype != want or t.dim() != 3 or not t.is_contiguous():
            return None, f"{name} stored as {t.dtype} {tuple(t.shape)}"
    return f"{backend.title().replace('_', '')}{'Int8' if dtype == torch.int8 else 'Fp8'}MoE", ""


# quant method -> (its backend attribute, backends that keep the loaded layout, weight dtype)


# quant method -> (its backend attribute, backends that keep the loaded layout, weight dtype)
MOE_METHODS = {"CompressedTensorsW8A8Int8MoEMethod": ("int8_backend", frozenset({"TRITON"}), torch.int8),
                "CompressedTensorsW8A8Fp8MoEMethod": ("fp8_backend", frozenset({"TRITON", "VLLM_CUTLASS"}),
                                                      torch.float8_e4m3fn)}


MOE_TENSORS = frozenset({"w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"})
