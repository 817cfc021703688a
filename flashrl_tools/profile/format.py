"""The profile file: one safetensors file, tensors + typed JSON metadata in its header. No pickle.

Tensors (INT8 profiles), keyed by the checkpoint names they apply to:
- `<linear>.weight_scale`  frozen per-output-channel scale [out, 1] (what the engine keeps)
- `<linear>.smooth_in`     input-column factor m [in]: the smoothed weight is W * m
- `<linear>.smooth_out`    output-row divisor [out] (up_proj rows, smoothed for down_proj)
- `<norm>.smooth`          divisor [dim]: the smoothed norm weight is w / m
Re-quantizing an updated BF16 weight: `quantizer.requantize_int8(w, weight_scale, smooth_in,
smooth_out)`; an updated norm: `quantizer.smooth_norm(w, smooth)`.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, ValidationError
from safetensors import SafetensorError, safe_open

from flashrl_tools.errors import FlashRLError

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 1
META_KEY = "flashrl_profile"


class ModelRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str
    model_type: str
    files: dict[str, str]  # safetensors file name -> sha256


class ProfileMeta(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format_version: int = FORMAT_VERSION
    fn: str
    flashrl_tools: str
    bf16_model: ModelRef | None
    quantized_model: ModelRef
    quantized: list[str]  # checkpoint names of quantized linear weights
    smoothing_groups: list[dict] = []  # {"smooth": name, "members": [names]} with factors != 1
    source: str = "profile"  # or "flashrl-pt" for converted FlashRL profiles


@dataclass
class LinearEntry:
    weight_scale: torch.Tensor
    smooth_in: torch.Tensor | None = None
    smooth_out: torch.Tensor | None = None


@dataclass
class Profile:
    meta: ProfileMeta
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def linear(self, weight_name: str) -> LinearEntry | None:
        """How to re-quantize this linear weight (None if the profile does not quantize it)."""
        base = weight_name.removesuffix(".weight")
        scale = self.tensors.get(f"{weight_name}_scale")
        if scale is None:
            return None
        return LinearEntry(scale, self.tensors.get(f"{base}.smooth_in"),
                           self.tensors.get(f"{base}.smooth_out"))

    def norm_divisor(self, weight_name: str) -> torch.Tensor | None:
        return self.tensors.get(f"{weight_name.removesuffix('.weight')}.smooth")

    @cached_property
    def quantized_names(self) -> frozenset[str]:
        return frozenset(self.meta.quantized)

    @property
    def smoothing_is_identity(self) -> bool:
        return not any(k.endswith((".smooth_in", ".smooth_out", ".smooth")) for k in self.tensors)


def save_profile(profile: Profile, path: Path) -> None:
    """Write atomically: a temp file in the same directory, renamed when complete."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        # factors shared by a whole group are one tensor in memory; safetensors stores each name
        tensors = {k: v.detach().contiguous().clone() for k, v in profile.tensors.items()}
        save_file(tensors, tmp, metadata={META_KEY: profile.meta.model_dump_json(), "format": "pt"})
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_profile(path: Path) -> Profile:
    return Profile(read_meta(path), _read(path, lambda f: {k: f.get_tensor(k) for k in f.keys()}, "pt"))


def read_meta(path: Path) -> ProfileMeta:
    """The profile's metadata alone (its header; no tensor read, no torch): what a config's validation needs."""
    raw = _read(path, lambda f: (f.metadata() or {}).get(META_KEY), "numpy")
    if raw is None:
        raise FlashRLError("safetensors file has no flashrl profile metadata", str(path),
                           "pass a file written by `flashrl profile`")
    try:
        meta = ProfileMeta.model_validate(json.loads(raw))
    except (ValueError, ValidationError) as e:
        raise FlashRLError(f"profile metadata is invalid ({str(e).splitlines()[0]})", str(path)) from None
    if meta.format_version != FORMAT_VERSION:
        raise FlashRLError(f"profile format version {meta.format_version} is not supported "
                           f"(this flashrl_tools reads {FORMAT_VERSION})", str(path),
                           "re-run `flashrl profile` with this version")
    return meta


def _read(path: Path, fn, framework: str):
    path = Path(path)
    if not path.is_file():
        raise FlashRLError("profile file not found", str(path), "run `flashrl profile` to make one")
    try:
        with safe_open(path, framework=framework) as f:
            return fn(f)
    except (SafetensorError, OSError, ValueError) as e:
        raise FlashRLError(f"not a readable profile ({e})", str(path),
                           "pass a file written by `flashrl profile` (FlashRL .pt: --from-flashrl)") from None
