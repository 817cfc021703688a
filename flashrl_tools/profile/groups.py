"""Which layers SmoothQuant may have smoothed together, per decoder layer.

These are llmcompressor's default SmoothQuant mappings for Llama-style decoders (Llama, Qwen2,
Qwen3, Mistral...) plus the optional down_proj <- up_proj mapping, matched by module leaf name
inside each decoder layer. Whether a group was actually smoothed is decided from the data.
A leaf name found more than once in a layer (MoE experts) forms no group: those weights are
profiled as plain linears (frozen scales), and the report shows how exactly they reproduce.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# (balance layers, the layer before them that absorbs 1/m), in llmcompressor's application order.
MAPPINGS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("q_proj", "k_proj", "v_proj"), "input_layernorm"),
    (("gate_proj", "up_proj"), "post_attention_layernorm"),
    (("down_proj",), "up_proj"),
)
_LAYER = re.compile(r"^(.*\.layers\.\d+\.)")


@dataclass(frozen=True)
class Group:
    members: tuple[str, ...]  # weight names of the balance linears
    smooth: str  # weight name of the norm (1-D) or linear (2-D, rows divided)
    smooth_is_linear: bool


def layer_groups(linear_weights: set[str], all_names: set[str]) -> dict[str, list[Group]]:
    """Decoder-layer prefix -> its groups, in fitting order (groups whose smooth layer is a
    linear first: their factors are needed to read that linear's own weights)."""
    by_layer: dict[str, dict[str, str]] = {}
    repeated: set[tuple[str, str]] = set()  # MoE: every expert has a gate_proj; not one group
    for name in all_names:
        m = _LAYER.match(name)
        if m and name.endswith(".weight"):
            leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]
            if leaf in by_layer.setdefault(m.group(1), {}):
                repeated.add((m.group(1), leaf))
            by_layer[m.group(1)][leaf] = name
    for prefix, leaf in repeated:
        del by_layer[prefix][leaf]
    out: dict[str, list[Group]] = {}
    for prefix, leaves in sorted(by_layer.items()):
        groups = []
        for balance, smooth in MAPPINGS:
            if all(b in leaves and leaves[b] in linear_weights for b in balance) and smooth in leaves:
                smooth_name = leaves[smooth]
                groups.append(Group(tuple(leaves[b] for b in balance), smooth_name,
                                    smooth_name in linear_weights))
        out[prefix] = sorted(groups, key=lambda g: not g.smooth_is_linear)
    return out
