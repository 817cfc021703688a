"""Weight sync, SGLang side. SGLang's compressed-tensors INT8 / FP8 per-channel layers replace their
`weight` by a transposed view and `weight_scale` by a new Parameter over the same storage after
loading, which drops the `weight_loader` SGLang's own `load_weights` needs: a second load crashes,
and SGLang never re-quantizes pushed BF16. So, per quantized layer, `LoadedParams` keeps the
Parameters SGLang loaded into (with their loaders) when `process_weights_after_loading` replaced them
by views of the same storage, and refuses the engine at start when a layer's processed tensors are
not such views (a layout this runtime cannot write). A sync converts the trainer's tensors to the
checkpoint's format (runtime/convert.py), puts the loaded Parameters back for the length of one call
to the model's own `load_weights` (its name mapping, fused shards and TP slicing), which writes into
the storage the kernels read, then restores the processed ones. Completion and refusal are the
engine-independent `SyncState`."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

import torch

from flashrl_tools.errors import FlashRLError
from flashrl_tools.runtime.convert import WeightConverter
from flashrl_tools.runtime.sync_state import SyncState

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

    def around_processing(self, original, method, layer, *args, **kwargs):
        """AROUND hook of a quant method's `process_weights_after_loading(layer)`."""
        before = dict(layer._parameters)
        result = original(method, layer, *args, **kwargs)
        replaced = {}
        for name, loaded in before.items():
            now = layer._parameters.get(name)
            if loaded is None or now is loaded:
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


class WeightSync:
    """Replaces `model.load_weights` of a model SGLang loaded."""

    def __init__(self, model: torch.nn.Module, converter: WeightConverter, layers):
        self.model, self.converter, self.layers = model, converter, layers
        self.state = SyncState(frozenset(converter.expected))
        self.original_load_weights = model.load_weights
        self.ignored: set[str] = set()

    def load_weights(self, weights, *args, **kwargs):
        batch: list[tuple[str, torch.Tensor]] = []
        size = 0
        for group in self.converter.checkpoint_groups(weights, self.ignored):
            names = [name for name, _ in group]
            if self.state.must_begin(names):
                self._flush(batch, args, kwargs)
                batch, size = [], 0
                if self.state.active and not self.state.failed:
                    log.warning("flashrl: %s received twice; starting the weight sync over", names[0])
                self.state.begin()
            self.state.receive(names)
            for name, tensor in self.converter.convert_group(group):
                batch.append((name, tensor))
                size += tensor.numel() * tensor.element_size()
            if size >= _FLUSH_BYTES:
                self._flush(batch, args, kwargs)
                batch, size = [], 0
        self._flush(batch, args, kwargs)

    def _flush(self, batch, args, kwargs) -> None:
        if batch:
            try:
                with loaders_back(self.layers):
                    self.original_load_weights(batch, *args, **kwargs)
            except Exception as e:
                self.state.fail(f"{type(e).__name__}: {e}")
                raise
        if self.state.active and not self.state.failed and self.state.done():
            self.state.complete()
            log.info("flashrl: weight sync %d complete (%d tensors)", self.state.completed, len(self.state.seen))

    def status(self) -> str | None:
        return self.state.status()

    def discard(self, reason: str) -> None:
        self.state.discard(reason)
        self.converter.drop_device_cache()


def attach(model: torch.nn.Module, loaded_dir: str, rc, loaded: LoadedParams) -> WeightSync:
    converter = WeightConverter.for_checkpoint(rc.fn, Path(loaded_dir), rc.entry.profile)
    layers = loaded.of(model)
    if converter.served is not None and not layers:
        raise FlashRLError(f"flashrl: SGLang loaded {loaded_dir} without the compressed-tensors layers this runtime "
                           "writes into", loaded_dir, "check that SGLang reads the checkpoint's quantization_config")
    sync = WeightSync(model, converter, layers)
    model.load_weights = sync.load_weights
    log.info("flashrl: SGLang weight sync for %d quantized layers (%s)", len(layers),
             converter.served.value if converter.served else "bf16")
    return sync
