"""FLASHRL_DECODE_ATTN, the engine-neutral half (issue 45): whether this process's FP8 KV decode batches take
flashrl's kernel (`quant/kernels/fp8_decode_attn.py`), its launch, and the once-per-process log line the GPU
tests read. Each adapter decides which of its engine's attention calls are decode batches the kernel computes
exactly: `runtime/vllm/decode_attn.py` (FA3's `FlashAttentionImpl.forward`), `runtime/sglang/decode_attn.py`
(fa3's `flash_attn_with_kvcache` in its decode step).

`xqa` (opt-in, Hopper): the same batches from `xqa_decode.MIN_SEQS` sequences up through TensorRT-LLM's XQA
kernel (`quant/kernels/xqa_decode.py`: 20-28 % faster there, FP8 products: ~12x flashrl's error), smaller ones and
pages XQA lacks through flashrl's kernel; the choice depends only on the batch's shape. `fp8qk` (opt-in, Hopper; within 2 %
of the default's time on an H200): flashrl's kernel with the scores transposed, an FP8 query's products with the FP8
keys formed by Hopper's FP8 warpgroup MMA (`fp8_decode_attn_qk.py`: no conversion of K). `lpt` (opt-in; 3-12 % faster
at 128-256 sequences of 4-8k tokens, slower at 64 and in the RL step, RESULTS): flashrl's kernel taking a batch's
sequences longest first (`longest_first`: the same bits). `balanced` (opt-in until measured): up to 32 sequences
(the tail) flashrl's kernel with equal runs of the batch's key tiles over a fixed grid (`fp8_decode_attn_bal.py`);
not for a split count the engine fixed (SGLang's deterministic `num_splits=1`)."""

from __future__ import annotations

import functools
import logging

import torch

from flashrl_tools.config.settings import settings
from flashrl_tools.quant.kernels import fp8_decode_attn, fp8_decode_attn_bal, xqa_decode

log = logging.getLogger("flashrl_tools.runtime")
LOG_LINE = "FP8 KV decode attention through flashrl's Triton kernel"  # logged once per process (the GPU tests read it)
XQA_LINE = "FP8 KV decode attention through XQA's Hopper kernel"  # the same, for a batch XQA computed
QK_LINE = f"{LOG_LINE}, FP8 keys in the score MMA"  # the same, for fp8qk (its batches count as flashrl's too)
LPT_LINE = f"{LOG_LINE}, sequences longest first"  # the same, for lpt
BAL_LINE = f"{LOG_LINE}, key tiles balanced over a fixed grid"  # the same, for balanced
# "mode": the switch, resolved once per process; "logged" / "xqa_logged" / "qk_logged": a batch went through; "refused": why the
# model's shape is not the kernels' (`choose`)
_state: dict = {}


def resolve(value: str, capability: tuple[int, int]) -> str:
    """FLASHRL_DECODE_ATTN on a device of this capability -> "flashrl", "xqa", "fp8qk", "lpt", "balanced" or "" (the engine's
    own attention): 1 flashrl's kernel, 0 off, `auto` (unset) flashrl's kernel on Hopper (sm_90), where its tiles were
    swept and both adapters passed their GPU tests; `xqa` XQA on Hopper (its FP8 kernel is sm_90's), `fp8qk` the FP8
    score MMA on Hopper (Hopper's warpgroup MMA); elsewhere both are flashrl's kernel; `lpt` flashrl's kernel taking
    the sequences longest first, `balanced` its balanced grid, on any device (as 1)."""
    hopper = tuple(capability) == (9, 0)
    if value in ("lpt", "balanced"):
        return value
    if value in ("xqa", "fp8qk"):
        return value if hopper else "flashrl"
    return "flashrl" if value == "1" or value == "auto" and hopper else ""


@functools.lru_cache(maxsize=64)
def supports(head_dim: int, q_heads: int, kv_heads: int) -> str:
    """Why flashrl's FP8 decode kernels (and with them `xqa`, whose small batches take flashrl's) cannot compute
    attention of this shape; "" where they can. The one shape check, used by both adapters: at start from the
    model's shape (`choose`) and on every call (a model whose layers differ)."""
    if kv_heads < 1 or q_heads % kv_heads:
        return f"{q_heads} query heads do not group over {kv_heads} KV heads"
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        return f"head size {head_dim} (flashrl's FP8 decode kernel computes power-of-2 head sizes 16-256)"
    return ""


def choose(head_dim: int, q_heads: int, kv_heads: int, engine: str) -> bool:
    """At model load with an FP8 KV cache, once per process: whether this model's decode batches may take
    flashrl's kernels (`supports`). A shape they cannot compute is never given to them: the engine's own attention
    serves every batch, and the choice is logged (one line)."""
    why = supports(head_dim, q_heads, kv_heads)
    _state["refused"] = why
    if why and settings().decode_attn != "0":
        log.info("flashrl: FP8 KV decode attention: %s's own attention serves this model (%s; FLASHRL_DECODE_ATTN "
                 "has no effect)", engine, why)
    return not why


def enabled(device: torch.device) -> bool:
    """FLASHRL_DECODE_ATTN, resolved once per process on its first CUDA batch (`resolve`); off for a model whose
    shape the kernels cannot compute (`choose`)."""
    if _state.get("refused"):
        return False
    if "mode" not in _state:
        _state["mode"] = resolve(settings().decode_attn, torch.cuda.get_device_capability(device))
    return bool(_state["mode"])


def ran() -> bool:
    """Whether a decode batch of this process went through flashrl's kernel (the benchmarks record it per row)."""
    return bool(_state.get("logged") or _state.get("qk_logged") or _state.get("bal_logged"))


def kernels_in(output: str) -> list[str]:
    """The kernels an engine's output says its FP8 KV decode batches went through: "flashrl", "xqa", "fp8qk" / "lpt" /
    "balanced" (with "flashrl": one kernel family; each logs its line once per process); [] for the engine's own."""
    return [name for name, line in (("flashrl", LOG_LINE), ("xqa", XQA_LINE), ("fp8qk", QK_LINE), ("lpt", LPT_LINE),
                                    ("balanced", BAL_LINE)) if line in output]


def ran_xqa() -> bool:
    """Whether one went through XQA's (FLASHRL_DECODE_ATTN=xqa)."""
    return bool(_state.get("xqa_logged"))


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def mode() -> str:
    """The resolved switch ("flashrl", "xqa", "fp8qk", "lpt", "balanced" or ""; "" before the first CUDA batch)."""
    return _state.get("mode", "")


def takes_xqa(q, k_cache, out, seq_lens, splits=None) -> bool:
    """Whether `attend` gives this decode batch to XQA: the `xqa` mode, a shape XQA takes (`xqa_decode.supported`),
    a BF16 or FP8 E4M3 query and a BF16 output it can write whole (its module is BF16's: an FP16 model keeps
    flashrl's kernel), a query and an output row per sequence, no split count fixed by the engine."""
    return (mode() == "xqa" and splits is None and out is not None and out.is_contiguous()
            and q.shape[0] >= seq_lens.shape[0] <= out.shape[0] and out.dtype == torch.bfloat16
            and q.dtype in (torch.bfloat16, torch.float8_e4m3fn)
            and xqa_decode.supported(seq_lens.shape[0], k_cache.shape[1], q.shape[1], k_cache.shape[2], q.shape[2]))


def attend(q, k_cache, v_cache, out, block_table, seq_lens, query_start_loc, scale, k_scale, v_scale,
           q_scale=None, splits=None, via: str = "") -> torch.Tensor:
    """The kernel on one decode batch (its operands: `fp8_decode_attn.fp8_decode_attention`), at the measured
    defaults for this device; the first batch of the process is logged. Under `xqa` a batch XQA takes (its shape:
    `xqa_decode.supported`, an output it can write whole, no fixed split count) goes there instead."""
    sms = _sm_count(q.device.index or 0)
    if takes_xqa(q, k_cache, out, seq_lens, splits):
        xqa_decode.xqa_decode_attention(q, k_cache, v_cache, out, block_table, seq_lens, scale, k_scale, v_scale,
                                        q_scale=q_scale, sm_count=sms)
        key, line = "xqa_logged", XQA_LINE
    else:
        qk = mode() == "fp8qk" and q.dtype == torch.float8_e4m3fn and k_cache.dtype == torch.float8_e4m3fn
        lpt = mode() == "lpt"
        bal = mode() == "balanced" and splits is None and seq_lens.shape[0] <= fp8_decode_attn_bal.MAX_SEQS
        fp8_decode_attn.fp8_decode_attention(q, k_cache, v_cache, out, block_table, seq_lens, query_start_loc, scale,
                                             k_scale, v_scale, q_scale=q_scale, splits=splits, sm_count=sms, qk_fp8=qk,
                                             longest_first=lpt, balanced=bal)
        key, line = (("qk_logged", QK_LINE) if qk else ("bal_logged", BAL_LINE) if bal
                     else ("logged", LPT_LINE if lpt else LOG_LINE))
    if key not in _state:
        _state[key] = True
        log.info("%s (FLASHRL_DECODE_ATTN; %s)", line, via)
    return out
