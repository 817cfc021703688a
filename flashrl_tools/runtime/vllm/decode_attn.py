"""vLLM's FlashAttention backend over an FP8 KV cache: decode batches through flashrl's FP8 decode kernel
(issue 45; FLASHRL_DECODE_ATTN: unset / `auto` on Hopper, 1 on, 0 off).

AROUND `FlashAttentionImpl.forward`: a batch where every request has one query token (`max_query_len == 1`: what
vLLM's decode CUDA graphs capture) over an FP8 E4M3 cache with per-tensor scales runs
`quant.kernels.fp8_decode_attn` on the same cache, query (FP8 as the layer quantized it, with `_q_scale`) and
scales; anything else -- a head size or grouping the kernels do not compute (`core.supports`, chosen at start from
the model's shape and logged: `choose_for_vllm`), prefills, mixed batches, cascade, sliding windows, ALiBi, soft-capping,
sinks, context parallelism, a BF16 cache -- keeps FA3. The kernel reads the scale tensors on the device, so a
recalibration needs no graph capture. The cache write stays vLLM's (`do_kv_cache_update`). The choice depends only
on the batch's shape, so a synced engine and a fresh one started with the same settings run the same kernels on the
same batches (tests/gpu/test_vllm_runtime.py's `+kv` cases pass with it). Measured on an H200 (RESULTS "Two KV
heads a program"): two KV heads a program 10-19 % faster at 128-256 sequences than one (which matched FA3's FP8
decode from 64 sequences up), and a Qwen3-8B step at TRL's 0.3 share 0.585-0.591x BF16's (0.650x with one head a
program); the attention's error against float32 ~13x smaller than FA3's (the probabilities stay FP16 where FA3
rounds them to FP8).
"""

from __future__ import annotations

import torch

from flashrl_tools.runtime.core import decode_attn as core


def choose_for_vllm(vllm_config) -> None:
    """At model load with an FP8 KV cache: flashrl's kernels for this model's shape, or FA3 for every batch (logged
    once: `core.choose`)."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    core.choose(model.get_head_size(), model.get_num_attention_heads(parallel), model.get_num_kv_heads(parallel),
                "vLLM")


def served(impl, layer, query, attn_metadata, args, kwargs) -> bool:
    """Whether this call is a decode batch the kernel computes exactly as specified (module docstring)."""
    if args or kwargs.get("output_scale") is not None or kwargs.get("output_block_scale") is not None:
        return False
    if attn_metadata is None or not query.is_cuda or attn_metadata.max_query_len != 1:
        return False
    if getattr(attn_metadata, "use_cascade", False) or getattr(impl, "dcp_world_size", 1) > 1:
        return False
    window = getattr(impl, "sliding_window", None)
    if window not in (None, (-1, -1), [-1, -1]) or getattr(impl, "alibi_slopes", None) is not None:
        return False
    if getattr(impl, "logits_soft_cap", 0) or getattr(impl, "sinks", None) is not None:
        return False
    if str(getattr(impl, "attn_type", "decoder")).lower().rsplit(".", 1)[-1] != "decoder":
        return False
    if core.supports(impl.head_size, impl.num_heads, impl.num_kv_heads):  # a shape the kernels do not compute
        return False
    return str(impl.kv_cache_dtype) in ("fp8", "fp8_e4m3") and query.dtype in (torch.float8_e4m3fn, torch.bfloat16,
                                                                                torch.float16)


def forward(original, impl, layer, query, key, value, kv_cache, attn_metadata, output=None, *args, **kwargs):
    """AROUND FlashAttentionImpl.forward: decode batches over an FP8 cache through flashrl's kernel."""
    if output is None or not served(impl, layer, query, attn_metadata, args, kwargs) or not core.enabled(query.device):
        return original(impl, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
    fp8 = torch.float8_e4m3fn
    key_cache, value_cache = kv_cache.transpose(1, 2).split(impl.head_size, dim=-1)  # vLLM's (B, H, N, 2D) view
    n = attn_metadata.num_actual_tokens
    q = query[:n].view(n, impl.num_heads, impl.head_size)
    out = output[:n].view(n, impl.num_heads, impl.head_size)
    core.attend(q, key_cache.view(fp8), value_cache.view(fp8), out, attn_metadata.block_table, attn_metadata.seq_lens,
                attn_metadata.query_start_loc, impl.scale, layer._k_scale, layer._v_scale,
                q_scale=layer._q_scale if query.dtype == fp8 else None, via="vLLM's FlashAttention backend")
    return output
