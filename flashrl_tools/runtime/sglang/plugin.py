"""SGLang general plugin (entry point group `sglang.srt.plugins`): with FLASHRL_CONFIG set, registers
the hooks of `HOOKS` with SGLang's `HookRegistry` (without it, the two server-args hooks only: they
refuse an engine whose config changed after SGLang loaded the plugins, once per process). SGLang only logs an exception raised by a plugin,
so an invalid config is raised from the first hook that runs (`ServerArgs.__post_init__`: the engine
refuses to start) instead of here.

| hook | target (SGLang 0.5.17) | process | what it does |
| --- | --- | --- | --- |
| server_args | `ServerArgs.__post_init__` (before) | engine / launcher | the checkpoint and tokenizer the config serves; refusals at start (server_args.py) |
| late_server_args | `ServerArgs.check_server_args` (before) | engine / launcher | the same, once, for ServerArgs built before the plugins loaded (verl's server) |
| linear_layout | `CompressedTensorsLinearMethod.process_weights_after_loading` (around) | scheduler | keep the loaded Parameters; refuse layouts in new memory (weight_sync.py) |
| moe_layout | `CompressedTensorsFusedMoEMethod.process_weights_after_loading` (around) | scheduler | the same for MoE experts |
| model_runner | `ModelRunner.load_model` (after) | scheduler | a `WeightSync` replaces `model.load_weights` |
| direct_updates | `WeightUpdater.update_weights_from_tensor` (before) | scheduler | refuse `load_format="direct"` and custom loaders (they bypass `load_weights`) |
| request_guard | `Scheduler._add_request_to_queue` (before) | scheduler | abort requests while the weights are incomplete |
| release_weights | `SchedulerWeightUpdaterManager.release_memory_occupation` (after) | scheduler | SGLang's sleep freed the weights (no CPU backup): refuse until a full sync |
| kv_calibrate | `TokenizerManager.generate_request` (around) | engine / server | FP8 KV cache: calibrate before the next rollout after an update (kv_front.py) |
| kv_after_* | `TokenizerManager.update_weights_from_*` (around) | engine / server | the same: mark the scales stale |

With an FP8 KV cache the model_runner hook also attaches the scheduler side of the scales
(kv_scales.py), request_guard routes the calibration requests to it, and `Scheduler.flashrl_kv_scales(path)`
(for `Engine.collective_rpc`) writes rank 0's scales as JSON.
"""

from __future__ import annotations

import logging

from flashrl_tools.runtime.sglang import kv_front

log = logging.getLogger("flashrl_tools.runtime")

_LINEAR = "sglang.srt.layers.quantization.compressed_tensors.compressed_tensors.CompressedTensorsLinearMethod"
_MOE = "sglang.srt.layers.quantization.compressed_tensors.compressed_tensors.CompressedTensorsFusedMoEMethod"
_TOKENIZER = "sglang.srt.managers.tokenizer_manager"
_CONTROL = "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin"
_state: dict = {}  # this process: "rc", "error", "loaded" (LoadedParams), "syncs", "kvs" (KVScales)


def _config():
    """The active config; raises the config's error where SGLang does not swallow it."""
    from flashrl_tools.errors import FlashRLError

    if "error" in _state:
        e: FlashRLError = _state["error"]
        raise RuntimeError(f"flashrl: {e.message}")
    return _state["rc"]


def server_args(self, *args, **kwargs):
    """Before `ServerArgs.__post_init__` (Engine, launch_server: plugins load before the arguments are
    built) and before `check_server_args` (verl's server builds ServerArgs itself and loads the plugins
    only in `Engine._launch_subprocesses`, after it): the first one that runs applies the config."""
    from flashrl_tools.errors import FlashRLError
    from flashrl_tools.runtime.sglang.server_args import apply_overrides

    if getattr(self, "_flashrl_applied", False):
        return
    if _env() != _state.get("env"):  # SGLang loads plugins once per process: a later engine's env is not read
        raise RuntimeError(f"flashrl: FLASHRL_CONFIG / FLASHRL_KV_CACHE_DTYPE are {_env()} for this SGLang engine "
                           f"but were {_state.get('env')} when SGLang loaded its plugins in this process (once per "
                           "process); start each engine with another config in its own process")
    if "rc" not in _state and "error" not in _state:
        return  # no FLASHRL_CONFIG: plain SGLang
    try:
        changed = apply_overrides(_config(), self)
    except FlashRLError as e:
        raise RuntimeError(f"flashrl: {e.message}") from None
    self._flashrl_applied = True
    if changed:
        log.info("flashrl %s: SGLang server args %s", _state["rc"].fn.value, changed)


def layout(original, method, layer, *args, **kwargs):
    return _state["loaded"].around_processing(original, method, layer, *args, **kwargs)


def model_runner(result, runner, *args, **kwargs):
    from flashrl_tools.errors import FlashRLError
    from flashrl_tools.runtime.kv_calibration import has_kv_scales
    from flashrl_tools.runtime.sglang.kv_scales import KVScales, uses_fp8_kv
    from flashrl_tools.runtime.sglang.weight_sync import attach

    if getattr(runner, "is_draft_worker", False):
        return result
    try:
        sync = attach(runner.model, runner.model_config.model_path, _config(), _state["loaded"])
        if uses_fp8_kv(runner):
            _state["kvs"].append(KVScales(runner, sync, has_kv_scales(runner.model_config.model_path)))
            _add_scales_rpc()
    except FlashRLError as e:
        raise RuntimeError(e.message) from None
    _state["syncs"].append(sync)
    return result


def _add_scales_rpc() -> None:
    from sglang.srt.managers.scheduler import Scheduler

    Scheduler.flashrl_kv_scales = dump_kv_scales


def dump_kv_scales(scheduler, path: str) -> None:
    """`Engine.collective_rpc("flashrl_kv_scales", path=...)`: rank 0's current FP8 KV scales as JSON."""
    import json

    from flashrl_tools.fsutil import atomic_write_text

    if getattr(scheduler, "tp_rank", 0) == 0 and _state.get("kvs"):
        kv = _state["kvs"][0]
        atomic_write_text(path, json.dumps({"scales": kv.current, "stale": kv.stale()}))


def direct_updates(updater, named_tensors=None, load_format=None, *args, **kwargs):
    if load_format not in (None, "flattened_bucket"):
        raise RuntimeError(f"flashrl: update_weights_from_tensor(load_format={load_format!r}) writes parameters "
                           "without re-quantizing them; push with load_format=None or 'flattened_bucket'")


def release_weights(result, manager, recv_req=None, *args, **kwargs):
    """SGLang's sleep: `release_memory_occupation(tags)` with "weights" (or no tags) frees the weights'
    memory and restores only buffers on resume (`_export_static_state`): refuse until a full sync.
    With `enable_weights_cpu_backup` (verl's hybrid engine sets it) the memory saver copies the weights'
    memory to the CPU and back on resume, synced 8-bit weights included: nothing is lost."""
    tags = getattr(recv_req, "tags", None)
    if _weights_backed_up(manager):
        return result
    if not tags or "weights" in tags:
        for sync in _state["syncs"]:
            sync.discard("SGLang release_memory_occupation(weights)")
    return result


def _weights_backed_up(manager) -> bool:
    runner = getattr(getattr(manager, "tp_worker", None), "model_runner", None)
    return bool(getattr(getattr(runner, "server_args", None), "enable_weights_cpu_backup", False))


def request_guard(scheduler, req, is_retracted=False, *args, **kwargs):
    if is_retracted or getattr(req, "finished_reason", None) is not None:
        return
    problem = next((s for s in (sync.status() for sync in _state["syncs"]) if s), None)
    if problem is None:
        problem = next((s for s in (kv.on_request(req.rid) for kv in _state.get("kvs", ())) if s), None)
    if problem is not None:
        req.set_finish_with_abort(problem)
    elif getattr(req, "return_logprob", False) and not _state.get("warned_truncation") and _truncates(req):
        _state["warned_truncation"] = True
        log.warning("flashrl: SGLang returns log softmax(logits / T) before top-p / top-k truncation: with top_p < 1 "
                    "or top_k set these are not the logprobs of the distribution sampled from (vLLM's "
                    "processed_logprobs are); importance weights computed from them are off. Sample with top_p=1, "
                    "top_k=-1, or ask return_sampling_mask=True (with a finite top_k) and read "
                    "meta_info['output_token_sampling_logprobs'] (renormalised over the sampled support)")


def _truncates(req) -> bool:
    params = getattr(req, "sampling_params", None)
    top_p, top_k = getattr(params, "top_p", 1.0), getattr(params, "top_k", -1)
    return top_p < 1.0 or 0 < top_k < (1 << 30)  # SGLang's TOP_K_ALL = 1 << 30: the whole vocabulary


HOOKS = [  # (name, target, hook, HookType name)
    ("server_args", "sglang.srt.server_args.ServerArgs.__post_init__", server_args, "BEFORE"),
    ("late_server_args", "sglang.srt.server_args.ServerArgs.check_server_args", server_args, "BEFORE"),
    ("linear_layout", f"{_LINEAR}.process_weights_after_loading", layout, "AROUND"),
    ("moe_layout", f"{_MOE}.process_weights_after_loading", layout, "AROUND"),
    ("model_runner", "sglang.srt.model_executor.model_runner.ModelRunner.load_model", model_runner, "AFTER"),
    ("direct_updates", "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater."
                       "update_weights_from_tensor", direct_updates, "BEFORE"),
    ("request_guard", "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue", request_guard, "BEFORE"),
    ("release_weights", "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager."
                        "release_memory_occupation", release_weights, "AFTER"),
    ("kv_calibrate", f"{_TOKENIZER}.TokenizerManager.generate_request", kv_front.generate_request, "AROUND"),
] + [(f"kv_after_{kind}", f"{_CONTROL}.update_weights_from_{kind}", kv_front.weights_changed, "AROUND")
     for kind in ("tensor", "distributed", "ipc")] + [
    ("kv_after_disk", f"{_TOKENIZER}.TokenizerManager.update_weights_from_disk", kv_front.weights_changed, "AROUND"),
]


def _env() -> tuple:
    import os

    return tuple(os.environ.get(k) or None for k in ("FLASHRL_CONFIG", "FLASHRL_KV_CACHE_DTYPE"))


def register(registry=None, hook_type=None) -> None:
    """SGLang's entry point. `registry` / `hook_type`: SGLang's HookRegistry and HookType (tests pass
    stand-ins). Without FLASHRL_CONFIG only the two server-args hooks, which change nothing but refuse an
    engine whose config differs from the one read here (SGLang loads plugins once per process)."""
    from flashrl_tools.config.resolve import from_env
    from flashrl_tools.errors import FlashRLError
    from flashrl_tools.runtime.logs import configure_logging
    from flashrl_tools.runtime.sglang.weight_sync import LoadedParams

    if registry is None:
        from sglang.srt.plugins.hook_registry import HookRegistry as registry, HookType as hook_type
    _state["env"] = _env()
    try:
        rc = from_env()
    except FlashRLError as e:  # raised by the server_args hook, where SGLang does not swallow it
        _state["error"], rc = e, None
    if rc is None:
        for _name, target, hook, _kind in HOOKS[:2]:  # the two server-args hooks
            registry.register(target, hook, hook_type.BEFORE)
        return
    configure_logging()
    _state.update(rc=rc, loaded=LoadedParams(), syncs=[], kvs=[])
    for _name, target, hook, kind in HOOKS:
        registry.register(target, hook, getattr(hook_type, kind))
