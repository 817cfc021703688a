"""In-place fast sync (issue 16): re-quantized 8-bit weights written straight into the engine's
processed storage, for the linear and MoE layers whose processed layout is known (layouts.py), at
the rows their loaders would fill (slots.py); every other layer goes through vLLM's layerwise
reload. The routing step of a sync: `InPlacePlan.owns(name)` says which tensors are written here.

A layer is fast only if every checkpoint tensor it is loaded from maps to rows of it.
`FLASHRL_INPLACE_SYNC=0` turns the fast path off. Tensor-parallel layers take it only with
`FLASHRL_INPLACE_SYNC=tp`: their geometry is tested against vLLM's loaders on CPU and was exact on
2x H200 (TP=2, eager: dense int8 and online fp8, MoE int8); compiled TP engines and TP FP8 experts
have not run yet. Expert parallelism falls back.

vLLM internals used: linear layer classes and their TP attributes, `model.packed_modules_mapping`,
compressed-tensors scheme / kernel attributes, the layerwise reload's per-layer info
(`kernel_tensors`).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import torch

from flashrl_tools.runtime.vllm import layouts
from flashrl_tools.runtime.vllm.slots import NotFast, Slot, layer_slots, moe_slots

log = logging.getLogger("flashrl_tools.runtime")


_TP_OPT_IN = ("tensor-parallel (FLASHRL_INPLACE_SYNC=tp enables it; exact on 2 GPUs for dense int8 / fp8 and "
              "MoE int8, opt-in until more has run)")


@dataclass
class InPlacePlan:
    slots: dict[str, Slot] = field(default_factory=dict)  # checkpoint name -> slot
    layer_names: dict[int, frozenset[str]] = field(default_factory=dict)  # id(layer) -> its names
    fallback: dict[str, str] = field(default_factory=dict)  # module -> why it uses the reload
    kinds: Counter = field(default_factory=Counter)  # fast layers per layout
    staged: dict[int, tuple[int, int]] = field(default_factory=dict)  # id(layer) -> its [N, K] (online FP8)
    _written: dict[int, set[str]] = field(default_factory=dict)
    _loaded: set[str] = field(default_factory=set)
    _buffers: dict[int, torch.Tensor] = field(default_factory=dict)  # online FP8: the BF16 weight so far

    def begin(self) -> None:
        self._written, self._buffers = {}, {}

    def pop_loaded(self) -> set[str]:
        """Engine parameter names written since the last call (for load_weights' return)."""
        loaded, self._loaded = self._loaded, set()
        return loaded

    def owns(self, name: str) -> bool:
        """Whether this checkpoint tensor is written in place (else vLLM's loader takes it)."""
        return name in self.slots

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write one converted checkpoint tensor of an owned name into its layer's storage."""
        slot = self.slots[name]
        layer = slot.layer
        storage = _kernel_params(layer)[slot.attr or slot.kind]
        if slot.expert is not None:
            storage = storage[slot.expert]
        src = tensor[slot.src_rows] if slot.src_cols is None else tensor[slot.src_rows, slot.src_cols]
        rows = slot.dst.stop - slot.dst.start
        fits = {"weight": (rows, slot.cols), "staged": (rows, slot.cols), "bias": (rows,)}.get(slot.kind)
        misfit = tuple(src.shape) != fits if fits else src.numel() != rows
        if misfit:  # as vLLM's loaders assert; copy_ would broadcast a row or fill part of one
            raise ValueError(f"{name}: a tensor of shape {tuple(tensor.shape)} does not fit the engine's "
                             f"{slot.param} (rows {slot.dst.start}:{slot.dst.stop} of this rank)")
        with torch.no_grad():
            if slot.kind == "staged":  # copy_ rounds an fp32 push to BF16 as vLLM's loader does
                buffer = self._buffers.get(id(layer))
                if buffer is None:
                    dtype = getattr(layer, "orig_dtype", torch.bfloat16)
                    buffer = self._buffers[id(layer)] = torch.empty(self.staged[id(layer)], dtype=dtype,
                                                                    device=storage.device)
                buffer[slot.dst].copy_(src)
            elif slot.kind == "weight":  # rows [N(+pad), K(+pad)] of the checkpoint layout
                storage = storage.t() if slot.transposed else storage
                storage[slot.dst, :src.shape[1]].copy_(src)
            elif slot.kind == "weight_scale":
                storage.view(-1)[slot.dst].copy_(src.reshape(-1))
            else:
                storage[slot.dst].copy_(src)
        self._loaded.add(slot.param)
        written = self._written.setdefault(id(layer), set())
        written.add(name)
        if written == self.layer_names[id(layer)]:
            if id(layer) in self.staged:
                _write_online_fp8(layer, self._buffers.pop(id(layer)))
            _layer_done(layer)

    def summary(self) -> str:
        fast = sum(self.kinds.values())
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.kinds.items()))
        return (f"in-place sync for {fast} layers ({kinds or 'none'}); layerwise reload for the rest"
                + (f" ({len(self.fallback)} quantized modules: {_reasons(self.fallback)})" if self.fallback else ""))


def enabled() -> bool:
    return _setting() not in ("0", "false", "no", "off")


def _setting() -> str:
    from flashrl_tools.config.settings import settings

    return settings().inplace_sync


def build_plan(model: torch.nn.Module, quantized: set[str], expected: set[str]) -> InPlacePlan:
    """Which quantized linears of the loaded model take the fast path. `quantized`: checkpoint
    names of the 8-bit weights the converter produces; `expected`: every BF16 name of a sync."""
    plan = InPlacePlan()
    modules = dict(model.named_modules())
    quantized = quantized - _plan_moe(plan, modules, quantized)
    member_of = _packed_members(model)
    members: dict[int, list[tuple[str, int | None]]] = {}
    layers: dict[int, tuple[str, torch.nn.Module]] = {}
    for name in sorted(quantized):
        module = name.removesuffix(".weight")
        found = _engine_module(module, modules, member_of)
        if found is None:
            plan.fallback[module] = "no matching engine module"
            continue
        path, index = found
        layers[id(modules[path])] = (path, modules[path])
        members.setdefault(id(modules[path]), []).append((module, index))
    for key, (path, layer) in layers.items():
        kind = layouts.layout(layer)
        if kind is None:
            why = "layout not known for in-place writes"
        elif getattr(layer, "tp_size", 1) > 1 and _setting() != "tp":
            kind, why = None, _TP_OPT_IN
        else:
            try:
                slots = layer_slots(layer, path, members[key], expected, staged=kind == layouts.ONLINE_FP8)
            except NotFast as e:
                kind, why = None, str(e)
        if kind is None:
            for module, _ in members[key]:
                plan.fallback[module] = why
            log.debug("flashrl: %s syncs by the layerwise reload (%s)", path, why)
            continue
        plan.slots.update(slots)
        plan.layer_names[key] = frozenset(slots)
        if kind == layouts.ONLINE_FP8:
            plan.staged[key] = (max(s.dst.stop for s in slots.values()), max(s.cols for s in slots.values()))
        plan.kinds[kind] += 1
        log.debug("flashrl: %s syncs in place (%s)", path, kind)
    return plan


def online_fp8_weights(model: torch.nn.Module, expected: set[str]) -> set[str]:
    """The BF16 checkpoint weights that vLLM's online per-tensor FP8 quantizes at load (every
    linear under `quantization="fp8"` that is not skipped): the in-place candidates of a BF16
    checkpoint served with online FP8."""
    modules, member_of = dict(model.named_modules()), _packed_members(model)
    out = set()
    for name in expected:
        found = _engine_module(name.removesuffix(".weight"), modules, member_of) if name.endswith(".weight") else None
        if found is not None and type(getattr(modules[found[0]], "quant_method", None)).__name__ == layouts.ONLINE_METHOD:
            out.add(name)
    return out


def _packed_members(model: torch.nn.Module) -> dict[str, tuple[str, int]]:
    """Checkpoint module leaf -> (the fused engine module's leaf, its index): q_proj -> qkv_proj, 0."""
    return {m: (packed, i) for packed, members in (getattr(model, "packed_modules_mapping", None) or {}).items()
            for i, m in enumerate(members)}


def _engine_module(module: str, modules: dict[str, torch.nn.Module],
                   member_of: dict[str, tuple[str, int]]) -> tuple[str, int | None] | None:
    """The engine module a checkpoint module is loaded into, and its index in a fused one."""
    parent, _, leaf = module.rpartition(".")
    if module in modules:
        return module, None
    if leaf in member_of and f"{parent}.{member_of[leaf][0]}" in modules:
        return f"{parent}.{member_of[leaf][0]}", member_of[leaf][1]
    return None


def _plan_moe(plan: InPlacePlan, modules: dict[str, torch.nn.Module], quantized: set[str]) -> set[str]:
    """Plan the routed-expert layers (vLLM's RoutedExperts: `w13_weight`, `ckpt_*_proj_name`);
    returns the checkpoint names they own, fast or not."""
    owned: set[str] = set()
    by_prefix: dict[str, set[str]] = {}  # `...experts` -> its `...experts.{e}.{proj}.weight` names
    for name in quantized:
        by_prefix.setdefault(name.rsplit(".", 3)[0], set()).add(name)
    for path, layer in modules.items():
        if not (hasattr(layer, "w13_weight") and hasattr(layer, "ckpt_gate_proj_name")):
            continue
        prefix = path.removesuffix(".routed_experts")  # the checkpoint's `...mlp.experts`
        names = by_prefix.get(prefix, set())
        if not names:
            continue
        owned |= names
        kind, why = layouts.moe_layout_reason(layer)
        if kind is None:
            why = f"layout not known for in-place writes ({why})"
        elif layer.moe_config.moe_parallel_config.tp_size > 1 and _setting() != "tp":
            kind, why = None, _TP_OPT_IN
        else:
            try:
                slots = moe_slots(layer, path, prefix, names)
            except NotFast as e:
                kind, why = None, str(e)
        if kind is None:
            plan.fallback.update((n.removesuffix(".weight"), why) for n in names)
            log.debug("flashrl: %s syncs by the layerwise reload (%s)", path, why)
            continue
        plan.slots.update(slots)
        plan.layer_names[id(layer)] = frozenset(slots)
        plan.kinds[kind] += 1
        log.debug("flashrl: %s syncs in place (%s, %d expert tensors)", path, kind, len(slots))
    return owned


def _write_online_fp8(layer: torch.nn.Module, weight: torch.Tensor) -> None:
    """Quantize a staged online-FP8 layer as vLLM's processing does (the same call on the same
    BF16 tensor: bit-identical with a fresh engine by construction) into its kernel storage."""
    q, scale = _online_fp8_quant(weight)
    params = _kernel_params(layer)
    with torch.no_grad():
        params["weight"].t()[:q.shape[0], :q.shape[1]].copy_(q)
        params["weight_scale"].view(-1).copy_(scale.view(-1))


def _online_fp8_quant(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from vllm import _custom_ops as ops

    return ops.scaled_fp8_quant(weight, scale=None)


def _kernel_params(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The layer's processed parameters: put aside by the layerwise reload while it is open."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    info = get_layerwise_info(layer)
    if info.kernel_tensors is not None:
        return info.kernel_tensors[0]
    return dict(layer.named_parameters(recurse=False))


def _layer_done(layer: torch.nn.Module) -> None:
    """Every tensor of a fast layer written: put its (updated) storage back on the layer and close
    its reload entry, so the reload's finalize neither processes it nor warns about it."""
    from vllm.model_executor.model_loader.reload import layerwise

    info = layerwise.get_layerwise_info(layer)
    if info.kernel_tensors is not None:
        layerwise._place_kernel_tensors(layer, info)
    info.reset()
    if layouts.moe_layout(layer) is not None and not _moe_kernel_holds_storage(layer):
        # the MoE kernel holds its scales in a quant config built by the last processing; after a
        # layerwise reload of this layer that ran on temporary tensors: rebuild it around the
        # storage just written (an identity on the tensors for these layouts). Only then: a
        # rebuild also makes new kernel objects (CUTLASS: per-expert stride tensors) whose old
        # buffers captured CUDA graphs still read (illegal memory access, H100, vLLM 0.26).
        layer.quant_method.process_weights_after_loading(layer)


def _moe_kernel_holds_storage(layer: torch.nn.Module) -> bool:
    """Whether the layer's MoE quant config reads its scales from the layer's own storage."""
    config = getattr(layer.quant_method, "moe_quant_config", None)
    if config is None:
        return False
    for ours, theirs in (("w13_weight_scale", "_w1"), ("w2_weight_scale", "_w2")):
        scale, held = getattr(layer, ours), getattr(getattr(config, theirs, None), "scale", None)
        if not isinstance(held, torch.Tensor) or held.data_ptr() != scale.data_ptr() or held.shape != scale.shape:
            return False
    return True


def _reasons(fallback: dict[str, str]) -> str:
    return "; ".join(f"{n} {why}" for why, n in Counter(fallback.values()).most_common())
