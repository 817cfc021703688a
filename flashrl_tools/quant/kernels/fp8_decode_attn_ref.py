"""The float32 reference of `fp8_decode_attn`'s decode attention over a paged FP8 cache: the same math in torch,
one sequence at a time (its tests and the decode-attention benchmarks check each kernel against it)."""

from __future__ import annotations

import torch


def reference(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, sm_scale, k_scale, v_scale,
              q_scale=None) -> torch.Tensor:
    """The same attention in float32 torch, one sequence at a time (tests and benchmarks/decode_attention.py)."""
    q_heads = q.shape[1]
    kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    qf = q.float() * (torch.as_tensor(q_scale).float() if q_scale is not None else 1.0)
    for i in range(seq_lens.shape[0]):
        n, tok = int(seq_lens[i]), int(query_start_loc[i])
        if n == 0 or int(query_start_loc[i + 1]) == tok:
            continue
        t = torch.arange(n, device=q.device)
        blk = block_table[i, t // page].long()
        k = _gather(k_cache, blk, t % page) * k_scale.float()  # [n, kv_heads, D]
        v = _gather(v_cache, blk, t % page) * v_scale.float()
        k = k.repeat_interleave(q_heads // kv_heads, dim=1)
        v = v.repeat_interleave(q_heads // kv_heads, dim=1)
        s = torch.einsum("hd,nhd->hn", qf[tok], k) * sm_scale
        out[tok] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v)
    return out


def _gather(cache: torch.Tensor, blk: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """cache[blk, slot] in float32 (indexing runs on the bytes: not every device indexes FP8 tensors)."""
    return cache.view(torch.uint8)[blk, slot].view(cache.dtype).float()
