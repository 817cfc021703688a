"""FLASHRL_CONFIG -> one validated rollout config, or a clear refusal. No vLLM imports here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import get_args

from flashrl_tools.config.defaults import DEFAULTS
from flashrl_tools.config.hubref import parse_config_ref
from flashrl_tools.config.schema import ConfigFn, RolloutConfig, load_config, parse_config
from flashrl_tools.config.settings import settings
from flashrl_tools.errors import FlashRLError
from flashrl_tools.fsutil import sha256_file

ENV = "FLASHRL_CONFIG"
SHORTCUTS = ("bf16", "fp8", "int8", "w4a16")
ALLOWED = ("bf16 | fp8 | int8 | w4a16 | a config.yaml written by `flashrl setup` | "
           "USER/REPO/path/config.yaml[@REVISION] (Hugging Face Hub)")


@dataclass(frozen=True)
class RuntimeConfig:
    entry: RolloutConfig
    source: str  # what FLASHRL_CONFIG said
    lmhead_fp32: bool = False  # FLASHRL_LMHEAD_FP32: lm_head and logits in fp32

    @property
    def fn(self) -> ConfigFn:
        return self.entry.fn


def from_env() -> RuntimeConfig | None:
    """The config FLASHRL_CONFIG asks for; None when it is unset or empty (the runtime off)."""
    value = settings().config
    return resolve(value) if value else None


KV_ENV = "FLASHRL_KV_CACHE_DTYPE"


def resolve(value: str) -> RuntimeConfig:
    from dataclasses import replace

    rc = _resolve(value)
    s = settings()
    kv = s.kv_cache_dtype
    if kv:  # adds the KV-cache dtype to any config (shortcut, YAML, Hub)
        allowed = get_args(get_args(RolloutConfig.model_fields["kv_cache_dtype"].annotation)[0])
        if kv not in allowed:
            raise FlashRLError(f"invalid {KV_ENV}={kv!r}", None, f"allowed: {' | '.join(allowed)}, or unset")
        rc = replace(rc, entry=rc.entry.model_copy(update={"kv_cache_dtype": kv}))
    return replace(rc, lmhead_fp32=s.lmhead_fp32)


def _resolve(value: str) -> RuntimeConfig:
    if value in SHORTCUTS:
        entry = parse_config({"configs": [DEFAULTS[value]]}, f"{ENV}={value}").configs[0]
        return RuntimeConfig(entry, value)
    path = Path(value).expanduser()
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return RuntimeConfig(_entry_from_yaml(path, str(path)), value)
    ref = parse_config_ref(value)
    if ref is not None and not path.exists():
        from flashrl_tools.config.hub import resolve_hub_config

        return RuntimeConfig(_entry_from_yaml(resolve_hub_config(ref), value), value)
    raise FlashRLError(f"invalid {ENV}={value!r}" + (" (file not found)" if path.suffix in (".yaml", ".yml") else ""),
                       None, f"allowed: {ALLOWED}")


def _entry_from_yaml(path: Path, source: str) -> RolloutConfig:
    config = load_config(path)
    raw = settings().config_index
    index = int(raw) if raw.isdigit() else -1
    if not 0 <= index < len(config.configs):
        raise FlashRLError(f"FLASHRL_CONFIG_INDEX={raw} but the config has "
                           f"{len(config.configs)} entries", source,
                           f"set it to 0..{len(config.configs) - 1}, or unset it")
    entry = resolve_relative(config.configs[index], path.parent)
    check_entry(entry, source)
    return entry


def resolve_relative(entry: RolloutConfig, base: Path) -> RolloutConfig:
    """Relative `model` / `profile` paths are relative to the YAML file."""
    update = {}
    for key in ("model", "profile"):
        value = getattr(entry, key)
        if value is not None and not Path(value).expanduser().is_absolute():
            update[key] = str((base / value).resolve())
    return entry.model_copy(update=update)


def check_entry(entry: RolloutConfig, source: str) -> None:
    """Files exist and belong together: the engine must not start on a half-valid config."""
    if entry.model is not None and not (Path(entry.model) / "config.json").is_file():
        raise FlashRLError(f"config `model` is not a model directory: {entry.model}", source,
                           "point `model` at the 8-bit checkpoint the profile was made from")
    if entry.profile is None:
        return
    from flashrl_tools.checkpoint_files import checkpoint_files
    from flashrl_tools.profile.format import read_meta

    profile_path = Path(entry.profile)
    if not profile_path.is_file():
        raise FlashRLError(f"profile file not found: {profile_path}", source, "run `flashrl profile`")
    if entry.profile_sha256 and sha256_file(profile_path) != entry.profile_sha256:
        raise FlashRLError(f"profile {profile_path} does not match the sha256 recorded in the config", source,
                           "the file changed since `flashrl setup`: re-run setup or restore the file")
    meta = read_meta(profile_path)
    if meta.fn != entry.fn.value:
        raise FlashRLError(f"profile is for fn {meta.fn} but the config says fn {entry.fn.value}", source)
    files = {f.name: sha256_file(f) for f in checkpoint_files(Path(entry.model))}
    if files != meta.quantized_model.files:
        raise FlashRLError(f"profile {profile_path} was made for another checkpoint than {entry.model}",
                           source, "use the checkpoint it was profiled against, or re-run `flashrl profile`")
