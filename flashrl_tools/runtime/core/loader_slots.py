"""In-place sync by probing the engine's own loaders, for every engine (issue 45; SGLang uses it: its model's
`load_weights` per sync -- Python dispatch per tensor: name mapping, shard ids, TP narrowing, dtype checks -- made
an INT8 sync, two tensors per linear, cost more than a BF16 one). The converted 8-bit weights and scales are
copied straight into the storage the kernels read, at the rows and columns the loaders put them.

Where each tensor goes is learned from the loaders themselves, so nothing here encodes an engine's layouts:
1. At start (`probe`), per parent module of the quantized linears (a `self_attn`, an `mlp`), every Parameter
   under it is swapped for a float32 probe filled with -1 and the model's own `load_weights` receives one
   checkpoint tensor (weight or scale) holding its own row numbers, then its column numbers. What the probes
   read after each call is, per tensor, a rectangle: destination rows x cols of one Parameter <- source rows x
   cols (fused shards and tensor-parallel narrowing included). A tensor whose writes are no such rectangle
   keeps the loaders. The real storage is never touched: the probes replace it for the call.
2. The first sync goes through the loaders; after each batch, every slotted tensor is compared bit for bit with
   what its slot holds. All equal at the sync's end: later syncs copy through the slots; one differs: the
   loaders for good (logged). `FLASHRL_INPLACE_SYNC=0` keeps the loaders."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("flashrl_tools.runtime")
_PROBE_ELEMENTS = 1 << 30  # a parent module's parameters probed at once (4 GiB of float32)


class NoSlot(Exception):
    pass


@dataclass(frozen=True)
class ProbedSlot:
    """dst[rows, cols] of one Parameter's storage <- src[src_rows, src_cols] (both seen as 2-D)."""

    param: torch.nn.Parameter
    rows: slice
    cols: slice
    src_rows: slice
    src_cols: slice

    def regions(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dst, src = _as_2d(self.param.data), _as_2d(tensor)
        if src.shape[0] < self.src_rows.stop or src.shape[1] < self.src_cols.stop:
            raise ValueError(f"a tensor of shape {tuple(tensor.shape)} is smaller than the rows "
                             f"{self.src_rows.start}:{self.src_rows.stop} the engine loads from it")
        return dst[self.rows, self.cols], src[self.src_rows, self.src_cols]

    def write(self, tensor: torch.Tensor) -> None:
        dst, src = self.regions(tensor)
        with torch.no_grad():
            dst.copy_(src)

    def holds(self, tensor: torch.Tensor) -> bool:
        """The slot holds what copying `tensor` would write (bit for bit)."""
        dst, src = self.regions(tensor)
        src = src.to(dst.dtype)
        if dst.element_size() == 1:  # FP8: compared as bytes (no eq kernel for float8 everywhere)
            dst, src = dst.view(torch.uint8), src.view(torch.uint8)
        return torch.equal(dst, src)


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, 1) if t.dim() < 2 else t


def probe(model: torch.nn.Module, load_weights, shapes: dict[str, tuple[int, ...]]
          ) -> tuple[dict[str, ProbedSlot], dict[str, str]]:
    """Slots for the checkpoint tensors `shapes` (name -> shape as the trainer's sync converts it), learned by
    running `load_weights` (the model's own, with the loaded Parameters in place) on index probes; and, per
    tensor that keeps the loaders, why."""
    modules = dict(model.named_modules())
    groups: dict[str, list[str]] = {}
    slow: dict[str, str] = {}
    for name in sorted(shapes):
        parent = name.rsplit(".", 2)[0] if name.count(".") >= 2 else ""
        if parent in modules:
            groups.setdefault(parent, []).append(name)
        else:
            slow[name] = "no parent module in the engine's model"
    slots: dict[str, ProbedSlot] = {}
    for parent, names in groups.items():
        params = [p for _, p in modules[parent].named_parameters()]
        if sum(p.numel() for p in params) > _PROBE_ELEMENTS:
            slow.update(dict.fromkeys(names, f"{parent or 'the model'} is too large to probe"))
            continue
        saved = [p.data for p in params]
        try:
            for p, d in zip(params, saved):
                p.data = torch.empty(d.shape, dtype=torch.float32, device=d.device)
            for name in names:
                try:
                    slots[name] = _probe_one(name, shapes[name], load_weights, params)
                except NoSlot as e:
                    slow[name] = str(e)
                except Exception as e:  # noqa: BLE001 -- a loader that cannot take the probe: keep the loaders
                    slow[name] = f"the loader refused an index probe ({type(e).__name__}: {e})"
        finally:
            for p, d in zip(params, saved):
                p.data = d
    if any(p.is_cuda for p in model.parameters()):
        torch.cuda.empty_cache()  # the probes' memory: SGLang sizes its KV pool from the free memory after this
    return slots, slow


def _probe_one(name: str, shape: tuple[int, ...], load_weights, params: list[torch.nn.Parameter]) -> ProbedSlot:
    rows, cols = _as_2d(torch.empty(shape, device="meta")).shape
    if max(rows, cols) >= 1 << 24:
        raise NoSlot("a dimension past float32's exact integers")
    seen = []
    for axis in (0, 1):
        for p in params:
            p.data.fill_(-1.0)
        device = params[0].data.device
        index = torch.arange(rows if axis == 0 else cols, dtype=torch.float32, device=device)
        src = (index[:, None].expand(rows, cols) if axis == 0 else index[None, :].expand(rows, cols)).contiguous()
        load_weights([(name, src.reshape(shape))])
        written = [p for p in params if bool((p.data != -1.0).any())]
        if len(written) != 1:
            raise NoSlot(f"its loader wrote {len(written)} parameters")
        seen.append((written[0], _as_2d(written[0].data).clone()))
    (param, at_rows), (param_b, at_cols) = seen
    if param_b is not param:
        raise NoSlot("its loader wrote different parameters per probe")
    return _rectangle(at_rows, at_cols, param)


def _rectangle(at_rows: torch.Tensor, at_cols: torch.Tensor, param) -> ProbedSlot:
    """The one rectangle dst[r0:r1, c0:c1] <- src[s0:s0+n, t0:t0+m] the probes show, else NoSlot."""
    mask = at_rows != -1.0
    if not torch.equal(mask, at_cols != -1.0):
        raise NoSlot("its probes landed in different places")
    row_any, col_any = mask.any(1).nonzero().flatten(), mask.any(0).nonzero().flatten()
    r0, r1 = int(row_any[0]), int(row_any[-1]) + 1
    c0, c1 = int(col_any[0]), int(col_any[-1]) + 1
    if int(mask.sum()) != (r1 - r0) * (c1 - c0):
        raise NoSlot("its writes are not one rectangle")
    s0, t0 = int(at_rows[r0, c0]), int(at_cols[r0, c0])
    want_rows = torch.arange(s0, s0 + r1 - r0, dtype=torch.float32, device=at_rows.device)[:, None]
    want_cols = torch.arange(t0, t0 + c1 - c0, dtype=torch.float32, device=at_rows.device)[None, :]
    if not (torch.equal(at_rows[r0:r1, c0:c1], want_rows.expand(r1 - r0, c1 - c0))
            and torch.equal(at_cols[r0:r1, c0:c1], want_cols.expand(r1 - r0, c1 - c0))):
        raise NoSlot("its rows or columns are not copied in order")
    return ProbedSlot(param, slice(r0, r1), slice(c0, c1), slice(s0, s0 + r1 - r0), slice(t0, t0 + c1 - c0))
