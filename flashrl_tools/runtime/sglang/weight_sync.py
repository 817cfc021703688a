"""Weight sync, SGLang side: the `ModelWriter` of a model SGLang loaded (the loop, conversion and refusal
are the core's `SyncSession`, which replaces `model.load_weights`).

SGLang's compressed-tensors INT8 / FP8 per-channel layers replace their `weight` by a transposed view
and `weight_scale` by a new Parameter over the same storage after loading, which drops the
`weight_loader` SGLang's own `load_weights` needs: a second load crashes, and SGLang never
re-quantizes pushed BF16. So, per quantized layer, `LoadedParams` keeps the Parameters SGLang loaded
into (with their loaders) when `process_weights_after_loading` replaced them by views of the same
storage, and refuses the engine at start when a layer's processed tensors are not such views (a layout
this runtime cannot write). The writer puts the loaded Parameters back for the length of one call to
the model's own `load_weights` (its name mapping, fused shards and TP slicing), which writes into the
storage the kernels read, then restores the processed ones. W4A16 layers (Marlin) are the exception: their
processing makes new tensors, so the loaded ones are kept beside them and each complete sync recomputes the
kernel's layout from them in place (marlin.py). A layer is processed once: SGLang's update_weights_from_disk
processes every layer again after its load (a sync), which the runtime skips (`around_processing`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from flashrl_tools.errors import FlashRLError
from flashrl_tools.runtime.core.adapter import Converted
from flashrl_tools.runtime.core.session import SyncSession, open_session
from flashrl_tools.runtime.sglang.capabilities import tp_rank
from flashrl_tools.runtime.sglang.marlin import MarlinLayer, is_w4a16

log = logging.getLogger("flashrl_tools.runtime")
_FLUSH_BYTES = 256 << 20  # converted tensors loaded at once (bounds the memory a whole-model push takes)


def _aliases(processed: torch.Tensor, loaded: torch.Tensor) -> bool:
    """`processed` holds exactly `loaded`'s elements, in its storage (a view such as `.t()`)."""
    return (processed.untyped_storage().data_ptr() == loaded.untyped_storage().data_ptr()
            and processed.numel() == loaded.numel() and processed.dtype == loaded.dtype)


class LoadedParams:
    """Per quantized layer of this process: the Parameters SGLang loaded into, where processing
    replaced them by views of the same storage."""

    def __init__(self):
        self.layers: list[tuple[torch.nn.Module, dict[str, torch.nn.Parameter]]] = []
        self.marlin: list[MarlinLayer] = []  # W4A16 layers whose processing made new tensors (marlin.py)

    def around_processing(self, original, method, layer, *args, **kwargs):
        """SGLang's update_weights_from_disk processes every layer again after its load (which was a sync: the
        runtime's `load_weights`). A layer processed before is left as that sync wrote it: an INT8 / FP8 layer's
        processed views already show the new weights (a second transpose would hand the kernel the loaded layout),
        a W4A16 layer's kernel layout was recomputed (LoaderWriter.finish; SGLang's would fail on it)."""
        if any(four.layer is layer for four in self.marlin) or any(seen is layer for seen, _ in self.layers):
            return None
        before = dict(layer._parameters)
        four = MarlinLayer(layer) if is_w4a16(layer) else None
        result = original(method, layer, *args, **kwargs)
        replaced = {}
        if four is not None:  # the loaded tensors back in the Parameters its loaders fill; SGLang's layout checked
            replaced.update(four.restore())
            four.check()
            self.marlin.append(four)
        for name, loaded in before.items():
            now = layer._parameters.get(name)
            if loaded is None or now is loaded or name in replaced:
                continue
            if now is None or not _aliases(now, loaded):
                raise FlashRLError(f"flashrl: {type(method).__name__} re-lays out `{name}` of "
                                   f"{type(layer).__name__} into new memory after loading; weight syncs could "
                                   "not reach what its kernel reads", None,
                                   "serve int8 or fp8 (per-channel) with SGLang, or run the rollouts on vLLM")
            replaced[name] = loaded
        if replaced:
            self.layers.append((layer, replaced))
        return result

    def of(self, model: torch.nn.Module) -> list[tuple[torch.nn.Module, dict[str, torch.nn.Parameter]]]:
        mine = {id(m) for m in model.modules()}
        return [(layer, params) for layer, params in self.layers if id(layer) in mine]

    def marlin_of(self, model: torch.nn.Module) -> list[MarlinLayer]:
        mine = {id(m) for m in model.modules()}
        return [four for four in self.marlin if id(four.layer) in mine]


@contextmanager
def loaders_back(layers: list[tuple[torch.nn.Module, dict[str, torch.nn.Parameter]]]):
    """The loaded Parameters (with their weight loaders) in place of the processed ones."""
    processed = [(layer, {n: layer._parameters[n] for n in params}) for layer, params in layers]
    try:
        for layer, params in layers:
            layer._parameters.update(params)
        yield
    finally:
        for layer, params in processed:
            layer._parameters.update(params)


class LoaderWriter:
    """Writes converted tensors through SGLang's own `load_weights`, in batches of `_FLUSH_BYTES` (SGLang
    copies them at once: nothing of the caller's is kept past the call); with `slots` (core/loader_slots.py), the
    tensors they cover are copied straight into the kernels' storage once a sync through the loaders has
    shown every slot holding what the loaders wrote."""

    def __init__(self, model: torch.nn.Module, layers, slots: dict | None = None, marlin=()):
        self.load_weights, self.layers = model.load_weights, layers
        self.marlin = list(marlin)  # W4A16 layers: their kernel's layout recomputed once a sync is complete
        self.slots = slots or {}
        self.trusted = False  # the slots matched the loaders over one whole sync
        self._matched: set[str] = set()

    def begin(self, reopen: bool) -> None:
        self._matched = set()

    def load(self, converted: Iterator[Converted], *args, **kwargs) -> set[str]:
        batch: list[tuple[str, torch.Tensor]] = []
        size = 0
        for item in converted:
            for name, tensor in item.tensors:
                if self.trusted and (slot := self.slots.get(name)) is not None:
                    slot.write(tensor)
                    continue
                batch.append((name, tensor))
                size += tensor.numel() * tensor.element_size()
            if size >= _FLUSH_BYTES:
                self._flush(batch, args, kwargs)
                batch, size = [], 0
        self._flush(batch, args, kwargs)
        return set()

    def _flush(self, batch, args, kwargs) -> None:
        if batch:
            with loaders_back(self.layers):
                self.load_weights(batch, *args, **kwargs)
            if self.slots and not self.trusted:
                self._check(batch)

    def _check(self, batch) -> None:
        for name, tensor in batch:
            slot = self.slots.get(name)
            if slot is None:
                continue
            if not slot.holds(tensor):
                log.warning("flashrl: SGLang's loaders put %s elsewhere than its in-place slot; this engine's "
                            "syncs keep the loaders", name)
                self.slots = {}
                return
            self._matched.add(name)

    def finish(self) -> None:
        for four in self.marlin:
            four.write()
        if self.slots and not self.trusted:
            missing = set(self.slots) - self._matched
            for name in missing:  # never sent in a full sync (not a trainer tensor): the loaders keep it
                del self.slots[name]
            self.trusted = bool(self.slots)
            if self.trusted:
                log.info("flashrl: SGLang in-place sync for %d tensors (checked against the loaders)", len(self.slots))


def _slots(model: torch.nn.Module, loaded_dir: str, converter, layers) -> dict:
    """In-place slots for the quantized linears' weights and scales (core/loader_slots.py); none when off."""
    from flashrl_tools.config.settings import settings

    if converter.served is None or settings().inplace_sync == "0" or not converter.quantized:
        return {}
    try:
        return _probed(model, loaded_dir, converter, layers)
    except Exception as e:  # noqa: BLE001 -- the loaders serve every sync as before
        log.warning("flashrl: SGLang in-place sync off (%s: %s)", type(e).__name__, e)
        return {}


def _probed(model: torch.nn.Module, loaded_dir: str, converter, layers) -> dict:
    from pathlib import Path

    from flashrl_tools.model_structure import meta_model
    from flashrl_tools.quant.quantizer import output_specs
    from flashrl_tools.runtime.core import loader_slots

    bf16 = {n: tuple(t.shape) for n, t in meta_model(Path(loaded_dir)).state_dict().items()}
    shapes = {}
    for name in converter.quantized:
        if name in bf16 and len(bf16[name]) == 2:
            for suffix, spec in output_specs(converter.format_of(name), bf16[name], torch.bfloat16).items():
                shapes[name.removesuffix(".weight") + "." + suffix] = tuple(spec.shape)
    with loaders_back(layers):
        slots, slow = loader_slots.probe(model, model.load_weights, shapes)
    if slow:
        reasons = sorted(set(slow.values()))
        log.info("flashrl: SGLang loaders for %d tensors (%s)", len(slow), "; ".join(reasons[:3]))
    return slots


def attach(model: torch.nn.Module, loaded_dir: str, rc, loaded: LoadedParams, rank: int = 0) -> SyncSession:
    def writer_for(converter) -> LoaderWriter:
        layers = loaded.of(model)
        if converter.served is not None and not layers:
            raise FlashRLError(f"flashrl: SGLang loaded {loaded_dir} without the compressed-tensors layers this "
                               "runtime writes into", loaded_dir,
                               "check that SGLang reads the checkpoint's quantization_config")
        log.info("flashrl: SGLang weight sync for %d quantized layers (%s)", len(layers),
                 converter.served.value if converter.served else "bf16")
        return LoaderWriter(model, layers, _slots(model, loaded_dir, converter, layers), loaded.marlin_of(model))

    session = open_session(model, loaded_dir, rc, writer_for, "sglang", rank)
    model.load_weights = session.load_weights
    return session


_loaded: list[LoadedParams] = []


def loaded() -> LoadedParams:
    """This process's LoadedParams (one per scheduler process)."""
    if not _loaded:
        _loaded.append(LoadedParams())
    return _loaded[0]


def around_processing(original, method, layer, *args, **kwargs):
    """AROUND a compressed-tensors method's `process_weights_after_loading` (linear and MoE)."""
    return loaded().around_processing(original, method, layer, *args, **kwargs)


def check_sglang_version(runner, session, rc, path) -> None:
    """On an SGLang version not declared tested: the start-up self-check (core/versions.py) with the scheduler's
    hooks (SGLang's registry wraps the targets: they must exist) and the weight digest."""
    from flashrl_tools.runtime.core import versions
    from flashrl_tools.runtime.core.digest import model_digest
    from flashrl_tools.runtime.core.hooks import declared, missing
    from flashrl_tools.runtime.sglang.capabilities import CAPABILITIES, sglang_version

    fmt = getattr(getattr(runner, "server_args", None), "load_format", None)
    dummy = str(getattr(fmt, "value", fmt)).lower() == "dummy"
    scheduler = [h for h in declared("sglang") if h.process == "scheduler"]
    versions.check_at_start(CAPABILITIES.engine, sglang_version(), CAPABILITIES.tested, session, rc, path, dummy,
                            lambda: missing(scheduler, registry=True) if scheduler else ["the SGLang hook table"],
                            lambda: model_digest(runner.model, "sglang"))


def runner_loaded(result, runner, *args, **kwargs):
    """AFTER `ModelRunner.load_model` (scheduler): the sync session, and the FP8 KV scales' state."""
    from flashrl_tools.runtime.core import process
    from flashrl_tools.runtime.core.kv_math import has_kv_scales
    from flashrl_tools.runtime.core.kv_state import KVScaleState
    from flashrl_tools.runtime.sglang.kv_scales import RadixAttentionScales, uses_fp8_kv
    if getattr(runner, "is_draft_worker", False):
        return result
    path = runner.model_config.model_path
    try:
        session = attach(runner.model, path, process.config(), loaded(), tp_rank(runner))
        check_sglang_version(runner, session, process.config(), path)
        if uses_fp8_kv(runner):
            from flashrl_tools.runtime.sglang import decode_attn

            decode_attn.choose_for_sglang(runner)
            process.kv_states().append(KVScaleState(RadixAttentionScales(runner), session, has_kv_scales(path)))
    except FlashRLError as e:
        raise RuntimeError(e.message) from None
    process.sessions().append(session)
    return result
