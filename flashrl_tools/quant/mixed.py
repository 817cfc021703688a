"""Mixed precision: which linear weights stay in BF16 (`keep_bf16`, `first_layers_bf16`,
`last_layers_bf16`) and which an 8-bit config serves in 4 bits (`w4a16_layers`). One function each
decides it for quantize, profile, setup, verify, tune and the runtime.

vLLM fuses q/k/v (`qkv_proj`) and gate/up (`gate_up_proj`; Mixtral w1/w3) into one layer that
must have one scheme, so keeping one member keeps its fused partners (a "unit"). A MoE layer's
experts are one fused module too; keeping experts in BF16 is refused (not supported by this
toolkit's vLLM path), attention layers of MoE models can be kept.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass

from flashrl_tools.errors import FlashRLError

# leaf names vLLM fuses into one layer, and the fused layer's name
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
         "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "w1": "w13", "w3": "w13"}
_LAYER = re.compile(r"\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.\d+\.")


@dataclass(frozen=True)
class KeepSpec:
    patterns: tuple[str, ...] = ()  # fnmatch globs on module names ("model.layers.0.mlp.down_proj", "*.o_proj")
    first_layers: int = 0
    last_layers: int = 0
    four_bit: tuple[str, ...] = ()  # globs of the modules an 8-bit config serves W4A16 (`w4a16_layers`)

    def __bool__(self) -> bool:
        return bool(self.patterns or self.first_layers or self.last_layers or self.four_bit)

    @classmethod
    def of(cls, entry) -> KeepSpec:
        """From a config entry (RolloutConfig) or None."""
        if entry is None:
            return cls()
        return cls(tuple(entry.keep_bf16), entry.first_layers_bf16, entry.last_layers_bf16, tuple(entry.w4a16_layers))

    def fingerprint(self) -> str:
        if not self:
            return ""
        return (f"keep={list(self.patterns)}:first={self.first_layers}:last={self.last_layers}"
                + (f":w4a16={list(self.four_bit)}" if self.four_bit else ""))

    def cli_args(self) -> list[str]:
        args = [a for p in self.patterns for a in ("--keep-bf16", p)]
        if self.first_layers:
            args += ["--first-layers-bf16", str(self.first_layers)]
        if self.last_layers:
            args += ["--last-layers-bf16", str(self.last_layers)]
        return args + [a for p in self.four_bit for a in ("--w4a16-layers", p)]


def parse_keep_args(args: list[str]) -> KeepSpec:
    """The inverse of `KeepSpec.cli_args` (for child processes)."""
    patterns, first, last, four = [], 0, 0, []
    for flag, value in zip(args[::2], args[1::2]):
        if flag == "--keep-bf16":
            patterns.append(value)
        elif flag == "--first-layers-bf16":
            first = int(value)
        elif flag == "--last-layers-bf16":
            last = int(value)
        elif flag == "--w4a16-layers":
            four.append(value)
    return KeepSpec(tuple(patterns), first, last, tuple(four))


def layer_index(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def unit_of(weight_name: str) -> str:
    """The vLLM layer a linear weight belongs to: `model.layers.3.self_attn.qkv_proj` for its
    q/k/v, `model.layers.3.mlp.experts` for any expert weight."""
    module = weight_name.removesuffix(".weight")
    if _EXPERT.search(f"{module}."):
        return module[: _EXPERT.search(f"{module}.").start()] + ".experts"
    parent, _, leaf = module.rpartition(".")
    return f"{parent}.{FUSED[leaf]}" if leaf in FUSED else module


def units(linear_weights: Iterable[str]) -> dict[str, list[str]]:
    """unit -> its weight names, units in model order (layer index, then name)."""
    out: dict[str, list[str]] = {}
    for name in sorted(linear_weights, key=lambda n: (layer_index(n) if layer_index(n) is not None else -1, n)):
        out.setdefault(unit_of(name), []).append(name)
    return out


def kept_weights(linear_weights: Iterable[str], spec: KeepSpec, source: str | None = None) -> set[str]:
    """The linear weights (checkpoint names) the spec keeps in BF16, fused partners included."""
    names = set(linear_weights)
    if not spec:
        return set()
    indices = [i for i in map(layer_index, names) if i is not None]
    count = max(indices) + 1 if indices else 0
    if spec.first_layers + spec.last_layers > count:
        raise FlashRLError(f"first_layers_bf16 + last_layers_bf16 = {spec.first_layers + spec.last_layers} "
                           f"but the model has {count} layers", source, "lower them")
    picked = {n for n in names if layer_index(n) is not None
              and (layer_index(n) < spec.first_layers or layer_index(n) >= count - spec.last_layers)}
    picked |= _matching(names, spec.patterns, "keep_bf16", source)
    experts = sorted(n for n in picked if unit_of(n).endswith(".experts"))
    if experts:
        raise FlashRLError(f"keeping MoE experts in BF16 is not supported ({experts[0]}, {len(experts)} expert "
                           "weights)", source, "keep attention layers instead (keep_bf16: ['*.self_attn.*'])")
    return _with_partners(names, picked)


def _matching(names: set[str], patterns: Iterable[str], key: str, source: str | None) -> set[str]:
    """The weights whose module or unit (mixed.unit_of) name matches one of the globs; a glob matching none is an
    error naming the config key."""
    picked = set()
    for pattern in patterns:
        hits = {n for n in names if fnmatch.fnmatchcase(n.removesuffix(".weight"), pattern)
                or fnmatch.fnmatchcase(unit_of(n), pattern)}
        if not hits:
            raise FlashRLError(f"{key} pattern {pattern!r} matches no linear layer of the model", source,
                               "patterns match module names such as 'model.layers.0.self_attn.q_proj' or "
                               "'*.mlp.down_proj' (see `flashrl tune`'s report for the names)")
        picked |= hits
    return picked


def _with_partners(names: set[str], picked: set[str]) -> set[str]:
    """`picked` with the fused partners of each (a vLLM layer has one scheme)."""
    grouped = units(names)
    return {n for name in picked for n in grouped[unit_of(name)]}


def four_bit_weights(linear_weights: Iterable[str], spec: KeepSpec, kept: set[str], source: str | None = None,
                     group: int = 128, columns: dict[str, int] | None = None) -> set[str]:
    """The linear weights (checkpoint names) an 8-bit config serves W4A16 (`w4a16_layers`), fused partners
    included, those kept in BF16 left out. `columns`: weight name -> input columns, checked against the 4-bit
    format's groups of `group`."""
    names = set(linear_weights)
    if not spec.four_bit:
        return set()
    picked = _matching(names, spec.four_bit, "w4a16_layers", source)
    experts = sorted(n for n in picked if unit_of(n).endswith(".experts"))
    if experts:
        raise FlashRLError(f"4-bit MoE experts are not served yet ({experts[0]}, {len(experts)} expert weights)",
                           source, "name attention or dense MLP layers in w4a16_layers (e.g. '*.self_attn.*')")
    out = _with_partners(names, picked) - set(kept)
    ragged = sorted(n for n in out if columns is not None and columns[n] % group)
    if ragged:
        raise FlashRLError(f"{len(ragged)} weights of w4a16_layers have input columns that are not a multiple of "
                           f"{group} (first: {ragged[0]}, {columns[ragged[0]]} columns): w4a16 groups {group} "
                           "columns per scale", source, "leave those layers out of w4a16_layers (they stay 8-bit)")
    return out


def four_bit_targets(four: Iterable[str]) -> list[str]:
    """The 4-bit scheme group's targets: each module, and the fused layer vLLM builds of it (qkv_proj, gate_up_proj).
    vLLM matches a layer's own name before its class ("Linear", the 8-bit group) in every version; only newer
    ones try a fused layer's members before the class."""
    names = kept_modules(four)
    return names + sorted({unit_of(n) for n in four} - set(names))


def kept_modules(kept: Iterable[str]) -> list[str]:
    """Module names for a compressed-tensors `ignore` list, sorted in model order."""
    return [n.removesuffix(".weight") for n in sorted(kept, key=lambda n: (layer_index(n) or 0, n))]


# the last member of each fused layer, in vLLM's shard order (q, k, v; gate, up)
_LAST_SHARD = {"qkv_proj": "v_proj", "gate_up_proj": "up_proj"}


def fp8_block_unservable(shapes: dict[str, tuple[int, ...]], block: int = 128) -> list[str]:
    """Dense units vLLM's block FP8 cannot serve at TP=1 (vLLM 0.26): the input width must be a
    multiple of 128 (activations are quantized per 1x128 group: `per_token_group_quant_fp8`), and
    a fused layer's shards, all but its last, must each have a multiple of 128 rows
    (`validate_fp8_block_shape`). `shapes`: linear weight name -> [out, in]. On SmolLM2-135M
    (hidden 576) only the down projections (input 1536) pass."""
    bad = []
    for unit, weights in units(shapes).items():
        fused = unit.rpartition(".")[2]
        if fused == "experts":  # MoE experts: other kernels, other rules (not checked here)
            continue
        ragged_shard = fused in _LAST_SHARD and len(weights) > 1 and any(
            shapes[w][0] % block for w in weights
            if w.removesuffix(".weight").rpartition(".")[2] != _LAST_SHARD[fused])
        if ragged_shard or any(shapes[w][1] % block for w in weights):
            bad.append(unit)
    return bad
