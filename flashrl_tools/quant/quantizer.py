"""The quantization math: the single source of truth used by quantize, profile, verify and runtime.

Pure torch, device-agnostic, one tensor at a time. A weight of a linear layer (shape
[out_features, in_features]) becomes a `QuantizedWeight` (8-bit tensor + scale) in the layout a
compressed-tensors checkpoint stores and vLLM loads.

INT8 follows compressed-tensors / llmcompressor round-to-nearest exactly (symmetric, per output
channel, scale = absmax / 127.5 rounded to the weight's dtype, quotient computed in that dtype),
so `quantize --fn int8` is bit-identical with llmcompressor's data-free W8A8. FP8 keeps fp32
scales (as vLLM's own online FP8 does): there is no reference to match bit for bit, and fp32
scales avoid the extra clipping a bf16-rounded scale causes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashrl_tools.quant.formats import QuantFn, Strategy  # noqa: F401  (QuantFn: imported from here too)
from flashrl_tools.quant.packing import pack_int4

INT8_MIN, INT8_MAX = -128, 127
# compressed-tensors divides the symmetric range (qmax - qmin) / 2 = 255 / 2.
INT8_HALF_RANGE = 127.5
INT4_MIN, INT4_MAX = -8, 7
INT4_HALF_RANGE = 7.5  # (7 - -8) / 2
INT4_GROUP = 128  # input columns per scale (compressed-tensors' W4A16 preset)
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
FP8_BLOCK = (128, 128)
# compressed-tensors replaces a zero scale (an all-zero row) by the dtype's eps.
_FP8_ZERO_SCALE = torch.finfo(torch.float32).eps


@dataclass(frozen=True)
class QuantizedWeight:
    weight: torch.Tensor  # int8 or float8_e4m3fn, shape of the BF16 weight (4-bit: int8 codes in [-8, 7])
    weight_scale: torch.Tensor  # [out, 1] (channel), [1] (tensor), [ceil(out/128), ceil(in/128)] (block),
    #                             [out, in/128] (group)


def served_dtype(dtype: torch.dtype) -> torch.dtype:
    """8-bit weights serve a BF16 engine: an FP32/FP64 weight (a trainer's master weights, verl's
    FP32 `hf_model` checkpoint) is quantized from its BF16 rounding -- the rounding the engine
    gives every tensor it keeps in BF16 -- so quantizing a checkpoint and syncing the same tensors
    give the same bytes. Other dtypes are quantized as they are."""
    return torch.bfloat16 if dtype in (torch.float32, torch.float64) else dtype


def as_served(w: torch.Tensor) -> torch.Tensor:
    """`w` in `served_dtype`: what `quantize_weight(s)` should be given."""
    return w.to(served_dtype(w.dtype))


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a tensor, known before it is computed (lets writers plan ahead)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def output_specs(fn: QuantFn, shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, TensorSpec]:
    """What `quantize_weight(fn, w)` returns for a weight of this shape/dtype, without computing it."""
    _check_2d(shape)
    out, inp = shape
    if fn.packed:
        _check_groups(shape)
        return {"weight": TensorSpec(shape, torch.int8), "weight_scale": TensorSpec((out, inp // INT4_GROUP), dtype)}
    if fn.is_int:
        return {"weight": TensorSpec(shape, torch.int8), "weight_scale": TensorSpec((out, 1), dtype)}
    scale_shape = {Strategy.channel: (out, 1), Strategy.tensor: (1,),
                   Strategy.block: (math.ceil(out / FP8_BLOCK[0]), math.ceil(inp / FP8_BLOCK[1]))}[fn.strategy]
    return {"weight": TensorSpec(shape, FP8_DTYPE), "weight_scale": TensorSpec(scale_shape, torch.float32)}


def checkpoint_specs(fn: QuantFn, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[str, TensorSpec]]:
    """The checkpoint tensors a quantized linear weight `name` ("....weight") is stored as: `name` + `name_scale`
    (8-bit), `name_packed` + `name_scale` + `name_shape` (4-bit, compressed-tensors `pack-quantized`)."""
    specs = output_specs(fn, shape, dtype)
    if not fn.packed:
        return [(name, specs["weight"]), (f"{name}_scale", specs["weight_scale"])]
    out, inp = shape
    return [(f"{name}_packed", TensorSpec((out, inp // 8), torch.int32)), (f"{name}_scale", specs["weight_scale"]),
            (f"{name}_shape", TensorSpec((2,), torch.int32))]


def checkpoint_tensors(fn: QuantFn, name: str, q: QuantizedWeight) -> list[tuple[str, torch.Tensor]]:
    """`checkpoint_specs`' tensors of one quantized weight."""
    if not fn.packed:
        return [(name, q.weight), (f"{name}_scale", q.weight_scale)]
    return [(f"{name}_packed", pack_int4(q.weight)), (f"{name}_scale", q.weight_scale),
            (f"{name}_shape", torch.tensor(list(q.weight.shape), dtype=torch.int32))]


def quantize_weight(fn: QuantFn, w: torch.Tensor, pow2: bool = False) -> QuantizedWeight:
    """Quantize one linear weight [out, in] with the given format (round to nearest). `pow2`
    (FP8 formats): every scale rounded up to a power of two (as NeMo-RL's FP8 rollouts and
    UE8M0 scales): no value clips, and a scale's bits no longer depend on the weight's exact
    absmax, only on its binade."""
    _check_2d(tuple(w.shape))
    if pow2 and not fn.is_fp8:
        raise ValueError(f"power-of-two scales are an FP8 option, not for {fn.value}")
    if fn.packed:
        return QuantizedWeight(*_int4_group(w))
    if fn.is_int:
        return QuantizedWeight(*_int8_channel(w))
    if fn.strategy is Strategy.block:
        return QuantizedWeight(*_fp8_block(w, pow2))
    if fn.strategy is Strategy.channel:
        scale = _div(w.float().abs().amax(dim=1, keepdim=True), FP8_MAX)
    else:
        scale = _div(w.float().abs().amax(), FP8_MAX).reshape(1)
    scale = _scale(scale, pow2)
    return QuantizedWeight(_to_fp8(w.float() / scale), scale)


def quantize_weights(fn: QuantFn, w: torch.Tensor, pow2: bool = False) -> list[QuantizedWeight]:
    """Quantize N linear weights of one shape stacked as [N, out, in] in a few kernels (MoE experts:
    thousands of small tensors per sync). Bit-identical with `quantize_weight` on each slice: every
    format's statistics stay within one slice (rows; the slice for per-tensor; 128x128 blocks,
    which never straddle two slices when out is a multiple of 128)."""
    if w.dim() != 3:
        raise ValueError(f"expected stacked linear weights [N, out, in], got shape {list(w.shape)}")
    n, out, inp = w.shape
    if fn.strategy is Strategy.tensor:
        scale = _scale(_div(w.float().abs().amax(dim=(1, 2)), FP8_MAX), pow2)  # [N]
        q = _to_fp8(w.float() / scale[:, None, None])
        return [QuantizedWeight(q[i], scale[i].reshape(1)) for i in range(n)]
    if fn.strategy is Strategy.block and out % FP8_BLOCK[0]:
        return [quantize_weight(fn, w[i], pow2) for i in range(n)]
    flat = quantize_weight(fn, w.reshape(n * out, inp), pow2)
    qs = flat.weight.view(n, out, inp)
    scales = flat.weight_scale.view(n, -1, flat.weight_scale.shape[-1])
    return [QuantizedWeight(qs[i], scales[i]) for i in range(n)]


def int8_scale(w: torch.Tensor) -> torch.Tensor:
    """Per-output-channel symmetric INT8 scale [out, 1] in the weight's dtype (compressed-tensors)."""
    absmax = w.float().abs().amax(dim=1, keepdim=True)
    scale = _div(absmax, INT8_HALF_RANGE).to(w.dtype)
    eps = torch.finfo(scale.dtype).eps
    return torch.where(scale == 0, torch.full_like(scale, eps), scale)


def quantize_int8_with_scale(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """INT8 round-to-nearest with a given scale; the quotient is computed in the scale's dtype.

    Also the step a calibrated profile uses (frozen GPTQ scales instead of absmax ones).
    """
    q = torch.round(w.to(scale.dtype) / scale)
    return torch.clamp(q, INT8_MIN, INT8_MAX).to(torch.int8)


def _int8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if w.is_cuda:  # the same math fused in one kernel (bit-identical; tests/test_kernels.py)
        from flashrl_tools.quant.kernels import int8_triton

        if int8_triton.available(w):
            return int8_triton.int8_channel(w)
    scale = int8_scale(w)
    return quantize_int8_with_scale(w, scale), scale


def _int4_group(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4 per group of 128 input columns, as compressed-tensors' W4A16 (scale = group absmax / 7.5 in
    the weight's dtype, zero scales -> eps, the quotient in that dtype, rounded, clamped to [-8, 7]): int8 codes."""
    _check_groups(tuple(w.shape))
    out, inp = w.shape
    groups = w.reshape(out, inp // INT4_GROUP, INT4_GROUP)
    scale = _div(groups.float().abs().amax(dim=2), INT4_HALF_RANGE).to(w.dtype)  # [out, in / 128]
    scale = torch.where(scale == 0, torch.full_like(scale, torch.finfo(scale.dtype).eps), scale)
    q = torch.round(groups.to(scale.dtype) / scale[:, :, None])
    return torch.clamp(q, INT4_MIN, INT4_MAX).to(torch.int8).reshape(out, inp), scale


def _check_groups(shape: tuple[int, ...]) -> None:
    if shape[-1] % INT4_GROUP:
        raise ValueError(f"4-bit weights need input columns in groups of {INT4_GROUP}, got {shape[-1]} columns")


def _fp8_block(w: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    out, inp = w.shape
    bo, bi = FP8_BLOCK
    po, pi = math.ceil(out / bo), math.ceil(inp / bi)
    padded = torch.zeros(po * bo, pi * bi, dtype=torch.float32, device=w.device)
    padded[:out, :inp] = w.float()
    blocks = padded.view(po, bo, pi, bi)
    scale = _scale(_div(blocks.abs().amax(dim=(1, 3)), FP8_MAX), pow2)  # [po, pi]
    q = _to_fp8(blocks / scale[:, None, :, None]).view(po * bo, pi * bi)[:out, :inp]
    return q.contiguous(), scale


def dequantize(fn: QuantFn, q: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The real-valued weight a quantized tensor stands for (what the engine computes with)."""
    w, s = q.weight.float(), q.weight_scale.float()
    if fn.strategy is Strategy.group:
        s = s.repeat_interleave(INT4_GROUP, 1)
    elif fn.strategy is Strategy.block:
        out, inp = w.shape
        bo, bi = FP8_BLOCK
        s = s.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]
    return (w * s).to(dtype)


def _div(x: torch.Tensor, constant: float) -> torch.Tensor:
    """x / constant, bit-identical on every device. CUDA divides by a Python (CPU) scalar as a
    multiplication by its reciprocal, the CPU divides: for 448 the two differ in the last bit of
    about half the FP8 scales (measured on an H100), so a trainer's GPU tensors re-quantized in a
    sync would not match a checkpoint quantized on the CPU. A divisor tensor on x's device is
    divided exactly on both."""
    return x / torch.tensor(constant, dtype=x.dtype, device=x.device)


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.full_like(scale, _FP8_ZERO_SCALE), scale)


def _scale(scale: torch.Tensor, pow2: bool) -> torch.Tensor:
    """An FP8 dequantization scale (fp32): nonzero, rounded up to a power of two if asked."""
    scale = _nonzero(scale)
    if not pow2:
        return scale
    up = torch.exp2(torch.ceil(torch.log2(scale)))
    return torch.where(up < scale, up * 2, up)  # log2 rounding just above a power of two


def _check_2d(shape: tuple[int, ...]) -> None:
    if len(shape) != 2:
        raise ValueError(f"expected a 2-D linear weight [out, in], got shape {list(shape)}")


# --- SmoothQuant-calibrated INT8 (re-quantizing updated weights with a profile) -------------
# llmcompressor's SmoothQuant multiplies the input columns of the balance layers by a factor m
# and divides the preceding layer (an RMSNorm's weight, or up_proj's rows for down_proj) by m.
# Each step runs in fp32 and is stored back in the weight dtype, so we round the same way.


def smooth_weight(w: torch.Tensor, col_mul: torch.Tensor | None = None,
                  row_div: torch.Tensor | None = None) -> torch.Tensor:
    """A linear weight as SmoothQuant leaves it: columns multiplied, then rows divided."""
    if col_mul is not None:
        w = (w.float() * col_mul.float()[None, :]).to(w.dtype)
    if row_div is not None:
        w = (w.float() / row_div.float()[:, None]).to(w.dtype)
    return w


def smooth_norm(w: torch.Tensor, divisor: torch.Tensor | None) -> torch.Tensor:
    """A norm weight divided by the smoothing factor of the layers it feeds."""
    return w if divisor is None else (w.float() / divisor.float()).to(w.dtype)


def requantize_int8(w: torch.Tensor, weight_scale: torch.Tensor, col_mul: torch.Tensor | None = None,
                    row_div: torch.Tensor | None = None) -> torch.Tensor:
    """INT8 weights for an updated BF16 weight with a profile's frozen scale and smoothing."""
    return quantize_int8_with_scale(smooth_weight(w, col_mul, row_div), weight_scale)


def int8_quotient(w: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """w / scale before rounding (in the scale's dtype, as quantize_int8_with_scale): for clip checks."""
    return w.to(weight_scale.dtype) / weight_scale


def fake_quant_activation(fn: QuantFn, x: torch.Tensor) -> torch.Tensor:
    """x quantized and dequantized as the engine's dynamic activation quantization does it before
    an 8-bit matmul: int8 per token (absmax / 127), fp8 per token (fp8_channel), per tensor
    (fp8_tensor) or per token and 128-column group (fp8_block). For sensitivity estimates
    (`flashrl tune`), computed in fp32."""
    xf = x.float()
    if fn.packed:  # BF16 activations
        return x
    if fn.is_int:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min(1e-12)
        return (torch.round(xf / scale).clamp(INT8_MIN, INT8_MAX) * scale).to(x.dtype)
    if fn.strategy is Strategy.block:
        cols = xf.shape[-1]
        group = FP8_BLOCK[1]
        pad = (-cols) % group
        g = torch.nn.functional.pad(xf, (0, pad)).unflatten(-1, (-1, group))
        scale = (g.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
        return (_to_fp8(g / scale).float() * scale).flatten(-2)[..., :cols].to(x.dtype)
    if fn.strategy is Strategy.tensor:
        scale = (xf.abs().amax() / FP8_MAX).clamp_min(1e-12)
    else:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    return (_to_fp8(xf / scale).float() * scale).to(x.dtype)
