"""`quantize(src, dst, fn)`: a BF16 checkpoint in, an 8-bit compressed-tensors checkpoint out.

Streams tensor by tensor: each linear weight is read, quantized and written before the next is
read, so peak memory is about one tensor whatever the model size. The output is built in a temp
directory and renamed into place only when complete.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from flashrl_tools import __version__
from flashrl_tools.errors import FlashRLError
from flashrl_tools.fsutil import atomic_output_dir, check_output_dir
from flashrl_tools.quant.formats import LAYERS_4BIT
from flashrl_tools.quant.mixed import KeepSpec, four_bit_targets, four_bit_weights, kept_modules, kept_weights
from flashrl_tools.model_structure import model_layout, read_config
from flashrl_tools.quant.quant_config import FP8_POW2_KEY, quantization_config
from flashrl_tools.quant.quantizer import (INT4_GROUP, QuantFn, as_served, checkpoint_specs, checkpoint_tensors, quantize_weight,
                                          served_dtype)
from flashrl_tools.safetensors_io import INDEX_NAME, CheckpointReader, PlannedTensor, write_checkpoint

# Files beside the weights that a serving engine needs (tokenizer, chat template, generation).
_AUX_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken", ".py")
_NOT_COPIED = {"config.json", INDEX_NAME, "flashrl_manifest.json"}


@dataclass(frozen=True)
class QuantizeResult:
    out: Path
    fn: QuantFn
    quantized: list[str]  # checkpoint names of quantized weights
    kept_bf16: list[str]  # linear weights kept in BF16 (mixed precision), in the config's `ignore`
    four_bit: list[str]  # linear weights stored W4A16 beside `fn`'s (w4a16_layers)
    kept: int  # tensors copied unchanged (embeddings, norms, biases, lm_head)
    bytes_in: int
    bytes_out: int
    seconds: float


def quantize(src: Path, dst: Path, fn: QuantFn | str, force: bool = False,
             max_shard_bytes: int = 4 << 30, keep: KeepSpec = KeepSpec(), pow2: bool = False) -> QuantizeResult:
    t0 = time.perf_counter()
    fn = parse_fn(fn)
    check_pow2(fn, pow2)
    check_four_bit(fn, keep)
    src, dst = Path(src).resolve(), Path(dst).resolve()
    if dst == src or src in dst.parents:
        raise FlashRLError("output directory is the model directory or inside it", str(dst),
                           "choose an -o outside the source model")
    check_output_dir(dst, force)
    layout = model_layout(src)
    reader = CheckpointReader(src)
    kept = kept_weights(layout.linear_weights, keep, str(src))
    targets = [n for n in reader.names() if n in layout.linear_weights and n not in kept]
    four = four_bit_weights(layout.linear_weights, keep, kept, str(src),
                            columns={n: reader.shape(n)[-1] for n in targets})
    fn_of = {n: LAYERS_4BIT if n in four else fn for n in targets}
    if not targets:
        raise FlashRLError(f"no linear-layer weights of this {layout.model_type} model found in "
                           "the checkpoint", str(src), "is this a transformers causal LM checkpoint?")
    for name in targets:
        if not reader.dtype(name).is_floating_point or reader.dtype(name).itemsize < 2:
            raise FlashRLError(f"weight {name} has dtype {reader.dtype(name)}, not a float",
                               str(src), "pass the unquantized (BF16/FP16/FP32) checkpoint")
    if fn.packed:
        ragged = [n for n in targets if reader.shape(n)[-1] % INT4_GROUP]
        if ragged:
            modules = sorted({n.removesuffix(".weight").rsplit(".", 1)[-1] for n in ragged})
            raise FlashRLError(f"{len(ragged)} linear weights have input columns that are not a multiple of "
                               f"{INT4_GROUP} (first: {ragged[0]}, {reader.shape(ragged[0])[-1]} columns): "
                               f"{fn.value} groups {INT4_GROUP} columns per scale", str(src),
                               "keep them in BF16 (" + " ".join(f"--keep-bf16 '*.{m}'" for m in modules)
                               + ") or use --fn int8")
    target_set = set(targets)

    plan: list[PlannedTensor] = []
    for name in reader.names():
        if name in target_set:
            plan += [PlannedTensor(n, spec.shape, spec.dtype) for n, spec in
                     checkpoint_specs(fn_of[name], name, reader.shape(name), served_dtype(reader.dtype(name)))]
        else:
            plan.append(PlannedTensor(name, reader.shape(name), reader.dtype(name)))

    def produce() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in reader.iter_tensors():
            if name in target_set:
                f = fn_of[name]
                yield from checkpoint_tensors(f, name, quantize_weight(f, as_served(tensor), pow2 and f.is_fp8))
            else:
                yield name, tensor

    with atomic_output_dir(dst) as tmp:
        write_checkpoint(tmp, plan, produce, max_shard_bytes=max_shard_bytes,
                         metadata={"format": "pt", "flashrl_tools": __version__, "fn": fn.value})
        write_config(src, tmp, fn, list(layout.excluded) + kept_modules(kept), pow2, four_bit_targets(four))
        copy_side_files(src, tmp)
    bytes_in = sum(f.stat().st_size for f in reader.files)
    bytes_out = sum(f.stat().st_size for f in dst.glob("*.safetensors"))
    return QuantizeResult(dst, fn, targets, sorted(kept), sorted(four), len(reader.names()) - len(targets), bytes_in,
                          bytes_out, time.perf_counter() - t0)


def quantize_config_only(src: Path, dst: Path, fn: QuantFn | str, keep: KeepSpec = KeepSpec(),
                         pow2: bool = False) -> Path:
    """For a config-only model (vLLM `load_format="dummy"`, benchmarks): the quantized config,
    no weights."""
    fn = parse_fn(fn)
    check_pow2(fn, pow2)
    check_four_bit(fn, keep)
    layout = model_layout(src)
    kept = kept_weights(layout.linear_weights, keep, str(src))
    four = four_bit_weights(layout.linear_weights, keep, kept, str(src))
    with atomic_output_dir(Path(dst)) as tmp:
        write_config(src, tmp, fn, list(layout.excluded) + kept_modules(kept), pow2, four_bit_targets(four))
        copy_side_files(src, tmp)
    return Path(dst)


def write_config(src: Path, dst: Path, fn: QuantFn, ignore: list[str], pow2: bool, four_bit: list[str] = ()) -> None:
    """The source's config.json with the quantization_config of what `dst` stores (`four_bit`: the modules
    stored W4A16 beside `fn`'s)."""
    config = read_config(src)
    config["quantization_config"] = quantization_config(fn, ignore=ignore, four_bit=list(four_bit))
    if pow2:
        config[FP8_POW2_KEY] = True
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def check_pow2(fn: QuantFn, pow2: bool) -> None:
    if pow2 and not fn.is_fp8:
        raise FlashRLError(f"power-of-two scales are an FP8 option; --fn {fn.value} has none", None,
                           "use --fn fp8_channel, fp8_tensor or fp8_block, or drop --pow2-scales")


def check_four_bit(fn: QuantFn, keep: KeepSpec) -> None:
    if keep.four_bit and fn.packed:
        raise FlashRLError(f"--w4a16-layers mixes 4-bit layers into an 8-bit checkpoint; --fn {fn.value} is 4-bit "
                           "everywhere already", None, "use --fn int8 (or an FP8 format) with --w4a16-layers")


def copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer, chat template, generation config...: what an engine needs beside the weights."""
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and f.suffix in _AUX_SUFFIXES and f.name not in _NOT_COPIED:
            shutil.copy2(f, Path(dst) / f.name)


def parse_fn(fn: QuantFn | str) -> QuantFn:
    if isinstance(fn, QuantFn):
        return fn
    try:
        return QuantFn.parse(fn)
    except ValueError:
        raise FlashRLError(f"unknown quantization format --fn {fn!r}", None,
                           f"use one of: {', '.join(f.value for f in QuantFn)}") from None
