"""How 4-bit codes are stored in a checkpoint (compressed-tensors `pack-quantized`): eight codes to an int32 word.
The codes themselves come from quantizer.py (the math); this is their byte layout only."""

from __future__ import annotations

import torch

_SHIFTS = tuple(range(0, 32, 4))  # the first code in the lowest bits
CODES_PER_WORD = len(_SHIFTS)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """INT4 codes [out, in] (int8 in [-8, 7]) packed 8 to an int32 word along the columns, offset by 8
    (compressed-tensors' `pack_to_int32(q, 4)`): [out, in / 8] int32 (bit 31 wraps negative)."""
    out, inp = q.shape
    if inp % 8:
        raise ValueError(f"4-bit packing needs a multiple of 8 columns, got {inp}")
    u = (q.to(torch.int32) + 8).reshape(out, inp // 8, 8)
    word = torch.zeros((out, inp // 8), dtype=torch.int32, device=q.device)
    for i, shift in enumerate(_SHIFTS):
        word |= u[..., i] << shift
    return word


def unpack_int4(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """`pack_int4` undone: int8 codes [out, columns]."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=packed.device)
    u = (packed[..., None] >> shifts) & 0xF
    return (u.reshape(*packed.shape[:-1], -1)[..., :columns] - 8).to(torch.int8)


def changed_codes(before: torch.Tensor, after: torch.Tensor) -> int:
    """How many of the 4-bit codes packed in two int32 tensors of one shape differ."""
    diff = before ^ after
    return int(sum(((diff >> shift) & 0xF).ne(0).sum() for shift in _SHIFTS))
