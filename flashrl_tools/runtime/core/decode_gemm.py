"""FLASHRL_DECODE_GEMM, the engine-neutral half (issue 45): whether this process's INT8 W8A8 linears at decode
shapes (at most N rows) run flashrl's few-rows Triton GEMM (`quant/kernels/w8a8_gemm.py`) instead of the engine's
CUTLASS kernel, `auto`'s resolution, the tile variants' warm-up and the once-per-process log line. N: 1..64; unset
or `auto`: 16 rows on Hopper (sm_90), where the tiles were sized and measured (RESULTS "A decode-shaped INT8
GEMM", "A step's time by running requests"), off elsewhere; 0: off.

The Triton kernel's output equals the engines' CUTLASS kernels bit for bit (int32 accumulation, their epilogue's
order -- `a_scale * (b_scale * float(acc))`, an FMA with the bias --: vLLM's `cutlass_scaled_mm` and sgl-kernel's
sm90 `int8_scaled_mm`, tests/test_kernels.py on a GPU), so a sequence's tokens and logprobs do not depend on the
switch or on the batch it decodes in. Each adapter routes its engine's dynamic per-token symmetric INT8 linears
here with its own activation quantization and kernel: `runtime/vllm/decode_gemm.py` (a custom op, opaque to
torch.compile), `runtime/sglang/decode_gemm.py` (compressed-tensors W8A8 `apply_weights`)."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from flashrl_tools.config.settings import settings
from flashrl_tools.quant.kernels import w8a8_gemm

log = logging.getLogger("flashrl_tools.runtime")
LOG_LINE = "INT8 linears at few rows through flashrl's Triton GEMM"  # logged once per process
AUTO_ROWS, AUTO_CAPABILITY = 16, (9, 0)  # `auto`: Hopper, at most 16 rows (RESULTS: Triton wins to 16 rows on an H200)
max_rows = 0  # the rows served, set by `configure` (0: off; vLLM reads it while torch.compile traces)
_auto = False  # `auto` not yet resolved: resolved on the first CUDA call, by that device
_used: set[int] = set()  # non-empty once the Triton path ran (logged once)
_warmed: set[tuple] = set()  # the operand kinds and layer shapes whose tile variants are compiled


def configure(value: str) -> None:
    """FLASHRL_DECODE_GEMM: "auto" or a row count (0: off). Anything else leaves it off: the plan refuses it at
    start with one line (core/adapter.check_settings)."""
    global max_rows, _auto
    _auto, max_rows = value == "auto", int(value) if value.isdigit() else 0


def active() -> bool:
    """Whether the adapters route INT8 linears here (on, or `auto` not yet resolved)."""
    return bool(max_rows or _auto)


def ran() -> bool:
    """Whether a linear of this process went through the Triton GEMM (the benchmarks record it per row)."""
    return bool(_used)


def _resolve(device: torch.device) -> None:
    """`auto` -> AUTO_ROWS on a Hopper device, else off; once per process, on its first CUDA activations (the
    adapters install before the worker has a device, and a front-end process must not initialize CUDA)."""
    global max_rows, _auto
    if _auto:
        _auto = False
        max_rows = AUTO_ROWS if torch.cuda.get_device_capability(device) == AUTO_CAPABILITY else 0


def linear(x_q: torch.Tensor, w_q: torch.Tensor, x_s: torch.Tensor, w_s: torch.Tensor, dtype: torch.dtype,
           bias: torch.Tensor | None, engine_mm: Callable[[], torch.Tensor]) -> torch.Tensor:
    """One INT8 linear on quantized activations `x_q` [M, K] (per-token scales `x_s`) and the engine's [K, N]
    weight view `w_q` (per-channel or per-tensor `w_s`): the Triton GEMM for at most `max_rows` rows, else
    `engine_mm()`, the engine's own kernel on the same operands."""
    if _auto and x_q.is_cuda:  # at run time: vLLM's compile cache may load a graph that never traced the adapter
        _resolve(x_q.device)
    kind = (bias is None, w_s.numel() > 1, dtype, tuple(w_q.shape))  # the tiles depend on the layer's shape
    if max_rows and kind not in _warmed and x_q.is_cuda and not torch.cuda.is_current_stream_capturing():
        _warm(x_q, w_q, x_s, w_s, dtype, bias)  # before a graph captures it (the engines' warm-up runs)
        _warmed.add(kind)
    if not w8a8_gemm.served(x_q, w_q, dtype, max_rows):
        return engine_mm()
    out = w8a8_gemm.w8a8_mm(x_q, w_q, x_s, w_s, dtype, bias)
    if not _used:
        log.info("%s (<= %d rows; FLASHRL_DECODE_GEMM)", LOG_LINE, max_rows)
        _used.add(1)
    return out


def _warm(x_q, w_q, x_s, w_s, dtype, bias) -> None:
    """Compile the tile variants for this layer kind; under `auto` a failure turns the Triton path off (logged)."""
    global max_rows
    try:
        w8a8_gemm.warm(x_q, w_q, x_s, w_s, dtype, bias, max_rows)
    except Exception as e:
        if settings().decode_gemm != "auto":
            raise
        log.warning("flashrl's Triton INT8 GEMM did not compile here (%s: %s): the engine's kernel for every batch "
                    "(FLASHRL_DECODE_GEMM=0 silences this)", type(e).__name__, e)
        max_rows = 0
