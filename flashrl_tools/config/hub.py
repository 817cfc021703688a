"""FLASHRL_CONFIG=USER/NAME/path/config.yaml[@REV] -> a local config YAML, resolved once per node.

Under a file lock in $FLASHRL_HOME/hub, the first process of a node downloads the config
(`hf_hub_download`: HF cache, HF_HUB_OFFLINE and HF_ENDPOINT honoured), then each entry's
profile from the same commit, and a Hub `model` (USER/NAME[@REV]) with `snapshot_download`;
it checks every profile against the sha256 the config records and writes a local YAML whose
paths point into the HF cache. The other processes of the node (vLLM front end, engine core,
workers, other ranks) reuse that YAML: forever for a config pinned to a commit, for REUSE_S
seconds otherwise (a later run picks up a moved branch). The runtime then loads the local YAML
like any other, re-checking the profile hashes, so a cache file changed later is refused too.

Legacy flash-llm-rl configs (pickled `.pt` profiles) are converted only with
FLASHRL_ALLOW_LEGACY_PICKLE=1, and read with torch.load(weights_only=True).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import posixpath
import time
from pathlib import Path, PurePosixPath

from flashrl_tools.errors import FlashRLError
from flashrl_tools.fsutil import atomic_write_text, sha256_file
from flashrl_tools.config.settings import flashrl_home
from flashrl_tools.config.hub_errors import endpoint, hub_errors
from flashrl_tools.config.hubref import HubRef, parse_model_ref
from flashrl_tools.config.schema import ConfigFile, RolloutConfig, dump_config, load_config

log = logging.getLogger("flashrl_tools.runtime")
REUSE_S = 600  # how long a node reuses an unpinned resolution (one run's processes start within it)
LEGACY_ENV = "FLASHRL_ALLOW_LEGACY_PICKLE"
_PICKLES = ["*.pt", "*.pth", "*.bin", "*.pkl", "*.pickle"]  # never needed from a model repo


def resolve_hub_config(ref: HubRef) -> Path:
    root = flashrl_home() / "hub"
    root.mkdir(parents=True, exist_ok=True)
    node_dir = root / hashlib.sha256(f"{endpoint()}|{ref}".encode()).hexdigest()[:16]
    resolved, record = node_dir / "config.yaml", node_dir / "resolved.json"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if resolved.is_file() and _fresh(record, ref) and _files_present(resolved):
            return resolved
        config_file, commit = _download_config(ref)
        try:
            config = load_config(config_file)
        except FlashRLError as e:
            raise FlashRLError(e.what, str(ref), "fix the config on the Hub and publish it again") from None
        entries = [_localize(e, i, ref, commit, node_dir) for i, e in enumerate(config.configs)]
        atomic_write_text(resolved, f"# resolved from {ref} (commit {commit})\n"
                          + dump_config(ConfigFile(version=config.version, configs=entries)))
        atomic_write_text(record, json.dumps({"ref": str(ref), "endpoint": endpoint(), "commit": commit,
                                              "resolved_at": time.time()}))
        log.info("flashrl: resolved %s at commit %s -> %s", ref, commit, resolved)
        return resolved


def _fresh(record: Path, ref: HubRef) -> bool:
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return False
    return ref.pinned or time.time() - float(data.get("resolved_at", 0)) < REUSE_S


def _files_present(resolved: Path) -> bool:
    """A cleaned HF cache invalidates an earlier resolution."""
    try:
        entries = load_config(resolved).configs
    except FlashRLError:
        return False
    return all(Path(p).exists() for e in entries for p in (e.model, e.profile) if p is not None)


def _download(repo_id: str, filename: str, revision: str | None, what: str) -> Path:
    from huggingface_hub import hf_hub_download

    with hub_errors(f"downloading {what}", f"{repo_id}/{filename}" + (f"@{revision}" if revision else "")):
        return Path(hf_hub_download(repo_id, filename, revision=revision))


def _download_config(ref: HubRef) -> tuple[Path, str | None]:
    path = _download(ref.repo_id, ref.path, ref.revision, "the flashrl config")
    # the HF cache stores files as .../snapshots/<commit>/<path in repo>
    commit = path.parents[len(PurePosixPath(ref.path).parts) - 1].name
    return path, commit if len(commit) == 40 else None


def _localize(entry: RolloutConfig, i: int, ref: HubRef, commit: str | None, node_dir: Path) -> RolloutConfig:
    source = f"{ref} (entry {i})"
    update: dict = {}
    if entry.model is not None:
        update["model"] = str(_localize_model(entry.model, source))
    if entry.profile is not None:
        if entry.profile.endswith(".pt"):
            path = _legacy_profile(entry, ref, commit, update.get("model"), node_dir / f"profile-{i}.safetensors",
                                   source)
            update.update(profile=str(path), profile_sha256=sha256_file(path))  # the converted file's
        else:
            path = _download(ref.repo_id, _in_repo(ref, entry.profile, source), commit or ref.revision,
                             f"profile {entry.profile}")
            _check_sha(path, entry, source)  # so the recorded sha256 stays right
            update["profile"] = str(path)
    return entry.model_copy(update=update)


def _in_repo(ref: HubRef, relative: str, source: str) -> str:
    """A profile reference of a published config: relative to the config's folder in the repo."""
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(ref.path), relative))
    if posixpath.isabs(relative) or joined.split("/")[0] == "..":
        raise FlashRLError(f"profile {relative!r} is outside the repo", source,
                           "a published config names its profiles relative to itself (`flashrl publish` does)")
    return joined


def _check_sha(path: Path, entry: RolloutConfig, source: str) -> None:
    if entry.profile_sha256 is None:
        raise FlashRLError(f"the config records no sha256 for profile {entry.profile}", source,
                           "re-publish it with `flashrl publish`, which records one")
    digest = sha256_file(path)
    if digest != entry.profile_sha256:
        raise FlashRLError(f"profile {entry.profile} does not match the sha256 the config records "
                           f"(config {entry.profile_sha256[:12]}…, file {digest[:12]}…): refusing to start",
                           source, "the profile changed after publishing: re-publish with `flashrl publish`, "
                                   "or pin a revision (@<commit>) whose files match")


def _localize_model(model: str, source: str) -> Path:
    if Path(model).expanduser().is_absolute():
        return Path(model).expanduser()  # a shared filesystem; check_entry verifies it is there
    ref = parse_model_ref(model)
    if ref is None:
        raise FlashRLError(f"`model: {model}` of a Hub config is neither an absolute path nor a Hub repo",
                           source, "use USER/NAME[@REVISION] of the 8-bit checkpoint (flashrl publish --model-repo)")
    from huggingface_hub import snapshot_download

    with hub_errors("downloading the model", str(ref)):
        return Path(snapshot_download(ref.repo_id, revision=ref.revision, ignore_patterns=_PICKLES))


def _legacy_profile(entry: RolloutConfig, ref: HubRef, commit: str | None, model_dir: str | None,
                    out: Path, source: str) -> Path:
    from flashrl_tools.config.settings import settings

    if not settings().allow_legacy_pickle:
        raise FlashRLError(
            f"profile {entry.profile} is a flash-llm-rl pickle (.pt); unpickling a file downloaded from the Hub "
            "can run arbitrary code, so it is not loaded by default", source,
            f"set {LEGACY_ENV}=1 to convert it (read with torch.load(weights_only=True): tensors and plain "
            "containers only), or convert it once with `flashrl profile --from-flashrl` and `flashrl publish` it")
    if model_dir is None:
        raise FlashRLError(f"legacy profile {entry.profile} needs the config's `model`", source)
    parts = entry.profile.split("/")
    if len(parts) >= 3:  # flash-llm-rl names its profiles USER/NAME/path/profile.pt on the Hub
        pt = _download("/".join(parts[:2]), "/".join(parts[2:]), None, f"legacy profile {entry.profile}")
    else:
        pt = _download(ref.repo_id, _in_repo(ref, entry.profile, source), commit or ref.revision,
                       f"legacy profile {entry.profile}")
    if entry.profile_sha256 is not None:
        _check_sha(pt, entry, source)
    from flashrl_tools.profile.format import save_profile
    from flashrl_tools.profile.legacy import convert_flashrl_profile

    log.warning("flashrl: converting legacy pickled profile %s (%s=1, weights_only=True)", entry.profile, LEGACY_ENV)
    save_profile(convert_flashrl_profile(pt, Path(model_dir)), out)
    return out
