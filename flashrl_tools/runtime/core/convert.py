"""Trainer BF16 tensors -> the checkpoint-format tensors the engine was loaded from.

Pure torch (the quantizer and the profile), no vLLM: one incoming (name, tensor) becomes
(name, int8/fp8 weight) + (name_scale, scale) for a quantized linear, a rescaled norm for a
SmoothQuant-smoothed norm, or itself. Runs on the tensor's device. Trainer names that the
checkpoint does not use (transformers 5's fused MoE experts, renamed modules) are first mapped
to checkpoint names (`to_checkpoint`, trainer_names.py).

A trainer may also send what this produces (flashrl_tools/wire.py: quantized on the trainer, 1 byte
per parameter on the wire): an 8-bit weight and its `_scale`, in one call or two, are paired, checked
against the served format (dtype, shapes) and loaded as they are; BF16 tensors beside them convert as
usual. With a calibrated profile the conversion also rescales norms, which cannot be told from raw
ones: the trainer's call then sends `CONVERTED` first, and every tensor of that sync is taken as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from flashrl_tools.model_structure import has_weights, meta_model, model_layout, read_config, unquantized_names
from flashrl_tools.profile.apply import requantize_tensor
from flashrl_tools.profile.format import Profile, load_profile
from flashrl_tools.quant.quant_config import QUANT_EXTRA_SUFFIXES, has_pow2_scales, layer_formats, weight_name
from flashrl_tools.quant.quantizer import (QuantFn, as_served, checkpoint_specs, checkpoint_tensors, output_specs,
                                          quantize_weight, quantize_weights)
from flashrl_tools.safetensors_io import CheckpointReader
from flashrl_tools.config.schema import ConfigFn
from flashrl_tools.trainer_names import TrainerNames

log = logging.getLogger("flashrl_tools.runtime")
_CHUNK_ELEMENTS = 1 << 26  # stacked source elements quantized at once (128 MiB of BF16)
CONVERTED = "flashrl.converted"  # a marker tensor's name: the rest of this sync is already converted


class WeightConverter:
    # Devices where `convert_group` stacks experts: on CUDA a small expert weight costs kernel
    # launches more than bytes; on CPU stacking only adds a copy (measured slower with 2 cores,
    # benchmarks/results/moe/convert_cpu.json), so experts are converted one by one there.
    batch_devices: frozenset[str] = frozenset({"cuda"})

    def __init__(self, fn: ConfigFn, quantized: set[str], profile: Profile | None = None,
                 model_dir: Path | None = None, expected: set[str] | None = None,
                 served: QuantFn | None = None, pow2: bool = False, formats: dict[str, QuantFn] | None = None):
        self.fn = fn
        self.pow2 = pow2  # the checkpoint's FP8 scales are powers of two (quantize --pow2-scales)
        # the 8-bit format of the tensors the engine loaded; None when it loaded BF16 (bf16, vLLM's
        # online fp8). FLASHRL_CONFIG=fp8 on a MoE model serves our fp8_channel checkpoint.
        self.served = served if served is not None else fn.quant_fn
        self.quantized = quantized  # checkpoint names of the linear weights the engine holds quantized
        self.formats = dict(formats or {})  # those of them in another format than `served` (4-bit layers of a mix)
        self.profile = profile
        # linears the profile smooths but the engine keeps in BF16 (mixed precision)
        self.kept = frozenset() if profile is None else frozenset(
            k.removesuffix("_scale") for k in profile.tensors if k.endswith(".weight_scale")) - frozenset(quantized)
        self.model_dir, self.expected = model_dir, expected  # for trainer-name translation
        self._names: TrainerNames | None = None
        self._device_cache: dict[tuple[str, torch.device], torch.Tensor | None] = {}
        self._halves: dict[str, dict[str, torch.Tensor]] = {}  # pre-quantized weights awaiting their partner
        self.converted = False  # the trainer said this sync's tensors are converted (wire.py, profiles)

    def end_push(self) -> None:
        """A sync completed or a push was refused: this sync's CONVERTED and half-received pre-quantized pairs
        do not carry over (the next sync says CONVERTED again, or is converted here)."""
        self.converted = False
        self._halves.clear()

    @classmethod
    def for_checkpoint(cls, fn: ConfigFn, loaded_dir: Path, profile_path: str | None) -> WeightConverter:
        """Derive what to quantize from the checkpoint the engine actually loaded (from the
        model's structure when it is config-only: dummy weights)."""
        profile = load_profile(Path(profile_path)) if profile_path else None
        served = served_format(loaded_dir)
        config = read_config(loaded_dir)
        pow2 = has_pow2_scales(config)
        formats = {f"{m}.weight": f for m, f in layer_formats(config.get("quantization_config")).items() if f != served}
        expected = cls.expected_names(loaded_dir)
        if not has_weights(loaded_dir):  # config only: the linears its quantization_config does not ignore
            ignored = {f"{m}.weight" for m in config.get("quantization_config", {}).get("ignore", [])}
            quantized = model_layout(loaded_dir, allow_quantized=True).linear_weights - ignored if served else set()
            return cls(fn, set(quantized), profile, loaded_dir, expected, served, pow2, formats)
        reader = CheckpointReader(loaded_dir)
        quantized = {weight_name(n) for n in reader.names()
                     if f"{weight_name(n)}_scale" in reader and not n.endswith(QUANT_EXTRA_SUFFIXES)}
        return cls(fn, quantized, profile, loaded_dir, expected, served, pow2, formats)

    def format_of(self, name: str) -> QuantFn | None:
        """The format the engine holds a quantized linear weight in."""
        return self.formats.get(name, self.served)

    @staticmethod
    def expected_names(loaded_dir: Path) -> set[str]:
        """BF16 names a full sync must deliver (the checkpoint's, without quantization extras)."""
        if not has_weights(loaded_dir):
            return unquantized_names(loaded_dir)
        return {weight_name(n) for n in CheckpointReader(loaded_dir).names() if not n.endswith(QUANT_EXTRA_SUFFIXES)}

    def to_checkpoint(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """A trainer's (name, tensor) as checkpoint-named BF16 tensors: itself when the checkpoint
        has that name, else transformers' save-time conversion (fused experts split per expert)."""
        if self.expected is None or name in self.expected:
            return [(name, tensor)]
        if self._names is None:
            self._names = TrainerNames(meta_model(self.model_dir), frozenset(self.expected))
        return self._names.translate(name, tensor)

    def checkpoint_groups(self, weights, ignored: set[str]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Checkpoint-named tensors of what a trainer pushes, one list per trainer tensor (fused MoE
        experts split per expert, renamed modules mapped back). Names the served checkpoint does not
        have (a tied lm_head, buffers) are dropped, logged once (`ignored`): an engine would skip them,
        and they must not open a sync of their own."""
        for trainer_name, trainer_tensor in weights:
            if trainer_name == CONVERTED:
                self.converted = True
                continue
            if (half := self._prequantized_half(trainer_name, trainer_tensor)) is not None:
                if (pair := self._pair(*half)) is not None:
                    yield pair
                continue
            group = []
            for name, tensor in self.to_checkpoint(trainer_name, trainer_tensor):
                if name in self.expected:
                    group.append((name, tensor))
                elif name not in ignored:
                    ignored.add(name)
                    log.info("flashrl: ignoring %s (not in the served checkpoint)", name)
            if group:
                yield group
        for halves in self._halves.values():  # kept past this call: copies (trainers reuse their buffers)
            for kind, t in halves.items():
                halves[kind] = t.clone()

    def _prequantized_half(self, name: str, tensor: torch.Tensor) -> tuple[str, str, torch.Tensor] | None:
        """(weight name, "weight" | "scale" | "shape", tensor) for part of a pre-quantized weight, else None:
        an 8-bit weight under its own name, a 4-bit one under `_packed` (with its `_shape`), their `_scale`."""
        if name in self.quantized and tensor.dtype.itemsize == 1:
            return name, "weight", tensor
        for suffix, kind in (("_scale", "scale"), ("_packed", "weight"), ("_shape", "shape")):
            base = name.removesuffix(suffix)
            if base != name and base in self.quantized and (kind == "scale" or self.format_of(base).packed):
                return base, kind, tensor
        return None

    def _pair(self, weight: str, kind: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """The pre-quantized weight once all its parts arrived (the weight under its BF16 name: `convert_group`
        gives it the checkpoint's), checked against the served format; None until then."""
        halves = self._halves.setdefault(weight, {})
        halves[kind] = tensor
        if len(halves) < (3 if self.format_of(weight).packed else 2):
            return None
        del self._halves[weight]
        self.check_prequantized(weight, halves)
        return [(weight, halves["weight"]), (f"{weight}_scale", halves["scale"])] + (
            [(f"{weight}_shape", halves["shape"])] if "shape" in halves else [])

    def check_prequantized(self, name: str, parts: dict[str, torch.Tensor]) -> None:
        """A pre-quantized weight must be exactly what this engine's conversion would produce."""
        from flashrl_tools.errors import FlashRLError

        fix = "quantize on the trainer with the engine's FLASHRL_CONFIG (flashrl_tools.wire), or push BF16"
        fmt = self.format_of(name)
        if fmt is None or (self.profile is not None and not self.converted):
            raise FlashRLError(f"{'4' if 'shape' in parts else '8'}-bit tensor {name} pushed, but this engine "
                               + ("serves BF16" if fmt is None else "converts with a calibrated profile "
                                  f"and the sync did not start with {CONVERTED}")
                               + ": it takes only BF16 tensors", None, fix)
        weight = parts["weight"]
        if weight.dim() != 2:
            raise FlashRLError(f"pre-quantized {name} has shape {tuple(weight.shape)}: a linear weight is 2-D", None, fix)
        if fmt.packed:  # the BF16 shape from the `_shape` tensor, checked against the packed words below
            shape = tuple(int(x) for x in parts["shape"].tolist()) if parts["shape"].numel() == 2 else (0, 0)
            spec = {k.removeprefix(f"{name}_").replace("packed", "weight"): v
                    for k, v in checkpoint_specs(fmt, name, shape, torch.bfloat16)} if min(shape) > 0 else {}
            if not spec:
                raise FlashRLError(f"pre-quantized {name}: `_shape` {parts['shape'].tolist()} is not [out, in]",
                                   None, fix)
        else:
            spec = {k.replace("weight_", ""): v for k, v in output_specs(fmt, tuple(weight.shape), torch.bfloat16).items()}
        bad = [f"{k} {tuple(parts[k].shape)} {parts[k].dtype} (expected {tuple(v.shape)} {v.dtype})"
               for k, v in spec.items() if tuple(parts[k].shape) != tuple(v.shape) or parts[k].dtype != v.dtype]
        if bad:
            raise FlashRLError(f"pre-quantized {name} does not match this engine's {fmt.value} format: "
                               + "; ".join(bad), None, fix)

    def convert(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if self.served is None:  # vLLM itself handles BF16 / online FP8
            return [(name, tensor)]
        if self.profile is not None:  # the same step as `profile apply`
            return requantize_tensor(self.profile, name, tensor, self.kept,
                                     on=lambda key, t: self._on(key, t, tensor.device))
        if name in self.quantized:  # trainers push fp32 masters (quantizer.served_dtype)
            fmt = self.format_of(name)
            return checkpoint_tensors(fmt, name, quantize_weight(fmt, as_served(tensor), self.pow2 and fmt.is_fp8))
        return [(name, tensor)]

    def convert_group(self, group: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """`convert` of the checkpoint tensors one trainer tensor became (a fused MoE tensor split
        per expert): quantized together in chunks of stacked slices when they are all 8-bit
        weights of one shape (bit-identical with one `convert` each; thousands of experts per
        sync otherwise pay thousands of small kernels)."""
        if len(group) >= 2 and group[1][0] == f"{group[0][0]}_scale" and group[0][0] in self.quantized and not (
                group[0][1].dtype.is_floating_point and group[0][1].dtype.itemsize > 1):  # pre-quantized (checked
            name, weight = group[0]  # when paired); a 4-bit weight is stored under `_packed`
            return [(f"{name}_packed" if self.format_of(name).packed else name, weight), *group[1:]]
        if self.converted:  # a converted sync (CONVERTED): norms already rescaled, BF16 layers as served
            return group
        if not self._batchable(group):
            return [pair for name, tensor in group for pair in self.convert(name, tensor)]
        out: list[tuple[str, torch.Tensor]] = []
        rows, cols = group[0][1].shape
        step = max(1, _CHUNK_ELEMENTS // (rows * cols))
        fmt = self.format_of(group[0][0])
        for start in range(0, len(group), step):
            chunk = group[start:start + step]
            stacked = as_served(torch.stack([t for _, t in chunk]))
            for (name, _), q in zip(chunk, quantize_weights(fmt, stacked, self.pow2 and fmt.is_fp8)):
                out += checkpoint_tensors(fmt, name, q)
        return out

    def _batchable(self, group: list[tuple[str, torch.Tensor]]) -> bool:
        if len(group) < 2 or self.served is None or self.profile is not None:
            return False
        first = group[0][1]
        return first.dim() == 2 and first.device.type in self.batch_devices and all(
            name in self.quantized and t.shape == first.shape and t.dtype == first.dtype
            and t.device == first.device and self.format_of(name) == self.format_of(group[0][0]) for name, t in group)

    def convert_all(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            yield from self.convert(name, tensor)

    def drop_device_cache(self) -> None:
        """Forget the profile tensors copied to devices (after the engine freed their memory)."""
        self._device_cache.clear()

    def _on(self, key: str, t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
        if t is None:
            return None
        cache_key = (key, device)
        if cache_key not in self._device_cache:
            self._device_cache[cache_key] = t.to(device)
        return self._device_cache[cache_key]


def served_format(loaded_dir: Path) -> QuantFn | None:
    """Which of our 8-bit formats the engine's checkpoint holds (None: a BF16 checkpoint)."""
    from flashrl_tools.model_structure import read_config

    if "quantization_config" not in read_config(loaded_dir):
        return None
    from flashrl_tools.profile.build import checkpoint_format

    return checkpoint_format(loaded_dir)
