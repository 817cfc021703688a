"""What SGLang serves under the runtime: its `Capabilities` (core/adapter.py). Start-up refusals read it
(core/plan.py); the README's engine table is rendered from it."""

from __future__ import annotations

from flashrl_tools.quant.formats import QuantFn, Strategy
from flashrl_tools.runtime.core.adapter import COMMON_SETTINGS, Capabilities, Setting

_SETTINGS = {
    **COMMON_SETTINGS,
    "FLASHRL_KV_CACHE_DTYPE": Setting("SGLang's kv_cache_dtype (fp8 -> fp8_e4m3, fp8_e5m2); k / v scales "
                                      "recalibrated before the first rollout after every sync"),
    "FLASHRL_LMHEAD_FP32": Setting("SGLang's enable_fp32_lm_head=True (the LM head's logits in fp32)"),
    "FLASHRL_INPLACE_SYNC": Setting("1: 8-bit tensors copied into the storage SGLang's loaders fill (probed at start, "
                                    "checked over the first sync); 0: its loaders",
                                    ("1", "0")),
    "FLASHRL_DECODE_GEMM": Setting("N (1..64): INT8 W8A8 linears at <= N rows through flashrl's Triton GEMM "
                                   "(bit-equal to sgl-kernel's int8_scaled_mm; GPU); unset / auto: 16 on Hopper "
                                   "(sm_90), else off; 0: sgl-kernel's for every batch"),
    "FLASHRL_FUSED_KV_STORE": Setting("1 (default): with an FP8 KV cache, fa3's decode stores K / V in one kernel "
                                      "(SGLang's fused_fp8_qkv_kv_cache) instead of five; 0: SGLang's store"),
    "FLASHRL_DECODE_ATTN": Setting("unset / auto: on Hopper, with an FP8 KV cache, fa3's decode batches' attention "
                                   "through flashrl's Triton kernel, the pool by "
                                   "16-token pages when attention_backend='fa3' is passed without a page_size; 1: "
                                   "on any GPU; 0: FA3's (SGLang's page_size); xqa: TensorRT-LLM's XQA FP8 kernel "
                                   "(FlashInfer 0.6) from 32 sequences up on Hopper, faster, FP8 products; fp8qk: "
                                   "flashrl's kernel with fa3's FP8 query x FP8 key products in Hopper's FP8 MMA "
                                   "(opt-in, not yet measured); other backends: no effect"),
    "FLASHRL_SYNC_DIGEST": Setting("each scheduler (TP rank) writes its weight digest after every complete sync"),
    "FLASHRL_STEP_LOG": Setting("PATH: the scheduler of TP rank 0 appends a line per model step -- time, kind, its "
                                "requests, the unfinished ones (`rl_step.py --engine sglang --step-bands`)"),
    "FLASHRL_ENGINE_ARGS": Setting("extra sglang.Engine arguments for the engines `flashrl verify --engine sglang` "
                                   "starts"),
    "FLASHRL_ZYGOTE": Setting("not read (`verify` / `tune` fork vLLM's engine jobs on CPU hosts, not SGLang's)"),
}
CAPABILITIES = Capabilities(
    engine="SGLang", versions="tested: 0.5.17; others run a start-up self-check", tested=("0.5.17",),
    # SGLang keeps per-channel layouts in the storage it loaded (weight_sync.py); per-tensor FP8 of fused
    # layers is re-quantized to one scale at load; W4A16 layers are re-laid out (marlin.py)
    formats=frozenset(f for f in QuantFn if f.strategy is Strategy.channel or f.packed),
    formats_note="fused per-tensor FP8 re-quantized to one scale at load; block FP8 unchecked",
    moe_formats=frozenset(f for f in QuantFn if f.is_fp8 and f.strategy is Strategy.channel),
    moe_note="SGLang 0.5.17 serves compressed-tensors INT8 MoE experts on NPU only",
    fp8_dense=QuantFn.fp8_channel, fp8_moe=QuantFn.fp8_channel,
    checkpoint_quantization="compressed-tensors", online_quantization=(),
    fp8_kv_cache=True, kv_scales=("k", "v"),
    fp8_kv_note="k / v scales recalibrated before the first rollout after every sync (triton / flashinfer: decode graphs "
                "captured again)",
    kv_dtype_names={"fp8": "fp8_e4m3"},
    lmhead_fp32="enable_fp32_lm_head=True",
    in_flight="pause abort / retract / in_place, push, continue: requests = a fresh engine (radix cache by version); "
              "FP8 KV: no drain",
    sleep="release / resume: with verl's CPU backup synced weights survive; without it, refused until a full sync",
    push_paths=("update_weights_from_tensor (per tensor, flattened buckets)", "update_weights_from_distributed",
                "verl's SGLang rollout (CUDA IPC buckets)"),
    logprobs="log softmax(logits / T) (top_p 1, top_k -1); with truncation output_token_sampling_logprobs "
             "(return_sampling_mask)",
    logprobs_modes=("processed_logprobs",),
    settings=_SETTINGS,
)


def sglang_version() -> str:
    import sglang

    return str(getattr(sglang, "__version__", "unknown"))


def tp_rank(obj) -> int:
    """A Scheduler's or ModelRunner's TP rank: SGLang 0.5.17 keeps it in its parallel state (`obj.ps.tp_rank`;
    the object has no `tp_rank`, so reading that gave 0 on every rank), earlier releases as `obj.tp_rank`."""
    return _parallel(obj, "tp_rank", 0)


def tp_size(obj) -> int:
    """Its TP size, the same way (`obj.ps.tp_size`, else `obj.tp_size`)."""
    return max(1, _parallel(obj, "tp_size", 1))


def _parallel(obj, name: str, default: int) -> int:
    value = getattr(getattr(obj, "ps", None), name, None)
    return int(getattr(obj, name, default) if value is None else value)
