"""FP8 KV-cache scales for the weights the engine holds now: the math and the calibration data.

An FP8 KV cache stores k / k_scale and v / v_scale (and FP8 attention reads q / q_scale); the
right scales depend on the weights, so a weight sync makes them stale. The runtime recalibrates
them before the first rollout after every complete sync (and at start, unless the checkpoint
brings scales): it re-runs fixed calibration sequences through the engine, eagerly, records each
attention layer's absolute maximum of q, k and v over all their tokens, and sets

    scale = absmax / RANGE      (RANGE: q 200, k 200, v 100 -- vLLM's own `calculate_kv_scales`
                                 constants, Q/K/V_SCALE_CONSTANT, so the headroom is vLLM's)

A fresh engine started on the same weights runs the same sequences through the same kernels,
so it gets the same scales; whichever sync path delivered the weights does not enter. Requests
kept across an update (in-flight updates, asynchronous RL) hold cache entries written with the old
scales: `rescale_fp8_` writes each again for the new ones (x = q * old, stored as fp8(x / new),
saturated as the engines' cache writes are), so every entry is read with the scale it was written
with. Pure
torch here; the state per model is kv_state.py, the front end's protocol kv_driver.py, and each
adapter's kv_scales.py says where its attention layers keep the scales.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

RANGES = {"q": 200.0, "k": 200.0, "v": 100.0}
MIN_SCALE = float(torch.finfo(torch.float32).eps)  # an all-zero input must not divide by zero
CALIBRATION_PROMPTS = 8  # the built-in verify prompts, each cut to MAX_CALIBRATION_TOKENS
MAX_CALIBRATION_TOKENS = 256


@dataclass
class AbsMax:
    """Running per-layer absolute maxima of q, k, v over every forward while calibrating."""

    values: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    def update(self, layer: str, **tensors: torch.Tensor) -> None:
        seen = self.values.setdefault(layer, {})
        for kind, t in tensors.items():
            m = t.detach().abs().amax().float()
            seen[kind] = m if kind not in seen else torch.maximum(seen[kind], m)

    def scales(self) -> dict[str, dict[str, float]]:
        return {layer: {kind: scale_for(kind, float(m)) for kind, m in seen.items()}
                for layer, seen in self.values.items()}


def scale_for(kind: str, absmax: float) -> float:
    """The FP8 scale of one of q / k / v from its calibration absmax (fp32, never zero)."""
    scale = float(torch.tensor(absmax, dtype=torch.float32) / torch.tensor(RANGES[kind], dtype=torch.float32))
    return max(scale, MIN_SCALE)


RESCALE_CHUNK = 1 << 25  # elements converted at once: bounds the float32 temporary (128 MiB)


def rescale_fp8_(cache: torch.Tensor, old: float, new: float, rows=None, chunk: int = RESCALE_CHUNK) -> None:
    """Re-encode FP8 cache entries written with scale `old` for scale `new`, in place: q -> fp8(q x
    (old / new)), saturated. `cache`: any view of an engine's cache with its blocks on dim 0; `rows`:
    the blocks to convert (the kept requests'), all when None. A no-op when the scales are equal."""
    if old == new or cache.numel() == 0:
        return
    limit = float(torch.finfo(cache.dtype).max)
    factor = (torch.tensor(old, dtype=torch.float32) / torch.tensor(new, dtype=torch.float32)).to(cache.device)
    index = (torch.arange(cache.shape[0]) if rows is None else rows.long() if isinstance(rows, torch.Tensor)
             else torch.as_tensor(list(rows), dtype=torch.long))
    index = index.to(cache.device)
    raw = cache.view(torch.uint8)  # index kernels take bytes, not every FP8 dtype
    step = max(1, chunk // max(1, cache[:1].numel()))
    for start in range(0, index.numel(), step):
        part = index[start:start + step]
        values = raw.index_select(0, part).view(cache.dtype).to(torch.float32).mul_(factor).clamp_(-limit, limit)
        raw.index_copy_(0, part, values.to(cache.dtype).view(torch.uint8))


def is_fp8_kv(cache_dtype) -> bool:
    """Whether an engine's KV-cache dtype (vLLM's or SGLang's name) is an FP8 one, whose scales the
    runtime calibrates."""
    return str(cache_dtype or "auto").startswith("fp8")


def calibration_inputs(tokenizer, vocab_size: int | None, max_len: int) -> list[list[int]]:
    """The fixed calibration token ids, each short enough for the engine (prompt + 1 token)."""
    return [s[:max_len - 1] for s in calibration_sequences(tokenizer, vocab_size)]


def calibration_sequences(tokenizer, vocab_size: int | None = None) -> list[list[int]]:
    """The fixed token sequences every calibration runs (built-in prompts, same tokenizer as the
    rollouts; an engine without a tokenizer gets seeded token ids below `vocab_size`):
    deterministic, so equal weights give equal scales."""
    from flashrl_tools.prompts import load_prompts

    if tokenizer is None:
        import random

        rng = random.Random(0)
        return [[rng.randrange(min(vocab_size or 256, 32000)) for _ in range(MAX_CALIBRATION_TOKENS)]
                for _ in range(CALIBRATION_PROMPTS)]
    out = []
    for prompt in load_prompts()[:CALIBRATION_PROMPTS]:
        ids = list(tokenizer(prompt)["input_ids"])[:MAX_CALIBRATION_TOKENS]
        if len(ids) >= 2:
            out.append(ids)
    return out


def has_kv_scales(loaded_dir) -> bool:
    """Whether the checkpoint brings attention KV scales (compressed-tensors `kv_cache_scheme`): the
    engine starts on them and recalibrates only after the first sync."""
    from pathlib import Path

    from flashrl_tools.model_structure import read_config

    return bool(read_config(Path(loaded_dir)).get("quantization_config", {}).get("kv_cache_scheme"))
