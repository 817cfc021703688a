"""`setup(...)`: one validated config entry, written (or appended) to the patcher YAML."""

from __future__ import annotations

from pathlib import Path

import yaml

from flashrl_tools.config.defaults import DEFAULTS
from flashrl_tools.config.schema import ConfigFile, RolloutConfig, dump_config, load_config, parse_config
from flashrl_tools.errors import FlashRLError
from flashrl_tools.fsutil import atomic_write_text, sha256_file


def parse_assignments(items: list[str]) -> dict:
    """`key=value` pairs; values are YAML scalars/lists (`[a, b]`, `true`, `3`), never eval'd."""
    fields = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise FlashRLError(f"expected key=value, got {item!r}", None,
                               "e.g. distributed_executor_backend=external_launcher")
        try:
            fields[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:  # globs such as `*.o_proj` are not YAML (`*` starts an alias)
            v = value.strip()
            fields[key.strip()] = [x.strip() for x in v[1:-1].split(",") if x.strip()] if v[:1] + v[-1:] == "[]" else v
    return fields


def build_entry(fn: str, model: Path | None, profile: Path | None, extra: dict) -> RolloutConfig:
    from flashrl_tools.quant.formats import FN_ALIASES

    fn = FN_ALIASES.get(fn, fn)
    entry = dict(DEFAULTS.get(fn, {"fn": fn}))
    if model is not None:
        if not Path(model).is_dir():
            raise FlashRLError("model directory not found", str(model), "pass the 8-bit checkpoint with -m")
        entry["model"] = str(Path(model).resolve())
    if profile is not None:
        entry["profile"] = str(Path(profile).resolve())
        entry["profile_sha256"] = sha256_file(Path(profile)) if Path(profile).is_file() else None
        _check_profile(Path(profile), fn, model)
    entry.update(extra)
    return parse_config({"configs": [entry]}, "setup arguments").configs[0]


def _check_profile(profile: Path, fn: str, model: Path | None) -> None:
    """The profile must exist, match --fn and belong to the 8-bit checkpoint given with -m."""
    from flashrl_tools.profile.format import load_profile
    from flashrl_tools.safetensors_io import checkpoint_files

    meta = load_profile(profile).meta
    if meta.fn != fn:
        raise FlashRLError(f"profile is for fn {meta.fn}, not --fn {fn}", str(profile))
    if model is not None:
        files = {f.name: sha256_file(f) for f in checkpoint_files(Path(model))}
        if files != meta.quantized_model.files:
            raise FlashRLError("profile was made from another checkpoint (file hashes differ)", str(model),
                               f"use the checkpoint it was made from ({meta.quantized_model.path}) or re-profile")


def setup(output: Path, entry: RolloutConfig, append: bool = False) -> ConfigFile:
    output = Path(output)
    if append and output.exists():
        config = load_config(output)
        config.configs.append(entry)
    else:
        config = ConfigFile(configs=[entry])
    atomic_write_text(output, dump_config(config))
    return config
