"""What `flashrl publish` uploads, computed without touching the network (so --dry-run shows it):
the config YAML with profile references rewritten relative to it, the profile files beside it,
and a model-card README."""

from __future__ import annotations

import hashlib
import posixpath
from dataclasses import dataclass, field
from pathlib import Path

from flashrl_tools import __version__
from flashrl_tools.errors import FlashRLError
from flashrl_tools.config.hubref import is_repo_id, parse_model_ref
from flashrl_tools.config.schema import ConfigFile, RolloutConfig, dump_config, load_config


@dataclass(frozen=True)
class Upload:
    path_in_repo: str
    sha256: str
    size: int
    data: bytes  # what is uploaded


@dataclass
class Bundle:
    repo_id: str
    config_path: str  # path of the config YAML in the repo
    config: ConfigFile  # as published (repo-relative profiles)
    uploads: list[Upload] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def line(self, commit: str | None) -> str:
        """The FLASHRL_CONFIG line users copy (pinned when the commit is known)."""
        return f"FLASHRL_CONFIG={self.repo_id}/{self.config_path}" + (f"@{commit}" if commit else "")


def _generated(path: str, data: bytes) -> Upload:
    return Upload(path, hashlib.sha256(data).hexdigest(), len(data), data)


def _check_dir(path_in_repo: str) -> str:
    d = posixpath.normpath(path_in_repo.strip("/") or ".")
    if d.split("/")[0] == ".." or "\\" in d:
        raise FlashRLError(f"invalid --path-in-repo {path_in_repo!r}", None, "use a folder like 'configs/int8'")
    return "" if d == "." else d


def build_bundle(config_path: Path, repo_id: str, path_in_repo: str = "", model_repo: str | None = None) -> Bundle:
    """Validate the local config (files exist, hashes match) and lay out the upload."""
    from flashrl_tools.config.resolve import check_entry, resolve_relative

    if not is_repo_id(repo_id):
        raise FlashRLError(f"invalid --repo {repo_id!r}", None, "expected USER/NAME")
    if model_repo is not None and parse_model_ref(model_repo) is None:
        raise FlashRLError(f"invalid --model-repo {model_repo!r}", None, "expected USER/NAME or USER/NAME@REVISION")
    config_path = Path(config_path).expanduser()
    config = load_config(config_path)
    local_entries = [resolve_relative(e, config_path.parent) for e in config.configs]  # paths as on this machine
    checkpoints = {e.model for e in local_entries if e.model}
    if model_repo is not None and len(checkpoints) > 1:
        raise FlashRLError(f"--model-repo names one checkpoint but the config's entries use {len(checkpoints)}",
                           str(config_path), "publish one config per checkpoint")
    folder = _check_dir(path_in_repo)
    join = (lambda name: f"{folder}/{name}") if folder else (lambda name: name)
    bundle = Bundle(repo_id, join(config_path.name), config)
    names: dict[str, str] = {}  # profile file name in the repo -> sha256
    entries: list[RolloutConfig] = []
    for i, (entry, local) in enumerate(zip(config.configs, local_entries)):
        check_entry(local, f"{config_path} (entry {i})")
        update: dict = {}
        if local.profile is not None:
            src = Path(local.profile)
            data = src.read_bytes()  # hashed and uploaded from the same bytes
            digest = hashlib.sha256(data).hexdigest()
            name = src.name
            if names.get(name, digest) != digest:  # same name, other content: keep both
                name = f"{src.stem}-{i}{src.suffix}"
            if name not in names:
                names[name] = digest
                bundle.uploads.append(Upload(join(name), digest, len(data), data))
            update.update(profile=name, profile_sha256=digest)
        if local.model is not None:
            if model_repo is not None:
                update["model"] = model_repo
            else:
                update["model"] = local.model
                bundle.warnings.append(
                    f"entry {i}: `model` stays the local path {local.model}: every node must have the "
                    "checkpoint there (shared filesystem); pass --model-repo USER/NAME[@REV] if it is on the Hub")
        entries.append(entry.model_copy(update=update))
    bundle.config = ConfigFile(version=config.version, configs=entries)
    bundle.uploads.insert(0, _generated(bundle.config_path, dump_config(bundle.config).encode()))
    bundle.uploads.append(_generated(join("README.md"), model_card(bundle, local_models(config)).encode()))
    return bundle


def local_models(config: ConfigFile) -> list[str]:
    """A readable name for each entry's model (the checkpoint folder name, or the policy)."""
    return [Path(e.model).name if e.model else "the trainer's policy" for e in config.configs]


def _layers(entry) -> str:
    """The layers an entry serves in another format than its fn's: BF16 ones, 4-bit ones (drift a reader must see)."""
    bf16 = [f"`{g}`" for g in entry.keep_bf16] + [f"first {entry.first_layers_bf16}"] * bool(entry.first_layers_bf16) \
        + [f"last {entry.last_layers_bf16}"] * bool(entry.last_layers_bf16)
    parts = ([f"BF16: {', '.join(bf16)}"] if bf16 else []) + \
        ([f"4-bit (W4A16): {', '.join(f'`{g}`' for g in entry.w4a16_layers)}"] if entry.w4a16_layers else [])
    return "; ".join(parts) or "none"


def model_card(bundle: Bundle, model_names: list[str]) -> str:
    rows = []
    for i, (entry, name) in enumerate(zip(bundle.config.configs, model_names)):
        profile = f"`{entry.profile}` (sha256 `{entry.profile_sha256[:16]}…`)" if entry.profile else "none"
        rows.append(f"| {i} | `{entry.fn.value}` | {name} | {profile} | {_layers(entry)} |")
    hub_models = [parse_model_ref(e.model) for e in bundle.config.configs if e.model]
    models = sorted({ref.repo_id for ref in hub_models if ref is not None})
    fns = sorted({e.fn.value for e in bundle.config.configs})
    return "\n".join([
        "---",
        "library_name: flashrl_tools",
        f"tags: [flashrl, rl, vllm, quantization, {', '.join(fns)}]",
        *([f"base_model: {models[0]}"] if len(models) == 1 else []),
        "---",
        "",
        f"# flashrl rollout config: {', '.join(sorted(set(model_names)))}",
        "",
        "8-bit rollouts in vLLM for RL training, with online re-quantization of every weight sync.",
        f"Published with flashrl_tools {__version__}.",
        "",
        "| entry | fn | model | profile | other layers |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "## Use",
        "",
        "Set this on every node of the run (vLLM picks it up through the flashrl_tools plugin):",
        "",
        "```bash",
        "pip install flashrl_tools",
        f"export {bundle.line('<commit>')}",
        "```",
        "",
        "`<commit>` is the sha of the commit that published this config: `flashrl publish` prints the",
        "complete line, and the repo's history shows it. Pinned, every node resolves exactly these",
        "files; without `@<commit>` the config follows the branch. Profile files are checked against the",
        "sha256 recorded in the config before the engine starts.",
        "",
    ])
