"""SGLang's fa3 backend over an FP8 KV cache: decode steps through flashrl's FP8 decode kernel (issue 45;
FLASHRL_DECODE_ATTN: unset / `auto` on Hopper, 1 on, 0 off; runtime/core/decode_attn.py).

AROUND the `flash_attn_with_kvcache` that fa3's backend module calls: while fa3's `forward_decode` runs (marked by
kv_store.in_decode), a call that is one query token per sequence over the paged FP8 E4M3 pool -- causal, no
window, soft-cap, sinks, score_mod, appended K / V, cascade LSE, with per-tensor K / V descales -- runs
`quant.kernels.fp8_decode_attn` on the same operands FA3 would get: the query as fa3 cast it to FP8 (unscaled:
q_scale 1), the pool viewed [pages, page_size, kv_heads, D], SGLang's page table, cache lengths and query starts,
the layer's scale tensors (read on the device: a recalibration needs no graph capture). SGLang's store, its
metadata, its page-table choice (SWA, local attention) stay SGLang's; prefill (forward_extend) keeps FA3; SGLang's
`num_splits=1` (deterministic inference) is kept. The choice depends only on the call's shape, so a synced engine
and a fresh one started with the same settings take the same kernels.

Under FLASHRL_DECODE_ATTN=xqa (XQA takes a BF16 query), `forward_decode` keeps fa3's query BF16 (its cast to FP8
becomes a no-op while the step runs); a batch XQA takes gets it as it is, any other call the FP8 cast fa3 would have
made (flashrl's kernel, or FA3 itself)."""

from __future__ import annotations

import torch

from flashrl_tools.runtime.core import decode_attn as core
from flashrl_tools.runtime.sglang import kv_store
from flashrl_tools.runtime.sglang.capabilities import tp_size

_OFF = ("k", "v", "qv", "rotary_cos", "rotary_sin", "cache_batch_idx", "cache_leftpad", "cu_seqlens_k_new",
        "rotary_seqlens", "q_descale", "sinks", "score_mod", "aux_tensors")  # what the kernel does not compute


_kept = False  # True while a forward_decode runs with its query kept BF16 (xqa mode)


def _keeps_bf16_query(backend, q) -> bool:
    """Under the `xqa` mode, a fa3 backend over an FP8 E4M3 pool (no MLA, no MXFP8) and a BF16 CUDA query (XQA's
    module is built for BF16: an FP16 model keeps fa3's cast)."""
    if not isinstance(q, torch.Tensor) or q.dtype != torch.bfloat16 or not kv_store.on_device(q):
        return False
    if getattr(backend, "kv_cache_dtype", None) != torch.float8_e4m3fn or getattr(backend, "use_mla", True):
        return False
    return not getattr(backend, "kv_cache_is_mxfp8", False) and core.enabled(q.device) and core.mode() == "xqa"


def forward_decode(original, backend, *args, **kwargs):
    """AROUND fa3's `forward_decode`: marks the decode step (`kv_store.in_decode`); under `xqa` its query stays BF16
    (fa3's `q.to(self.kv_cache_dtype)` is the cast it skips: the backend's dtype is the query's meanwhile)."""
    global _kept
    if not _keeps_bf16_query(backend, args[0] if args else kwargs.get("q")):
        return kv_store.in_decode(original, backend, *args, **kwargs)
    dtype, backend.kv_cache_dtype = backend.kv_cache_dtype, (args[0] if args else kwargs["q"]).dtype
    _kept = True
    try:
        return kv_store.in_decode(original, backend, *args, **kwargs)
    finally:
        backend.kv_cache_dtype, _kept = dtype, False


def choose_for_sglang(runner) -> None:
    """At model load with an FP8 KV cache: flashrl's kernels for this model's shape, or fa3 for every batch (logged
    once: `core.choose`)."""
    cfg, tp = runner.model_config, tp_size(runner)
    try:
        shape = cfg.head_dim, cfg.num_attention_heads // tp, cfg.get_num_kv_heads(tp)
    except (AttributeError, TypeError):  # another SGLang's config: the per-call check (`takes`) still decides
        return
    core.choose(*shape, "SGLang")


def _scalar(descale):
    """The 1-element scale tensor behind fa3's `layer.k_scale.expand(batch, kv_heads)` (a view of its storage,
    so a captured graph reads recalibrated values), or None for per-head descales."""
    if not isinstance(descale, torch.Tensor) or descale.dtype != torch.float32:
        return None
    if any(stride for stride, n in zip(descale.stride(), descale.shape) if n > 1):  # one value broadcast
        return None
    return descale.as_strided((1,), (1,))


def takes(args, kw) -> bool:
    """Whether this fa3 call is a decode batch the kernel computes exactly (module docstring); its query FP8 as fa3
    cast it, or BF16 where `forward_decode` kept it so."""
    if args or not kv_store._decoding:
        return False
    q, k_cache, v_cache = kw.get("q"), kw.get("k_cache"), kw.get("v_cache")
    fp8 = torch.float8_e4m3fn
    if not all(isinstance(t, torch.Tensor) for t in (q, k_cache, v_cache, kw.get("page_table"),
                                                       kw.get("cache_seqlens"), kw.get("cu_seqlens_q"))):
        return False
    query_ok = q.dtype == fp8 or _kept and q.dtype == torch.bfloat16
    if not query_ok or k_cache.dtype != fp8 or v_cache.dtype != fp8 or q.dim() != 3 or k_cache.dim() != 4:
        return False
    d = q.shape[-1]
    if k_cache.shape[-1] != d or v_cache.shape[-1] != d or core.supports(d, q.shape[1], k_cache.shape[2]):
        return False
    if any(kw.get(name) is not None for name in _OFF) or kw.get("max_seqlen_q") != 1 or kw.get("causal") is not True:
        return False
    if tuple(kw.get("window_size", (-1, -1))) != (-1, -1) or kw.get("softcap") or kw.get("attention_chunk"):
        return False
    if kw.get("return_softmax_lse") or kw.get("only_qv") or kw.get("ver", 3) != 3:
        return False
    return _scalar(kw.get("k_descale")) is not None and _scalar(kw.get("v_descale")) is not None and kv_store.on_device(q)


def flash_attn_with_kvcache(original, *args, **kw):
    """AROUND fa3's `flash_attn_with_kvcache`: its decode batches over the FP8 pool through flashrl's kernel (or
    XQA's, module docstring)."""
    q = kw.get("q")
    kept = _kept and isinstance(q, torch.Tensor) and q.dtype != torch.float8_e4m3fn
    if not takes(args, kw) or not core.enabled(q.device):
        return original(*args, **({**kw, "q": q.to(torch.float8_e4m3fn)} if kept else kw))
    v_cache = kw["v_cache"]
    out = kw.get("out")
    if out is None:  # FA3's output for an FP8 query is BF16
        out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[-1], dtype=torch.bfloat16, device=q.device)
    splits = 1 if kw.get("num_splits") == 1 else None
    q_scale = 1.0  # fa3 casts the query to FP8 unscaled
    if kept and core.takes_xqa(q, kw["k_cache"], out, kw["cache_seqlens"], splits):
        q_scale = None  # XQA takes the BF16 query as it is
    elif kept:
        q = q.to(torch.float8_e4m3fn)  # the cast fa3 would have made
    scale = kw.get("softmax_scale")
    return core.attend(q, kw["k_cache"], v_cache, out, kw["page_table"], kw["cache_seqlens"], kw["cu_seqlens_q"],
                       q.shape[-1] ** -0.5 if scale is None else scale, _scalar(kw["k_descale"]),
                       _scalar(kw["v_descale"]), q_scale=q_scale, splits=splits, via="SGLang's fa3 backend")
