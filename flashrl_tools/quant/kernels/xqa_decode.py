"""Decode attention over a paged FP8 (E4M3) KV cache through TensorRT-LLM's XQA Hopper kernel, as FlashInfer 0.6
ships it (issue 45; FLASHRL_DECODE_ATTN=xqa, runtime/core/decode_attn.py).

Why: on an H200 it reads the cache at 3.6-3.9 TB/s from 128 sequences up where flashrl's Triton kernel
(`fp8_decode_attn.py`) reads 2.8-2.9: 20-28 % less time from 32 sequences up, level at 16
(`benchmarks/decode_attn_xqa.py`, RESULTS "XQA's Hopper FP8 decode"). The price is precision: its products are
FP8 (the query and the probabilities rounded to FP8, as FA3's FP8 attention does), ~3 % of the output's scale
against float32 attention where flashrl's kernel stays at ~0.25 %. So it is an opt-in mode, not the default.

The math: `o = sum_j softmax_j(s) * v_scale * V_j`, `s_j = sm_scale * q_scale * k_scale * (q . K_j)`. XQA takes a
BF16 query, one scale for K and V and the softmax scale 1/sqrt(D), so the rest rides on the query's scale: XQA's
`q_scale = q_scale * k_scale / v_scale * sm_scale * sqrt(D)` and `kv_scale = v_scale`, both read on the device (a
recalibration needs no CUDA graph capture). An FP8 query is widened to BF16 (exact; XQA rounds it to FP8 again with
its own scale). One query token per sequence (a decode batch: query i belongs to sequence i).

The module is JIT-compiled CUDA (FlashInfer's `get_xqa_module`: nvcc at the first call, or a prebuilt module in
its AOT directory; `scripts/build_xqa.sh` builds them where nvcc is). Pages of 16, 32, 64 or 128 tokens, head dim
a multiple of 16 up to 256.
"""

from __future__ import annotations

import functools

import torch

MIN_SEQS = 32  # below it flashrl's kernel is as fast or faster (the 16-sequence rows)
PAGES = (16, 32, 64, 128)
SEMAPHORE_BYTES = 8 << 20  # FlashInfer's own split of the workspace: semaphores, then scratch
SCRATCH_BYTES = 128 << 20


def supported(num_seqs: int, page: int, q_heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether a decode batch of this shape goes through XQA (a function of the shape only: a captured CUDA graph
    holds one kernel, and a synced engine and a fresh one choose alike)."""
    return (num_seqs >= MIN_SEQS and page in PAGES and kv_heads > 0 and q_heads % kv_heads == 0
            and head_dim % 16 == 0 and 16 <= head_dim <= 256)


@functools.lru_cache(maxsize=16)
def _module(group: int, page: int, head_dim: int):
    """FlashInfer's XQA module for a BF16 query over an FP8 E4M3 cache, BF16 output, no sliding window."""
    try:
        import flashinfer
        from flashinfer.xqa import get_xqa_module
    except ImportError as e:
        raise RuntimeError("FLASHRL_DECODE_ATTN=xqa needs FlashInfer 0.6 (flashinfer-python, installed with vLLM and "
                           f"SGLang): {e}") from e
    if not str(getattr(flashinfer, "__version__", "")).startswith("0.6."):
        raise RuntimeError(f"FLASHRL_DECODE_ATTN=xqa is written against FlashInfer 0.6's XQA module; found "
                           f"{getattr(flashinfer, '__version__', '?')}: unset FLASHRL_DECODE_ATTN or install 0.6.x")
    try:  # a prebuilt module from FlashInfer's AOT directory, else its JIT build (nvcc)
        return get_xqa_module(torch.bfloat16, torch.float8_e4m3fn, page, head_dim, group, False, torch.bfloat16, 1)
    except Exception as e:  # noqa: BLE001 -- FlashInfer's build / load errors have no common type
        raise RuntimeError(f"FLASHRL_DECODE_ATTN=xqa: XQA's module for {group} query heads per KV head, {page}-token "
                           f"pages, head dim {head_dim} could neither be loaded nor built ({type(e).__name__}: "
                           f"{str(e)[:200]}): build it where nvcc is (scripts/build_xqa.sh DEST {group}:{head_dim}, then "
                           "scripts/gpu_install_xqa.sh DEST on this host), or unset FLASHRL_DECODE_ATTN") from e


@functools.lru_cache(maxsize=8)
def _workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Semaphores (zeroed once: XQA leaves them zero) and scratch for the split sequences' partials, per device."""
    ws = torch.zeros(SEMAPHORE_BYTES + SCRATCH_BYTES, dtype=torch.uint8, device=device)
    return ws[:SEMAPHORE_BYTES], ws[SEMAPHORE_BYTES:]


def xqa_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                         block_table: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float, k_scale: torch.Tensor,
                         v_scale: torch.Tensor, q_scale: torch.Tensor | float | None = None,
                         sm_count: int | None = None) -> torch.Tensor:
    """Write each sequence's attention into `out` [>= seqs, q_heads, D] BF16 (module docstring). `q` [>= seqs,
    q_heads, D] BF16, or FP8 with `q_scale` (a one-element float32 tensor or a number); `k_cache` / `v_cache`
    [pages, page, kv_heads, D] FP8 E4M3 views (any page / token / head strides, the last dim contiguous);
    `block_table` [seqs, max_pages] int32; `seq_lens` [seqs] int32; scales one-element float32 tensors."""
    num_seqs, q_heads, head_dim = seq_lens.shape[0], q.shape[1], q.shape[2]
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if (k_cache.dtype != torch.float8_e4m3fn or v_cache.dtype != torch.float8_e4m3fn or out.dtype != torch.bfloat16
            or q_heads % kv_heads or page not in PAGES or k_cache.stride(3) != 1 or v_cache.stride(3) != 1
            or seq_lens.dtype != torch.int32 or block_table.dtype != torch.int32):
        raise ValueError(f"xqa_decode_attention: unsupported operands q {tuple(q.shape)} {q.dtype}, cache "
                         f"{tuple(k_cache.shape)} {k_cache.dtype}, out {out.dtype}")
    q_fp8 = q.dtype == torch.float8_e4m3fn
    if q_fp8 == (q_scale is None) or not q_fp8 and q.dtype != torch.bfloat16:
        raise ValueError("xqa_decode_attention: a BF16 query without q_scale, or an FP8 E4M3 one with it")
    q16 = q[:num_seqs].to(torch.bfloat16) if q_fp8 else q[:num_seqs]
    factor = sm_scale * head_dim ** 0.5  # XQA divides by sqrt(D) itself
    scale = (k_scale * (factor if q_scale is None else q_scale * factor)) / v_scale  # on the device
    sem, scratch = _workspace(q.device)
    if sm_count is None:
        sm_count = torch.cuda.get_device_properties(q.device).multi_processor_count
    _module(q_heads // kv_heads, page, head_dim).xqa(
        True, sm_count, kv_heads, 0, scale, out[:num_seqs].unsqueeze(1), 1.0, q16.contiguous().unsqueeze(1), None,
        k_cache, v_cache, None, None, block_table, block_table.shape[1] * page, seq_lens.unsqueeze(1), num_seqs,
        v_scale, sem, scratch, False, 1, None)
    return out
