"""Convert a flash-llm-rl `.pt` profile into ours (read with torch.load(weights_only=True)).

flash-llm-rl INT8 profiles map a tensor name to {input_scale, output_scale, type}: a linear's
INT8 weight is round(W * output_scale * input_scale), with input_scale the smoothing factor
[1, in] and output_scale = 1 / scale [out, 1] (for up_proj also divided by down_proj's
smoothing); a norm's new weight is w * input_scale. FP8 profiles are a list of tensor names.
The quantized checkpoint supplies the scales the engine keeps, which separates up_proj's row
smoothing from its scale.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import torch

from flashrl_tools import __version__
from flashrl_tools.errors import FlashRLError
from flashrl_tools.profile.build import checkpoint_format, model_ref
from flashrl_tools.profile.format import Profile, ProfileMeta
from flashrl_tools.safetensors_io import CheckpointReader


def load_flashrl_pt(path: Path):
    if not Path(path).is_file():
        raise FlashRLError("FlashRL profile not found", str(path))
    try:
        with warnings.catch_warnings():  # torch warns about the pickle protocol; our error says it all
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as e:
        raise FlashRLError(f"cannot read it as a FlashRL profile with weights_only=True "
                           f"({str(e).splitlines()[0]})", str(path),
                           "only plain tensors/dicts/lists are loaded, never arbitrary pickles") from None


def convert_flashrl_profile(pt_path: Path, quantized_dir: Path) -> Profile:
    raw = load_flashrl_pt(pt_path)
    fn = checkpoint_format(quantized_dir)
    q = CheckpointReader(quantized_dir)
    meta = dict(fn=fn.value, flashrl_tools=__version__, bf16_model=None,
                quantized_model=model_ref(quantized_dir), source="flashrl-pt")
    if not fn.calibratable:
        if not isinstance(raw, list) or not all(isinstance(n, str) for n in raw):
            raise FlashRLError("FlashRL FP8 profile must be a list of tensor names", str(pt_path))
        missing = [n for n in raw if n not in q]
        if missing:
            raise FlashRLError(f"tensor {missing[0]} of the FlashRL profile is not in the checkpoint",
                               str(quantized_dir), "convert with the checkpoint it was made from")
        return Profile(ProfileMeta(**meta, quantized=sorted(raw)))
    if not isinstance(raw, dict):
        raise FlashRLError("FlashRL INT8 profile must be a dict of tensor name -> scales", str(pt_path))
    tensors: dict[str, torch.Tensor] = {}
    quantized = []
    for name, entry in sorted(raw.items()):
        if not isinstance(entry, dict) or not {"input_scale", "output_scale"} <= set(entry):
            raise FlashRLError(f"entry {name} has no input_scale/output_scale", str(pt_path))
        if name not in q:
            raise FlashRLError(f"tensor {name} of the FlashRL profile is not in the checkpoint",
                               str(quantized_dir), "convert with the checkpoint it was made from")
        base = name.removesuffix(".weight")
        inp = _as_vector(entry["input_scale"])
        if len(q.shape(name)) == 1:  # a norm: new = w * input_scale, i.e. divided by 1/input_scale
            if inp is not None:
                tensors[f"{base}.smooth"] = 1.0 / inp
            continue
        scale = q.get(f"{name}_scale")
        quantized.append(name)
        tensors[f"{name}_scale"] = scale
        if inp is not None:
            tensors[f"{base}.smooth_in"] = inp
        out = _as_vector(entry["output_scale"])
        if out is not None:  # 1/effective scale; anything beyond the checkpoint's scale is row smoothing
            row_div = (1.0 / out) / scale.float().flatten()
            if not torch.allclose(row_div, torch.ones_like(row_div), rtol=1e-3):
                tensors[f"{base}.smooth_out"] = row_div
    groups = []  # which norm feeds which linears is not recorded by FlashRL; keep it empty
    return Profile(ProfileMeta(**meta, quantized=quantized, smoothing_groups=groups), tensors)


def _as_vector(x) -> torch.Tensor | None:
    if isinstance(x, (int, float)):
        if float(x) != 1.0:
            raise FlashRLError(f"scalar smoothing factor {x} is not supported")
        return None
    if not isinstance(x, torch.Tensor):
        raise FlashRLError(f"unexpected scale of type {type(x).__name__} in FlashRL profile")
    v = x.detach().float().flatten()
    return None if torch.all(v == 1) else v
