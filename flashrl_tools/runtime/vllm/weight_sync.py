"""Weight sync, vLLM side: the `ModelWriter` of a model vLLM loaded (the loop, conversion and refusal are
the core's `SyncSession`, which replaces `model.load_weights`). Each converted checkpoint tensor is
written in place into the kernel's storage when its layer's processed layout is known (inplace.py),
else handed to vLLM's layerwise reload (restore the checkpoint layout, load, re-run
`process_weights_after_loading`, copy into the original storage). Works whether the trainer calls
`model.load_weights` one tensor at a time (verl, TRL colocate), in buckets, or vLLM's
`reload_weights` / weight-transfer engine."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from flashrl_tools.runtime.core.convert import WeightConverter
from flashrl_tools.runtime.core.kv_math import has_kv_scales, is_fp8_kv
from flashrl_tools.runtime.core.adapter import Converted
from flashrl_tools.runtime.core.session import SyncSession, open_session
from flashrl_tools.runtime.vllm import inplace
from flashrl_tools.runtime.vllm.inplace import InPlacePlan

log = logging.getLogger("flashrl_tools.runtime")


class LayerwiseWriter:
    """Writes converted tensors in place or through vLLM's layerwise reload."""

    def __init__(self, model: torch.nn.Module, model_config, plan: InPlacePlan | None):
        self.model, self.model_config = model, model_config
        self.inplace = plan if plan is not None else InPlacePlan()  # layers written in place
        self.load_weights = model.load_weights  # vLLM's own loader (before the session replaces it)
        self.shared_modules = _modules_sharing_parameters(model)
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        # started with load_format="dummy": the first complete sync also sets the attention scales
        # a real load gives (no trainer pushes them; kv_scales.default_attention_scales)
        self.dummy_scales = False

    def begin(self, reopen: bool) -> None:
        """Also reached from vLLM's own reload_weights, which has initialized the layerwise reload
        already: initializing again skips initialized layers, and its finalize after ours finds
        nothing left to do."""
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        if reopen:  # close what a failed or interrupted sync left half-loaded
            finalize_layerwise_reload(self.model, self.model_config)
        initialize_layerwise_reload(self.model)
        self.inplace.begin()

    def load(self, converted: Iterator[Converted], *args, **kwargs) -> set[str]:
        loaded = set(self.load_weights(self._route(converted), *args, **kwargs) or ())
        return loaded | self.inplace.pop_loaded()

    def _route(self, converted: Iterator[Converted]):
        """Write the tensors of in-place layers now and yield the rest for vLLM's loader. vLLM's
        layerwise reload keeps what it is given until the layer's last tensor arrives, possibly
        after this call returns, while trainers reuse their buffers (verl's bucket buffer is
        overwritten with the next bucket): a tensor that still shares storage with the caller's is
        copied before it goes there."""
        for item in converted:
            callers = {t.untyped_storage().data_ptr() for t in item.sources}
            for name, tensor in item.tensors:
                if self.inplace.owns(name):  # copied into the kernel's storage now
                    self.inplace.write(name, tensor)
                else:
                    yield name, self._own(tensor, callers)

    def _own(self, tensor: torch.Tensor, callers: set[int]) -> torch.Tensor:
        """`tensor`, or a copy of it on the model's device when it shares storage with the caller's."""
        if tensor.untyped_storage().data_ptr() not in callers:
            return tensor
        return tensor.clone() if tensor.device == self.device else tensor.to(self.device)

    def finish(self) -> None:
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


def _modules_sharing_parameters(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules holding a Parameter that another module holds too (a tied lm_head and its embedding). A
    module holding one Parameter under two names is not one: vLLM 0.26's Marlin WNA16 MoE method aliases
    its processed `w13_weight_packed` / `w2_weight_packed` as `w13_weight` / `w2_weight`, and processing
    those again repacks Marlin's layout as if it were the checkpoint's (`Hidden size mismatch w1`)."""
    owners: dict[int, dict[int, torch.nn.Module]] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(id(param), {})[id(module)] = module
    shared = {id(m): m for ms in owners.values() if len(ms) > 1 for m in ms.values()}
    return [m for m in shared.values() if hasattr(getattr(m, "quant_method", None), "process_weights_after_loading")]


def _inplace_plan(model: torch.nn.Module, converter: WeightConverter) -> InPlacePlan | None:
    """The in-place fast path for the 8-bit linears whose processed layout is known (inplace.py);
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


def attach_sync(model: torch.nn.Module, model_config, rc, fp8_kv_cache: bool, dummy: bool = False) -> SyncSession:
    """The sync session of a model vLLM loaded: it replaces `model.load_weights`, and the model's
    forward refuses while the weights are incomplete (a last line: the front end refuses first)."""
    loaded_dir = Path(model_config.model)

    def writer_for(converter: WeightConverter) -> LayerwiseWriter:
        writer = LayerwiseWriter(model, model_config, _inplace_plan(model, converter))
        writer.dummy_scales = dummy  # (an FP8 KV cache is recalibrated after it)
        return writer

    session = open_session(model, loaded_dir, rc, writer_for, "vllm", _tp_rank())
    check_vllm_version(model, session, rc, loaded_dir, dummy)
    model.load_weights = session.load_weights
    model.flashrl_sync = session
    original_forward = model.forward

    def forward(*args, **kwargs):
        session.check_ready()
        return original_forward(*args, **kwargs)

    model.forward = forward
    if fp8_kv_cache:
        from flashrl_tools.runtime.core.kv_state import KVScaleState
        from flashrl_tools.runtime.vllm.kv_scales import AttentionScales

        model.flashrl_kv = KVScaleState(AttentionScales(model), session, has_kv_scales(loaded_dir))
    return session


def check_vllm_version(model, session, rc, loaded_dir, dummy: bool) -> None:
    """On a vLLM version not declared tested: the start-up self-check (core/versions.py) with this worker's hooks
    (those of the other build excepted) and the weight digest."""
    from flashrl_tools.runtime.core import versions
    from flashrl_tools.runtime.core.digest import model_digest
    from flashrl_tools.runtime.core.hooks import declared, missing
    from flashrl_tools.runtime.vllm.capabilities import capabilities, on_cpu, vllm_version

    caps = capabilities()
    worker = [h for h in declared("vllm") if h.process.startswith("worker")]
    versions.check_at_start(caps.engine, vllm_version(), caps.tested, session, rc, loaded_dir, dummy,
                            lambda: missing(worker, "GPU" if on_cpu() else "CPU") if worker else ["the vLLM hook table"],
                            lambda: model_digest(model, "vllm"))


def loader_loaded(model, loader, vllm_config, model_config, *args, **kwargs):
    """AFTER `BaseModelLoader.load_model` (worker): attach a sync session to every model vLLM loads."""
    from flashrl_tools.runtime.core.process import config

    fmt = getattr(getattr(vllm_config, "load_config", None), "load_format", None)
    dummy = str(getattr(fmt, "value", fmt)).lower() == "dummy"  # verl's rollout default: weights come later
    fp8_kv = is_fp8_kv(getattr(vllm_config.cache_config, "cache_dtype", None))
    if fp8_kv:
        from flashrl_tools.runtime.vllm import decode_attn

        decode_attn.choose_for_vllm(vllm_config)
    attach_sync(model, model_config, config(), fp8_kv, dummy)
    return model


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # no distributed state (a model built by hand)
        return 0


def post_load_processing(original, model, *args, **kwargs):
    """AROUND vLLM's whole-model `process_weights_after_loading`, which verl (vllm_rollout/utils.py,
    update_weights_from_ipc) calls after pushing all buckets through `model.load_weights`. The sync
    re-processed every layer when its last tensor arrived; processing again repacked 8-bit weights
    fails (vLLM-CPU: `'NoneType' object has no attribute 'dtype'`): a no-op for synced models."""
    if getattr(model, "flashrl_sync", None) is not None:
        log.debug("flashrl: process_weights_after_loading skipped (the weight sync did it)")
        return None
    return original(model, *args, **kwargs)
