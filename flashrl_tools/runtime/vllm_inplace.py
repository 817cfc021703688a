"""In-place fast sync (issue 16): re-quantized 8-bit weights written straight into the engine's
processed storage, for linear and MoE layers whose processed layout is known; every other layer
goes through vLLM's layerwise reload (restore the checkpoint layout, load, `process_weights_after_
loading`, copy into the original storage), as before.

Known layouts (vLLM 0.26 on CUDA, read from its kernels; DEVELOPERS.md "In-place fast sync"):
- compressed-tensors W8A8 INT8, channel weight scales, dynamic symmetric activations, Cutlass or
  Triton kernel: `weight` = `weight.t()` of the [N, K] checkpoint storage; `weight_scale` [N, 1]
  float32 as loaded.
- compressed-tensors W8A8 FP8, channel weight scales, dynamic activations, Cutlass kernel: the
  same, with N and K zero-padded to multiples of 16 (scale padded with 1.0) when they are not.
- compressed-tensors W8A8 INT8 MoE experts (TRITON backend) and W8A8 FP8 channel MoE experts
  (VLLM_CUTLASS or TRITON backend): `w13_weight` [E, 2I, H] (gate rows, then up), `w2_weight`
  [E, H, I] and the [E, N, 1] channel scales as loaded; per (expert, shard).
- vLLM's online per-tensor FP8 (`FLASHRL_CONFIG=fp8` on a dense model: `Fp8PerTensorOnlineLinear
  Method`, Cutlass kernel): the layer's BF16 weight is quantized whole with one scale
  (`ops.scaled_fp8_quant(weight)`, then `weight.t()`, padded as above), so its shards are staged
  in a BF16 buffer of the layer's shape and quantized with that same vLLM call once all are in.
Anything else (FP8 tensor / block checkpoints, per-tensor FP8 experts, expert parallelism,
unknown kernels, CPU) falls back. A layer is fast only if every checkpoint tensor it is loaded
from maps to rows of it. `FLASHRL_INPLACE_SYNC=0` turns the fast path off. Tensor-parallel
layers take it only with `FLASHRL_INPLACE_SYNC=tp`: their shard geometry is tested against
vLLM's loaders on CPU (tests/test_inplace_sync.py) and was exact on 2x H200 (TP=2, eager: dense
int8 and online fp8, MoE int8), but compiled TP engines and TP FP8 experts have not run yet.

vLLM internals used (this file and vllm_compat.py are the only ones that touch vLLM): linear
layer classes and their TP attributes, `model.packed_modules_mapping`, compressed-tensors
scheme / kernel attributes, and the layerwise reload's per-layer info (`kernel_tensors`).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field

import torch

log = logging.getLogger("flashrl_tools.runtime")

# kernel classes whose process_weights_after_loading leaves weight.t() (+ padding) and the
# channel scale as loaded (vLLM 0.26: kernels/linear/scaled_mm/cutlass.py, triton.py)
_INT8_KERNELS = frozenset({"CutlassInt8ScaledMMLinearKernel", "TritonInt8ScaledMMLinearKernel"})
_FP8_KERNELS = frozenset({"CutlassFP8ScaledMMLinearKernel"})
ONLINE_FP8 = "OnlineFp8PerTensor"  # the layout name of vLLM's online per-tensor FP8 linears
_ONLINE_METHOD = "Fp8PerTensorOnlineLinearMethod"

_TP_OPT_IN = ("tensor-parallel (FLASHRL_INPLACE_SYNC=tp enables it; exact on 2 GPUs for dense int8 / fp8 and "
              "MoE int8, opt-in until more has run)")


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor lands: rows `dst` of the layer's [N, K] storage take rows
    `src_rows` (and, for a row-parallel layer, columns `src_cols`) of the full tensor."""
    layer: torch.nn.Module
    param: str  # the engine's parameter name (what model.load_weights reports as loaded)
    kind: str  # "weight", "weight_scale", "bias" or "staged" (a BF16 shard of an online-FP8 layer)
    dst: slice
    src_rows: slice
    src_cols: slice | None = None
    cols: int = 0  # the layer's input width on this rank (the weight's K)
    attr: str = ""  # the layer's tensor (default: `kind`); MoE: w13_weight, w2_weight_scale, ...
    expert: int | None = None  # MoE: the local expert index into the [E, ...] storage
    transposed: bool = True  # the weight storage is [K, N] (dense kernels) rather than [N, K]


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

    def write(self, name: str, tensor: torch.Tensor) -> bool:
        """Write one converted checkpoint tensor in place; False when it is not ours to write."""
        slot = self.slots.get(name)
        if slot is None:
            return False
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
        return True

    def summary(self) -> str:
        fast = sum(self.kinds.values())
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.kinds.items()))
        return (f"in-place sync for {fast} layers ({kinds or 'none'}); layerwise reload for the rest"
                + (f" ({len(self.fallback)} quantized modules: {_reasons(self.fallback)})" if self.fallback else ""))


def enabled() -> bool:
    return _setting() not in ("0", "false", "no", "off")


def _setting() -> str:
    return os.environ.get("FLASHRL_INPLACE_SYNC", "1").strip().lower()


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
        kind = layout(layer)
        if kind is None:
            why = "layout not known for in-place writes"
        elif getattr(layer, "tp_size", 1) > 1 and _setting() != "tp":
            kind, why = None, _TP_OPT_IN
        else:
            try:
                slots = _layer_slots(layer, path, members[key], expected, staged=kind == ONLINE_FP8)
            except _NotFast as e:
                kind, why = None, str(e)
        if kind is None:
            for module, _ in members[key]:
                plan.fallback[module] = why
            log.debug("flashrl: %s syncs by the layerwise reload (%s)", path, why)
            continue
        plan.slots.update(slots)
        plan.layer_names[key] = frozenset(slots)
        if kind == ONLINE_FP8:
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
        if found is not None and type(getattr(modules[found[0]], "quant_method", None)).__name__ == _ONLINE_METHOD:
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


class _NotFast(Exception):
    pass


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
        kind, why = _moe_layout(layer)
        if kind is None:
            why = f"layout not known for in-place writes ({why})"
        elif layer.moe_config.moe_parallel_config.tp_size > 1 and _setting() != "tp":
            kind, why = None, _TP_OPT_IN
        else:
            try:
                slots = _moe_slots(layer, path, prefix, names)
            except _NotFast as e:
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


def moe_layout(layer: torch.nn.Module) -> str | None:
    """The known processed layout of a loaded routed-expert layer, or None. vLLM 0.26 on CUDA
    keeps the experts as loaded -- w13_weight [E, 2I, H] (w1 rows, then w3), w2_weight [E, H, I]
    and [E, N, 1] float32 channel scales -- for compressed-tensors W8A8 INT8 on the TRITON backend
    (`convert_to_int8_moe_kernel_format` returns them: fused_moe/oracle/int8.py) and for W8A8 FP8
    with channel weights and dynamic per-token activations on the VLLM_CUTLASS or TRITON backends
    (`convert_to_fp8_moe_kernel_format` leaves them; no w1/w3 re-quantization, which per-tensor
    FP8 does: fused_moe/oracle/fp8.py, compressed_tensors_moe_w8a8_fp8.py)."""
    return _moe_layout(layer)[0]


def _moe_layout(layer: torch.nn.Module) -> tuple[str | None, str]:
    """(layout, "") or (None, why not)."""
    method = getattr(layer, "quant_method", None)
    kind = _MOE_METHODS.get(type(method).__name__)
    if kind is None:
        return None, f"{type(method).__name__} experts"
    if not torch.cuda.is_available() or getattr(torch.version, "hip", None):
        return None, "not CUDA"
    backend_attr, backends, dtype = kind
    backend = getattr(method, backend_attr, None)
    backend = getattr(backend, "value", backend)
    if backend not in backends:
        return None, f"{type(method).__name__} on the {backend} backend"
    if dtype == torch.float8_e4m3fn:
        strategy = getattr(getattr(method, "weight_quant", None), "strategy", None)
        if getattr(strategy, "value", strategy) != "channel" or getattr(method, "static_input_scales", True) \
                or getattr(method, "block_quant", True):
            return None, f"FP8 experts with {getattr(strategy, 'value', strategy)} weight scales"
    if not getattr(layer.moe_config, "is_act_and_mul", False):
        return None, "experts without a gated activation"
    tensors = dict(layer.named_parameters(recurse=False))
    if set(tensors) != _MOE_TENSORS:
        return None, "expert tensors other than w13/w2 and their scales"
    for name, t in tensors.items():
        want = torch.float32 if name.endswith("_scale") else dtype
        if t.dtype != want or t.dim() != 3 or not t.is_contiguous():
            return None, f"{name} stored as {t.dtype} {tuple(t.shape)}"
    return f"{backend.title().replace('_', '')}{'Int8' if dtype == torch.int8 else 'Fp8'}MoE", ""


# quant method -> (its backend attribute, backends that keep the loaded layout, weight dtype)
_MOE_METHODS = {"CompressedTensorsW8A8Int8MoEMethod": ("int8_backend", frozenset({"TRITON"}), torch.int8),
                "CompressedTensorsW8A8Fp8MoEMethod": ("fp8_backend", frozenset({"TRITON", "VLLM_CUTLASS"}),
                                                      torch.float8_e4m3fn)}
_MOE_TENSORS = frozenset({"w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"})


def _moe_slots(layer, path: str, prefix: str, names: set[str]) -> dict[str, Slot]:
    """Every expert's slots, by vLLM's RoutedExperts loader rules (`_load_w13`, `_load_w2`,
    `_load_per_channel_weight_scale`): gate (w1) and up (w3) rows of this rank at rows [0, I) and
    [I, 2I) of w13; down (w2) columns of this rank, its channel scale whole."""
    config = layer.moe_config
    parallel = config.moe_parallel_config
    experts, two_i, hidden = layer.w13_weight.shape
    inter = two_i // 2
    if getattr(parallel, "ep_size", 1) > 1 or getattr(parallel, "use_ep", False):
        raise _NotFast("expert-parallel (experts are not all on this rank)")
    if getattr(config, "num_logical_experts", experts) != experts or layer.global_num_experts != experts:
        raise _NotFast("redundant or non-local experts")
    if tuple(layer.w2_weight.shape) != (experts, hidden, inter) \
            or tuple(layer.w13_weight_scale.shape) != (experts, two_i, 1) \
            or tuple(layer.w2_weight_scale.shape) != (experts, hidden, 1):
        raise _NotFast("expert storage of an unexpected shape")
    rank = config.tp_rank
    mine = slice(rank * inter, (rank + 1) * inter)
    projs = {layer.ckpt_gate_proj_name: ("w13", slice(0, inter), mine, None, hidden),
             layer.ckpt_up_proj_name: ("w13", slice(inter, two_i), mine, None, hidden),
             layer.ckpt_down_proj_name: ("w2", slice(0, hidden), slice(None), mine, inter)}
    if names != {f"{prefix}.{e}.{p}.weight" for e in range(experts) for p in projs}:
        raise _NotFast("not every expert weight of the layer is an 8-bit checkpoint tensor")
    slots = {}
    for e in range(experts):
        for proj, (stem, dst, rows, cols, width) in projs.items():
            name = f"{prefix}.{e}.{proj}"
            slots[f"{name}.weight"] = Slot(layer, f"{path}.{stem}_weight", "weight", dst, rows, cols, width,
                                           f"{stem}_weight", e, transposed=False)
            slots[f"{name}.weight_scale"] = Slot(layer, f"{path}.{stem}_weight_scale", "weight_scale", dst,
                                                 rows if stem == "w13" else slice(None), None, 0,
                                                 f"{stem}_weight_scale", e)
    return slots


def layout(layer: torch.nn.Module) -> str | None:
    """The known processed layout of a loaded layer, or None."""
    method = type(getattr(layer, "quant_method", None)).__name__
    if method not in ("CompressedTensorsLinearMethod", _ONLINE_METHOD):
        return None
    if not torch.cuda.is_available() or getattr(torch.version, "hip", None):
        return None  # ROCm rescales FP8 (fnuz); CPU kernels prepack
    online = method == _ONLINE_METHOD
    kernel, dtype = _online_fp8_kernel(layer) if online else _compressed_tensors_kernel(layer)
    if kernel is None or not _stored_as(layer, dtype, one_scale=online):
        return None
    return ONLINE_FP8 if online else type(kernel).__name__


def _compressed_tensors_kernel(layer: torch.nn.Module) -> tuple[object | None, torch.dtype | None]:
    """A compressed-tensors W8A8 linear with channel weight scales and dynamic activations on a
    kernel whose layout is known: (kernel, weight dtype), else (None, None)."""
    scheme = getattr(layer, "scheme", None)
    strategy = getattr(scheme, "strategy", None)
    if scheme is None or getattr(strategy, "value", strategy) != "channel" \
            or getattr(scheme, "is_static_input_scheme", True):
        return None, None
    scheme_name = type(scheme).__name__
    if scheme_name == "CompressedTensorsW8A8Int8":
        kernel = getattr(scheme, "kernel", None)
        if getattr(scheme, "input_symmetric", False) and type(kernel).__name__ in _INT8_KERNELS:
            return kernel, torch.int8
    elif scheme_name == "CompressedTensorsW8A8Fp8":
        kernel = getattr(scheme, "fp8_linear", None)
        if type(kernel).__name__ in _FP8_KERNELS:
            return kernel, torch.float8_e4m3fn
    return None, None


def _online_fp8_kernel(layer: torch.nn.Module) -> tuple[object | None, torch.dtype | None]:
    """vLLM 0.26's online per-tensor FP8 linear (quantization/online/fp8.py): `process_weights_
    after_loading` = `ops.scaled_fp8_quant(weight)` of the whole [N, K] BF16 weight (one scale for
    all shards of a fused layer), `weight` = that `.t()`, `weight_scale` [1] float32, then the
    Cutlass FP8 kernel's padding of N and K to multiples of 16 (the scale is not padded)."""
    if hasattr(layer.quant_method, "get_weight_for_quantization"):
        return None, None  # later vLLM (0.32): scale from a TP-wide amax / a requantization source
    kernel = getattr(layer.quant_method, "fp8_linear", None)
    return (kernel, torch.float8_e4m3fn) if type(kernel).__name__ in _FP8_KERNELS else (None, None)


def _stored_as(layer: torch.nn.Module, dtype: torch.dtype, one_scale: bool) -> bool:
    """weight = the .t() view of an [N(+pad), K(+pad)] `dtype` storage, float32 weight_scale
    ([N(+pad), 1] channel scales, or one scale), nothing but those and a bias."""
    weight, scale = getattr(layer, "weight", None), getattr(layer, "weight_scale", None)
    if weight is None or scale is None or weight.dim() != 2 or weight.dtype != dtype \
            or not weight.t().is_contiguous() or scale.dtype != torch.float32 or not scale.is_contiguous() \
            or (one_scale and scale.numel() != 1):
        return False
    return not {n for n, _ in layer.named_parameters(recurse=False)} - {"weight", "weight_scale", "bias"}


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


def _layer_slots(layer, path: str, members: list[tuple[str, int | None]], expected: set[str],
                 staged: bool = False) -> dict[str, Slot]:
    """The slots of every checkpoint tensor a layer is loaded from (vLLM's weight-loader rules:
    linear.py QKVParallelLinear / MergedColumnParallelLinear / RowParallelLinear). `staged`: BF16
    weights of an online-FP8 layer (no scale tensors; they go to a staging buffer)."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )

    rank = getattr(layer, "tp_rank", 0)
    geometry: dict[int | None, tuple[slice, slice, slice | None]] = {}  # member index -> dst, rows, cols
    if isinstance(layer, QKVParallelLinear):
        sizes = [layer.num_heads * layer.head_size, layer.num_kv_heads * layer.head_size,
                 layer.num_kv_heads * layer.v_head_size]
        for i, size in enumerate(sizes):
            src = rank if i == 0 else rank // layer.num_kv_head_replicas
            geometry[i] = (slice(sum(sizes[:i]), sum(sizes[:i + 1])), slice(src * size, (src + 1) * size), None)
    elif isinstance(layer, MergedColumnParallelLinear):
        sizes = [s // layer.tp_size for s in layer.output_sizes]
        for i, size in enumerate(sizes):
            geometry[i] = (slice(sum(sizes[:i]), sum(sizes[:i + 1])), slice(rank * size, (rank + 1) * size), None)
    elif isinstance(layer, ColumnParallelLinear):
        size = layer.output_size_per_partition
        geometry[None] = (slice(0, size), slice(rank * size, (rank + 1) * size), None)
    elif isinstance(layer, RowParallelLinear):
        size = layer.input_size_per_partition
        geometry[None] = (slice(0, layer.output_size_per_partition), slice(None), slice(rank * size, (rank + 1) * size))
    elif isinstance(layer, ReplicatedLinear):
        geometry[None] = (slice(0, layer.output_size), slice(None), None)
    else:
        raise _NotFast(f"{type(layer).__name__} is not a linear layer the fast path knows")
    if sorted(geometry, key=str) != sorted((i for _, i in members), key=str):
        raise _NotFast("not every part of the fused layer is an 8-bit checkpoint tensor")
    rows = max(d.stop for d, _, _ in geometry.values())
    if layer.weight.t().shape[0] < rows or (not staged and layer.weight_scale.numel() < rows):
        raise _NotFast("engine storage smaller than the layer's outputs")
    slots = {}
    cols = getattr(layer, "input_size_per_partition", None) or layer.input_size
    has_bias = getattr(layer, "bias", None) is not None
    for module, index in members:
        dst, src_rows, src_cols = geometry[index]
        slots[f"{module}.weight"] = Slot(layer, f"{path}.weight", "staged" if staged else "weight", dst, src_rows,
                                         src_cols, cols, attr="weight")
        if not staged:
            slots[f"{module}.weight_scale"] = Slot(layer, f"{path}.weight_scale", "weight_scale", dst, src_rows)
        if has_bias != (f"{module}.bias" in expected):
            raise _NotFast("the checkpoint's biases do not match the layer's")
        if has_bias:  # a row-parallel layer's bias is whole on every rank
            slots[f"{module}.bias"] = Slot(layer, f"{path}.bias", "bias", dst,
                                           src_rows if src_cols is None else slice(None))
    return slots


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
    if moe_layout(layer) is not None and not _moe_kernel_holds_storage(layer):
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
