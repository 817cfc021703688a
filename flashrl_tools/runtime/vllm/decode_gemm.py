"""vLLM's INT8 W8A8 linears at decode shapes through flashrl's few-rows Triton GEMM (issue 45; FLASHRL_DECODE_GEMM=N:
at most N rows, 1..64; unset or `auto`: 16 rows on Hopper (sm_90), where its tiles were sized and measured -- 7 % off
each decode step with <= 16 sequences at 7B, RESULTS "A step's time by running requests" --, off elsewhere; 0: off).

AROUND `CutlassInt8ScaledMMLinearKernel.apply_weights`: a layer with dynamic per-token symmetric activations
(compressed-tensors W8A8, what `FLASHRL_CONFIG=int8` serves) runs one custom op, `flashrl::int8_linear`:
vLLM's own `scaled_int8_quant`, then `quant.kernels.w8a8_gemm` for at most N rows and vLLM's CUTLASS
kernel above. The op is opaque to torch.compile (its fake returns the output's shape), so each captured CUDA
graph takes the branch of its batch size. The Triton kernel's output equals CUTLASS's bit for bit (int32
accumulation, CUTLASS's epilogue order: tests/test_kernels.py, benchmarks/small_m_gemm.py), so a sequence's
tokens and logprobs do not depend on the switch or on the batch it decodes in. Static or asymmetric activation
scales keep vLLM's path. Under `auto` a kernel that fails to compile (another Triton, another chip) logs one warning
and leaves CUTLASS for every batch; an explicit N raises. Under `auto` every CUDA INT8 linear of this kind is the op
and the op resolves `auto` when it first runs: a graph loaded from vLLM's compile cache (its AOT cache skips
tracing, so `apply_weights` never runs) still takes the Triton path, and it does not depend on the chip that
traced it. The switch is part of vLLM's compile-cache key (engine_args.compiled_switches).
"""

from __future__ import annotations

import logging

import torch

from flashrl_tools.config.settings import settings
from flashrl_tools.quant.kernels import w8a8_gemm

log = logging.getLogger("flashrl_tools.runtime")
AUTO_ROWS, AUTO_CAPABILITY = 16, (9, 0)  # `auto`: Hopper, at most 16 rows (RESULTS: Triton wins to 16 rows on an H200)
max_rows = 0  # FLASHRL_DECODE_GEMM, set by `configure` (0: off; read while torch.compile traces)
_auto = False  # `auto` not yet resolved: resolved on the first CUDA call, by that device
_used: set[int] = set()  # non-empty once the Triton path ran (logged once)
_warmed: set[tuple] = set()  # the operand kinds and layer shapes whose tile variants are compiled


def configure(value: str) -> None:
    """FLASHRL_DECODE_GEMM as validated by the plan: "auto" or a row count (0: off)."""
    global max_rows, _auto
    _auto, max_rows = value == "auto", 0 if value == "auto" else int(value)


def _resolve(device: torch.device) -> None:
    """`auto` -> AUTO_ROWS on a Hopper device, else off; once per process, on its first CUDA activations (the
    adapter installs before the worker has a device, and the front-end process must not initialize CUDA)."""
    global max_rows, _auto
    if _auto:
        _auto = False
        max_rows = AUTO_ROWS if torch.cuda.get_device_capability(device) == AUTO_CAPABILITY else 0


@torch.library.custom_op("flashrl::int8_linear", mutates_args=())
def int8_linear(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from vllm import _custom_ops as ops

    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    x_q, x_s, _ = ops.scaled_int8_quant(x2, None, None, symmetric=True)
    if _auto and x_q.is_cuda:  # at run time: a graph from vLLM's compile cache never traced apply_weights
        _resolve(x_q.device)
    kind = (bias is None, w_s.numel() > 1, x.dtype, tuple(w_q.shape))  # the tiles depend on the layer's shape
    if max_rows and kind not in _warmed and x_q.is_cuda and not torch.cuda.is_current_stream_capturing():
        _warm(x_q, w_q, x_s, w_s, x.dtype, bias)  # before a graph captures it (vLLM's profile run)
        _warmed.add(kind)
    if w8a8_gemm.served(x_q, w_q, x.dtype, max_rows):
        out = w8a8_gemm.w8a8_mm(x_q, w_q, x_s, w_s, x.dtype, bias)
        if not _used:
            log.info("INT8 linears at <= %d rows through flashrl's Triton GEMM (FLASHRL_DECODE_GEMM)", max_rows)
            _used.add(1)
    else:
        out = ops.cutlass_scaled_mm(x_q, w_q, scale_a=x_s, scale_b=w_s, out_dtype=x.dtype, bias=bias)
    return out.reshape(*x.shape[:-1], w_q.shape[1])


def _warm(x_q, w_q, x_s, w_s, dtype, bias) -> None:
    """Compile the tile variants for this layer kind; under `auto` a failure turns the Triton path off (logged)."""
    global max_rows
    try:
        w8a8_gemm.warm(x_q, w_q, x_s, w_s, dtype, bias, max_rows)
    except Exception as e:
        if settings().decode_gemm != "auto":
            raise
        log.warning("flashrl's Triton INT8 GEMM did not compile here (%s: %s): CUTLASS for every batch "
                    "(FLASHRL_DECODE_GEMM=0 silences this)", type(e).__name__, e)
        max_rows = 0


@int8_linear.register_fake
def _(x, w_q, w_s, bias):
    return x.new_empty((*x.shape[:-1], w_q.shape[1]))


def apply_weights(original, kernel, layer, x, bias=None, *args, **kwargs):
    """AROUND vLLM's CUTLASS INT8 kernel's `apply_weights`: dynamic symmetric per-token activations go through
    `flashrl::int8_linear` on CUDA when FLASHRL_DECODE_GEMM is on or `auto`; everything else is vLLM's own path."""
    w_q, w_s, i_s, _i_zp, azp_adj = kernel._get_layer_params(layer)
    if not (max_rows or _auto) or args or kwargs or i_s is not None or azp_adj is not None or not x.is_cuda:
        return original(kernel, layer, x, bias, *args, **kwargs)
    return torch.ops.flashrl.int8_linear(x, w_q, w_s, bias)
