"""Re-quantize (updated) BF16 weights with a profile into a checkpoint like the profiled one.

This is what the runtime does on every weight sync, done offline: the reference a synced
engine must match, and a way to check a profile on perturbed weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from flashrl_tools.errors import FlashRLError
from flashrl_tools.fsutil import atomic_output_dir, check_output_dir
from flashrl_tools.quant.mixed import KeepSpec, kept_modules, kept_weights
from flashrl_tools.model_structure import read_config
from flashrl_tools.profile.format import Profile
from flashrl_tools.quant.quantize import copy_side_files
from flashrl_tools.quant.quantizer import (QuantFn, as_served, output_specs, quantize_weight, requantize_int8, smooth_norm,
                                           smooth_weight)
from flashrl_tools.safetensors_io import CheckpointReader, PlannedTensor, write_checkpoint


def requantize_tensor(profile: Profile, name: str, tensor: torch.Tensor,
                      kept: frozenset[str] = frozenset(), on=lambda key, t: t) -> list[tuple[str, torch.Tensor]]:
    """Checkpoint-format tensors for one BF16 tensor: (weight, scale) for a quantized linear,
    the rescaled weight for a smoothed norm, the tensor itself otherwise. A linear in `kept`
    (mixed precision) stays BF16, smoothed as the profile says (its norm is divided). The one
    re-quantize-with-profile step: `profile apply` offline, every weight sync in the runtime
    (`on(key, t)` puts the profile's tensors on the weight's device, cached by key)."""
    fn = QuantFn.parse(profile.meta.fn)
    if name in kept or name in profile.quantized_names:
        tensor = as_served(tensor)  # trainers push fp32 masters (quantizer.served_dtype)
    if name in kept:
        return [(name, kept_bf16(profile, name, tensor, on))]
    entry = profile.linear(name) if fn.calibratable else None
    if entry is not None:
        scale = on(f"{name}:scale", entry.weight_scale)
        q = requantize_int8(tensor, scale, on(f"{name}:in", entry.smooth_in), on(f"{name}:out", entry.smooth_out))
        return [(name, q), (f"{name}_scale", scale)]
    if name in profile.quantized_names:
        if not fn.is_fp8:
            raise KeyError(f"the profile has no entry for quantized weight {name}")
        q = quantize_weight(fn, tensor)
        return [(name, q.weight), (f"{name}_scale", q.weight_scale)]
    divisor = profile.norm_divisor(name)
    return [(name, smooth_norm(tensor, on(f"{name}:div", divisor)) if divisor is not None else tensor)]


def kept_bf16(profile: Profile, name: str, tensor: torch.Tensor, on=lambda key, t: t) -> torch.Tensor:
    """A linear kept in BF16 under a SmoothQuant profile: its columns multiplied (the norm or
    linear feeding it is divided) and rows divided (the linear after it multiplies), unrounded."""
    entry = profile.linear(name)
    if entry is None or (entry.smooth_in is None and entry.smooth_out is None):
        return tensor
    return smooth_weight(tensor, on(f"{name}:in", entry.smooth_in), on(f"{name}:out", entry.smooth_out))


def _planned(profile: Profile, name: str, shape: tuple[int, ...], dtype: torch.dtype,
             kept: frozenset[str] = frozenset()) -> list[PlannedTensor]:
    """What requantize_tensor returns for this tensor, known from its shape and dtype."""
    fn = QuantFn.parse(profile.meta.fn)
    if name in kept:
        return [PlannedTensor(name, shape, dtype)]
    entry = profile.linear(name) if fn.calibratable else None
    if entry is not None:
        return [PlannedTensor(name, shape, torch.int8),
                PlannedTensor(f"{name}_scale", tuple(entry.weight_scale.shape), entry.weight_scale.dtype)]
    if fn.is_fp8 and name in profile.quantized_names:
        specs = output_specs(fn, shape, dtype)
        return [PlannedTensor(name, shape, specs["weight"].dtype),
                PlannedTensor(f"{name}_scale", specs["weight_scale"].shape, specs["weight_scale"].dtype)]
    return [PlannedTensor(name, shape, dtype)]


def requantize_checkpoint(bf16_dir: Path, profile: Profile, out: Path, force: bool = False,
                          keep: KeepSpec = KeepSpec(), template: Path | None = None) -> Path:
    """`bf16_dir` quantized as the profiled checkpoint was. `template`: a directory with that
    checkpoint's config.json (default: where the profile says the checkpoint is)."""
    template = Path(template or profile.meta.quantized_model.path)
    if not (template / "config.json").is_file():
        raise FlashRLError("the profiled 8-bit checkpoint is not available", str(template),
                           "its config.json supplies the quantization_config")
    check_output_dir(Path(out), force)
    reader = CheckpointReader(bf16_dir)
    kept = frozenset(kept_weights(profile.meta.quantized, keep, str(bf16_dir)))
    plan = [t for name in reader.names()
            for t in _planned(profile, name, reader.shape(name), reader.dtype(name), kept)]

    def produce() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in reader.iter_tensors():
            yield from requantize_tensor(profile, name, tensor, kept)

    with atomic_output_dir(Path(out)) as tmp:
        write_checkpoint(tmp, plan, produce)
        config = read_config(bf16_dir)
        config["quantization_config"] = read_config(template)["quantization_config"]
        if kept:
            ignore = config["quantization_config"].setdefault("ignore", [])
            ignore += [m for m in kept_modules(kept) if m not in ignore]
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copy_side_files(Path(bf16_dir), tmp)
    return Path(out)
