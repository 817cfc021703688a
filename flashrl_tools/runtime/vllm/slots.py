"""Where each checkpoint tensor lands in a layer's processed storage: shard geometry by vLLM's
weight-loader rules (linear.py QKVParallelLinear / MergedColumnParallelLinear / RowParallelLinear,
RoutedExperts `_load_w13` / `_load_w2`), per tensor-parallel rank. Checked against vLLM's own
loaders on bare layer objects (tests/test_inplace_sync.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


class NotFast(Exception):
    pass


def layer_slots(layer, path: str, members: list[tuple[str, int | None]], expected: set[str],
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
        raise NotFast(f"{type(layer).__name__} is not a linear layer the fast path knows")
    if sorted(geometry, key=str) != sorted((i for _, i in members), key=str):
        raise NotFast("not every part of the fused layer is an 8-bit checkpoint tensor")
    rows = max(d.stop for d, _, _ in geometry.values())
    if layer.weight.t().shape[0] < rows or (not staged and layer.weight_scale.numel() < rows):
        raise NotFast("engine storage smaller than the layer's outputs")
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
            raise NotFast("the checkpoint's biases do not match the layer's")
        if has_bias:  # a row-parallel layer's bias is whole on every rank
            slots[f"{module}.bias"] = Slot(layer, f"{path}.bias", "bias", dst,
                                           src_rows if src_cols is None else slice(None))
    return slots


def moe_slots(layer, path: str, prefix: str, names: set[str]) -> dict[str, Slot]:
    """Every expert's slots, by vLLM's RoutedExperts loader rules (`_load_w13`, `_load_w2`,
    `_load_per_channel_weight_scale`): gate (w1) and up (w3) rows of this rank at rows [0, I) and
    [I, 2I) of w13; down (w2) columns of this rank, its channel scale whole."""
    config = layer.moe_config
    parallel = config.moe_parallel_config
    experts, two_i, hidden = layer.w13_weight.shape
    inter = two_i // 2
    if getattr(parallel, "ep_size", 1) > 1 or getattr(parallel, "use_ep", False):
        raise NotFast("expert-parallel (experts are not all on this rank)")
    if getattr(config, "num_logical_experts", experts) != experts or layer.global_num_experts != experts:
        raise NotFast("redundant or non-local experts")
    if tuple(layer.w2_weight.shape) != (experts, hidden, inter) \
            or tuple(layer.w13_weight_scale.shape) != (experts, two_i, 1) \
            or tuple(layer.w2_weight_scale.shape) != (experts, hidden, 1):
        raise NotFast("expert storage of an unexpected shape")
    rank = config.tp_rank
    mine = slice(rank * inter, (rank + 1) * inter)
    projs = {layer.ckpt_gate_proj_name: ("w13", slice(0, inter), mine, None, hidden),
             layer.ckpt_up_proj_name: ("w13", slice(inter, two_i), mine, None, hidden),
             layer.ckpt_down_proj_name: ("w2", slice(0, hidden), slice(None), mine, inter)}
    if names != {f"{prefix}.{e}.{p}.weight" for e in range(experts) for p in projs}:
        raise NotFast("not every expert weight of the layer is an 8-bit checkpoint tensor")
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
