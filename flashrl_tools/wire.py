"""8-bit weights over the wire: the trainer quantizes, the engine writes them in place.

    from flashrl_tools.wire import engine_tensors

    for bucket in engine_tensors(model.named_parameters(), "Qwen/Qwen2.5-7B", config="int8"):
        push(bucket)        # collective_rpc + model.load_weights, the weight-transfer engine, SGLang's updates

`engine_tensors` turns the trainer's named BF16 (or fp32 master) tensors into the tensors the rollout
engine serves under the same `FLASHRL_CONFIG` -- each 8-bit linear weight as its int8 / fp8 weight and
`_scale` (1 byte per parameter instead of 2), everything else as it is -- with the same quantizer and the
same served structure (quant/quantizer.py, runtime/core/convert.py), in buckets of about `bucket_bytes`.
The engine's sync session recognises them, checks them against its format and loads them without
quantizing again (bit-identical to an engine-side sync); BF16 pushes keep working beside them.
Imports torch, transformers and flashrl_tools only (no vLLM, no SGLang): it runs in the trainer.

Served: the shortcuts and YAML configs that quantize the policy (`int8`, `fp8_channel`, `fp8_block`,
`keep_bf16` layers, MoE experts, the trainers' fused expert names) and calibrated checkpoints with or
without their profile, BF16 layers kept beside a profile too (a profile also rescales norms: the first bucket
then starts with the marker `flashrl.converted`, and the engine takes that sync's tensors as they are); Hub
references resolve as on the engines. Not: vLLM's online FP8 (`FLASHRL_CONFIG=fp8` on a dense model: the
engine quantizes BF16 itself; use `fp8_channel`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

DEFAULT_BUCKET_BYTES = 512 << 20


def engine_tensors(weights: Iterable[tuple[str, torch.Tensor]], policy_model: str | Path, config: str | None = None,
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES, engine: str = "vllm") -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The trainer's (name, tensor) pairs as the engine's tensors, in buckets (lists of pairs) of at least
    `bucket_bytes` (the last one smaller). `policy_model`: the BF16 checkpoint the engine was started on
    (its structure decides what is 8-bit); `config`: FLASHRL_CONFIG's value (default: the environment's);
    `engine`: "vllm" or "sglang" (what `fp8` serves differs)."""
    from flashrl_tools.runtime.core.convert import CONVERTED

    converter = trainer_converter(policy_model, config, engine)
    # a profile also rescales norms (BF16 either way): the engine is told this sync is converted (the marker
    # first, on the trainer's device: CUDA IPC shares CUDA tensors only)
    marker = converter.profile is not None
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for group in converter.checkpoint_groups(weights, set()):
        device = group[0][1].device
        if marker:
            bucket.append((CONVERTED, torch.ones(1, device=device)))
            marker = False
        for name, tensor in converter.convert_group(group):
            bucket.append((name, tensor.to(device)))  # a profile's own tensors too: where the trainer's are
            size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def trainer_converter(policy_model: str | Path, config: str | None = None, engine: str = "vllm"):
    """The `WeightConverter` of an engine started on `policy_model` with this config, built on the trainer
    from the served structure alone (a config-only copy of what the engine loads: no weights quantized)."""
    from flashrl_tools.config.resolve import from_env, resolve
    from flashrl_tools.errors import FlashRLError
    from flashrl_tools.model_structure import is_moe
    from flashrl_tools.quant.mixed import KeepSpec
    from flashrl_tools.quant.quantize import quantize_config_only
    from flashrl_tools.runtime.core.convert import WeightConverter
    from flashrl_tools.runtime.core.plan import served_format
    from flashrl_tools.runtime.engines import engine_capabilities  # declarations only: no engine import

    rc = resolve(config) if config is not None else from_env()
    if rc is None:
        raise FlashRLError("no FLASHRL_CONFIG to quantize for", None, "pass config= or set FLASHRL_CONFIG")
    entry = rc.entry
    if entry.profile is not None and entry.model is None:
        raise FlashRLError(f"FLASHRL_CONFIG={rc.source}: trainer-side quantization with a profile needs its "
                           "calibrated `model`", entry.profile, "add the calibrated checkpoint as `model`, or push "
                           "BF16 tensors")
    fmt, engine_online = served_format(rc, engine_capabilities(engine), is_moe(entry.model or str(policy_model)))
    if fmt is None or engine_online:
        raise FlashRLError(f"FLASHRL_CONFIG={rc.source} serves " + ("the engine's own online FP8" if engine_online
                                                                   else "BF16") + ": nothing to quantize on the trainer",
                           None,
                           "push BF16 tensors, or use an 8-bit config (int8, fp8_channel, fp8_block)")
    keep = KeepSpec.of(entry)
    if entry.model is not None and keep:  # the engine serves the policy re-quantized by the profile, kept in BF16
        return WeightConverter.for_checkpoint(rc.fn, _profile_mixed_config(Path(policy_model), entry, keep),
                                              entry.profile)
    if entry.model is not None:
        return WeightConverter.for_checkpoint(rc.fn, Path(entry.model), entry.profile)
    served = Path(tempfile.mkdtemp(prefix="flashrl-wire-")) / "served"
    quantize_config_only(Path(policy_model), served, fmt, KeepSpec.of(entry), entry.fp8_scale_pow2)
    return WeightConverter.for_checkpoint(rc.fn, served, None)


def _profile_mixed_config(policy_model: Path, entry, keep) -> Path:
    """The config-only copy of what an engine serves for a profile with BF16 layers kept (runtime/core/plan.py
    `checkpoint_for` -> profile/apply.py `requantize_checkpoint`): the calibrated checkpoint's quantization_config,
    the kept modules added to its `ignore`."""
    import json

    from flashrl_tools.model_structure import read_config
    from flashrl_tools.profile.format import load_profile
    from flashrl_tools.quant.mixed import kept_modules, kept_weights
    from flashrl_tools.quant.quantize import copy_side_files

    profile = load_profile(Path(entry.profile))
    kept = kept_weights(profile.meta.quantized, keep, str(policy_model))
    config = read_config(policy_model)
    config["quantization_config"] = read_config(Path(entry.model))["quantization_config"]
    ignore = config["quantization_config"].setdefault("ignore", [])
    ignore += [m for m in kept_modules(kept) if m not in ignore]
    out = Path(tempfile.mkdtemp(prefix="flashrl-wire-")) / "served"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copy_side_files(policy_model, out)
    return out


def wire_bytes(buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> int:
    return sum(t.numel() * t.element_size() for bucket in buckets for _, t in bucket)
