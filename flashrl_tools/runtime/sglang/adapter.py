"""The SGLang adapter's hook table: where the runtime touches SGLang (`HOOKS`, registered with SGLang's own
HookRegistry by `register`, from SGLang's plugin entry point, in the engine, the server launcher and
every scheduler (TP rank) process); what SGLang serves is capabilities.py. `core.adapter.hook_table(HOOKS)`
renders the table as markdown (docs/internals/sglang.md). Written against SGLang 0.5.17; nothing here
imports SGLang at import time.

SGLang only logs an exception raised by a plugin, so a config that cannot be read is raised from the
first hook that runs (`ServerArgs.__post_init__`: the engine refuses to start). SGLang loads plugins
once per process: the process's state is core/process.py, and an engine started after FLASHRL_CONFIG /
FLASHRL_KV_CACHE_DTYPE changed is refused there (`check_env`)."""

from __future__ import annotations

from flashrl_tools.runtime.core.adapter import Hook, HookKind
from flashrl_tools.runtime.core.hooks import declare
from flashrl_tools.runtime.sglang import (decode_attn, decode_gemm, kv_front, kv_store, marlin, pause, scheduler,
                                          server_args, weight_sync)

_CT = "sglang.srt.layers.quantization.compressed_tensors.compressed_tensors"
_CT_INT8 = "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_int8"
_TOKENIZER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
_CONTROL = "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin"
_UPDATER = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
HOOKS: tuple[Hook, ...] = declare("sglang", (
    Hook("server_args", "sglang.srt.server_args.ServerArgs.__post_init__", server_args.server_args, HookKind.BEFORE,
         "engine / launcher", "the serving plan: checkpoint, tokenizer, KV-cache dtype, lm head; refusals at start",
         always=True),
    Hook("late_server_args", "sglang.srt.server_args.ServerArgs.check_server_args", server_args.server_args,
         HookKind.BEFORE, "engine / launcher", "the same, once, for ServerArgs built before the plugins loaded "
         "(verl's server)", always=True),
    Hook("linear_layout", f"{_CT}.CompressedTensorsLinearMethod.process_weights_after_loading",
         weight_sync.around_processing, HookKind.AROUND, "scheduler",
         "keep the loaded Parameters; refuse layouts in new memory"),
    Hook("moe_layout", f"{_CT}.CompressedTensorsFusedMoEMethod.process_weights_after_loading",
         weight_sync.around_processing, HookKind.AROUND, "scheduler", "the same for MoE experts"),
    Hook("marlin_reduce", "sglang.srt.layers.quantization.marlin_utils.should_use_atomic_add_reduce",
         marlin.no_atomic_add, HookKind.AROUND, "scheduler", "W4A16 linears: Marlin reduces in a fixed order, not by "
         "atomic adds (their run-dependent order made an engine's logprobs vary; vLLM's default)", optional=True),
    Hook("model_runner", "sglang.srt.model_executor.model_runner.ModelRunner.load_model", weight_sync.runner_loaded,
         HookKind.AFTER, "scheduler", "a sync session replaces `model.load_weights`; FP8 KV scales state"),
    Hook("kv_store_decode", "sglang.srt.layers.attention.flashattention_backend.FlashAttentionBackend.forward_decode",
         decode_attn.forward_decode, HookKind.AROUND, "scheduler", "FP8 KV cache: marks fa3's decode step (it does "
         "not read K / V again after storing them); FLASHRL_DECODE_ATTN=xqa keeps its query BF16", optional=True),
    Hook("decode_gemm", f"{_CT_INT8}.CompressedTensorsW8A8Int8.apply_weights", decode_gemm.scheme_apply_weights,
         HookKind.AROUND, "scheduler", "FLASHRL_DECODE_GEMM=N (unset: 16 on Hopper): INT8 W8A8 linears at <= N rows "
         "through flashrl's Triton GEMM (bit-equal to sgl-kernel's)", optional=True),
    Hook("decode_attn", "sglang.srt.layers.attention.flashattention_backend.flash_attn_with_kvcache",
         decode_attn.flash_attn_with_kvcache, HookKind.AROUND, "scheduler", "FLASHRL_DECODE_ATTN (unset: on "
         "Hopper): with an FP8 KV cache, fa3's decode batches' attention through flashrl's Triton kernel",
         optional=True),
    Hook("kv_store", "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool.set_kv_buffer", kv_store.set_kv_buffer,
         HookKind.AROUND, "scheduler", "FP8 KV cache, fa3's decode: K / V scaled, cast and stored in one kernel "
         "(SGLang's `fused_fp8_qkv_kv_cache`) instead of five (FLASHRL_FUSED_KV_STORE)"),
    Hook("direct_updates", "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater."
         "update_weights_from_tensor", scheduler.direct_updates, HookKind.BEFORE, "scheduler",
         "refuse `load_format=\"direct\"` and custom loaders (they bypass `load_weights`)"),
    Hook("request_guard", "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue", scheduler.add_request,
         HookKind.BEFORE, "scheduler", "abort requests while the weights are incomplete or the FP8 KV scales "
         "stale; route the calibration's requests (its last: the requests kept in place decode on)"),
    Hook("release_weights", f"{_UPDATER}.release_memory_occupation", scheduler.release_weights, HookKind.AFTER, "scheduler",
         "SGLang's sleep freed the weights (no CPU backup): refuse until a full sync"),
    Hook("rpc_kv_scales", "sglang.srt.managers.scheduler.Scheduler.flashrl_kv_scales", scheduler.dump_kv_scales,
         HookKind.ADD, "scheduler", "`Engine.collective_rpc(\"flashrl_kv_scales\", path=...)`: each rank's FP8 KV "
         "scales as JSON", optional=True),
    Hook("prefix_salt", "sglang.srt.managers.schedule_batch.Req.init_next_round_input", pause.salt,
         HookKind.BEFORE, "scheduler", "radix-cache namespace by weights' version: nothing prefilled after an "
         "update reuses KV of the old weights"),
    Hook("flush_after_update", f"{_UPDATER}.flush_cache_after_weight_update", pause.flush_after_update,
         HookKind.AROUND, "scheduler", "an update while requests are paused in flight keeps the cache (SGLang "
         "asserts): the namespaces keep versions apart"),
    Hook("pause", "sglang.srt.managers.scheduler.Scheduler.pause_generation", pause.scheduler_pause,
         HookKind.AROUND, "scheduler", "remember the pause's mode"),
    Hook("continue", "sglang.srt.managers.scheduler.Scheduler.continue_generation", pause.scheduler_continue,
         HookKind.AROUND, "scheduler", "stale FP8 KV scales: set aside the retracted requests, or the running batch "
         "kept in place, until the scales are written (a rank still incomplete: abort what it kept)"),
    Hook("sync_state", "sglang.srt.managers.scheduler.Scheduler.get_internal_state", pause.sync_state,
         HookKind.AFTER, "scheduler", "the scheduler's sync state, for the front end's continue"),
    Hook("release_held", "sglang.srt.managers.scheduler.Scheduler.process_batch_result", pause.release_held,
         HookKind.AFTER, "scheduler", "FP8 KV: retracted and waiting requests set aside go on once the "
         "calibration's last request ran"),
    Hook("calibration_one_per_batch", "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue",
         scheduler.one_calibration_per_batch, HookKind.AROUND, "scheduler", "FP8 KV: the calibration's sequences, "
         "sent at once, reach the queue one at a time (each prefilled alone, as on a fresh engine)"),
    Hook("calibration_next", "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
         scheduler.next_calibration, HookKind.AFTER, "scheduler", "FP8 KV: the next calibration sequence goes "
         "to the queue once the one before is in the batch about to run (or finished)"),
    Hook("batch_done", "sglang.srt.managers.scheduler.Scheduler.process_batch_result", scheduler.progress,
         HookKind.AFTER, "scheduler", "FLASHRL_STEP_LOG: rank 0 logs the step; FLASHRL_DEBUG_STACKS: a scheduler "
         "without a batch result for 30 s writes its stacks (DIR/PID.stacks)"),
    Hook("not_idle", "sglang.srt.managers.scheduler.Scheduler.is_fully_idle", pause.busy, HookKind.AROUND,
         "scheduler", "not idle while requests are set aside (SGLang's idle check would count their slots as "
         "leaked)"),
    Hook("front_pause", f"{_TOKENIZER}.pause_generation", pause.front_pause, HookKind.AROUND, "engine / server",
         "remember the pause's mode"),
    Hook("front_continue", f"{_TOKENIZER}.continue_generation", pause.front_continue, HookKind.AROUND,
         "engine / server", "refused before the sync completed (the engine stays paused); FP8 KV after a retract "
         "or in place: calibrate at the continue, beside the requests set aside"),
    Hook("kv_calibrate", f"{_TOKENIZER}.generate_request", kv_front.generate_request, HookKind.AROUND,
         "engine / server", "FP8 KV cache: calibrate before the next rollout after an update"),
    *(Hook(f"kv_after_{kind}", f"{_CONTROL}.update_weights_from_{kind}", kv_front.weights_changed, HookKind.AROUND,
           "engine / server", "FP8 KV cache: the scales are stale after this update")
      for kind in ("tensor", "distributed", "ipc")),
    Hook("kv_after_disk", f"{_TOKENIZER}.update_weights_from_disk", kv_front.weights_changed, HookKind.AROUND,
         "engine / server", "the same for a reload from disk"),
))

def register(registry=None, hook_type=None) -> None:
    """SGLang's entry point. `registry` / `hook_type`: SGLang's HookRegistry and HookType (tests pass
    stand-ins). Without FLASHRL_CONFIG only the `always` hooks, which change nothing but refuse an
    engine whose config differs from the one read here."""
    from flashrl_tools.config.resolve import from_env
    from flashrl_tools.errors import FlashRLError
    from flashrl_tools.config.settings import settings
    from flashrl_tools.runtime.core import decode_gemm as core_decode_gemm, process as core_process
    from flashrl_tools.runtime.core.hooks import install
    from flashrl_tools.runtime.core.logs import configure_logging

    if registry is None:
        from sglang.srt.plugins.hook_registry import HookRegistry as registry, HookType as hook_type
    try:
        rc, error = from_env(), None
    except FlashRLError as e:  # raised by the server_args hook, where SGLang does not swallow it
        rc, error = None, e
    core_process.serve(rc, error)
    if rc is None:
        install([h for h in HOOKS if h.always], registry, hook_type)
        return
    configure_logging()
    core_decode_gemm.configure(settings().decode_gemm)  # validated by the plan (core/adapter.check_settings)
    install(HOOKS, registry, hook_type)
