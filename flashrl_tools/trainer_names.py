"""Trainer tensor names -> checkpoint tensor names, with transformers' own conversion mapping.

transformers 5 keeps some weights in memory in another layout than its checkpoints: MoE experts
as fused 3D parameters (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I])
saved as one 2D weight per expert (`mlp.experts.3.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.3.w1.weight`), and renamed modules (Mixtral's in-memory `mlp` is
`block_sparse_moe` on disk). `save_pretrained` undoes that with `revert_weight_conversion`;
we apply the same function to one tensor at a time, so a trainer that pushes its in-memory
state dict (TRL, verl on transformers 5) and one that streams a checkpoint land on the same
checkpoint names. No name lists here: what maps where is the model class's own mapping.
"""

from __future__ import annotations

import torch
from torch import nn


class TrainerNames:
    """Translate (name, tensor) as a trainer holds it into checkpoint (name, tensor) pairs.

    `model` is the transformers model of the checkpoint (the meta-device one is enough: the
    mapping depends on the class and config only). Names the checkpoint already uses pass
    through without a lookup."""

    def __init__(self, model: nn.Module, checkpoint_names: set[str] | frozenset[str]):
        self.model = model
        self.checkpoint_names = checkpoint_names
        self._renames: dict[str, str] = {}  # in-memory name -> the one checkpoint name it maps to
        self._split: set[str] = set()  # in-memory names that become several checkpoint tensors

    def translate(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if name in self.checkpoint_names:
            return [(name, tensor)]
        if name in self._renames:
            return [(self._renames[name], tensor)]
        out = list(revert(self.model, name, tensor).items())
        if len(out) == 1 and name not in self._split:
            self._renames[name] = out[0][0]
        else:
            self._split.add(name)
        return out

    def names_of(self, name: str, shape: tuple[int, ...]) -> list[str]:
        """The checkpoint names an in-memory tensor of this shape becomes (computed on meta)."""
        return [n for n, _ in self.translate(name, torch.empty(shape, device="meta"))]


def revert(model: nn.Module, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' save-time conversion of one in-memory tensor (identity for most names)."""
    return revert_all(model, {name: tensor})


def revert_all(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' save-time conversion of a state dict: the names `save_pretrained` writes."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: in-memory names are the checkpoint names
        return state
    return revert_weight_conversion(model, state)
