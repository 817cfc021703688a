"""Online quantization at engine start: the trainer's BF16 policy is quantized once per node
into $FLASHRL_HOME/online/<fingerprint>, and the engine loads that (vLLM's native
compressed-tensors path). A file lock makes concurrent workers wait for one writer. A profile
config with layers kept in BF16 (mixed precision) serves the policy re-quantized with the
profile, its kept layers in BF16 (`ensure_profile_applied`).

The quantization runs in a child process (`flashrl quantize`): it happens in vLLM's front-end
process, which then forks the engine core; torch CPU work done in the parent (its OpenMP thread
pool) makes the forked child hang on its first parallel op (seen on GPU, vLLM 0.26: pinned
buffer allocation in the engine core never returned)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from flashrl_tools import __version__
from flashrl_tools.config.settings import flashrl_home
from flashrl_tools.model_structure import has_weights
from flashrl_tools.errors import FlashRLError
from flashrl_tools.fsutil import sha256_file
from flashrl_tools.quant.mixed import KeepSpec
from flashrl_tools.quant.quantize import quantize_config_only
from flashrl_tools.quant.quantizer import QuantFn
from flashrl_tools.safetensors_io import checkpoint_files


def fingerprint(model_dir: Path, fn: QuantFn, extra: str = "") -> str:
    h = hashlib.sha256(f"{__version__}:{fn.value}:{extra}".encode())
    h.update((Path(model_dir) / "config.json").read_bytes())
    for f in checkpoint_files(Path(model_dir)) if has_weights(model_dir) else []:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def ensure_quantized(model_dir: Path, fn: QuantFn, keep: KeepSpec = KeepSpec(), pow2: bool = False) -> Path:
    tag = fn.value + ("-mixed" if keep else "") + ("-pow2" if pow2 else "")
    extra = keep.fingerprint() + (":pow2" if pow2 else "")
    out = _root() / f"{Path(model_dir).name}-{tag}-{fingerprint(model_dir, fn, extra)}"

    def build():
        if has_weights(model_dir):
            _in_child({"op": "quantize", "src": str(model_dir), "dst": str(out), "fn": fn.value,
                       "keep": keep.cli_args(), "pow2": pow2},
                      model_dir, f"online {fn.value} quantization of the policy")
        else:  # config only: the engine loads dummy weights
            quantize_config_only(model_dir, out, fn, keep, pow2)
    return _once(out, model_dir, build)


def ensure_profile_applied(model_dir: Path, profile: Path, keep: KeepSpec) -> Path:
    """The policy re-quantized with a calibrated profile, the kept layers in BF16 (smoothed as the
    profile says, so the norms that feed them stay as calibrated)."""
    from flashrl_tools.profile.format import load_profile

    fn = QuantFn.parse(load_profile(profile).meta.fn)
    extra = f"profile={sha256_file(profile)}:{keep.fingerprint()}"
    out = _root() / f"{Path(model_dir).name}-{fn.value}-profile-mixed-{fingerprint(model_dir, fn, extra)}"

    def build():
        if not has_weights(model_dir):
            raise FlashRLError("a profile config with BF16 layers needs the policy's weights", str(model_dir))
        _in_child({"op": "apply", "src": str(model_dir), "dst": str(out), "profile": str(profile),
                   "keep": keep.cli_args()}, model_dir, "re-quantizing the policy with the profile")
    return _once(out, model_dir, build)


def _root() -> Path:
    root = flashrl_home() / "online"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _once(out: Path, model_dir: Path, build) -> Path:
    with open(_root() / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").is_file():
            prune()
            build()
            (out / "flashrl_source.json").write_text(json.dumps({"bf16_model": str(Path(model_dir).resolve())}))
    return out


def prune(grace_s: float = 3600.0) -> list[Path]:
    """Remove the entries whose policy is gone (its folder deleted: a run's temporary checkpoint), built more than
    `grace_s` ago (an engine may still be loading a newer one): the cache would otherwise keep a quantized copy of
    every policy it ever served. Called under the lock, before a build; returns what it removed."""
    removed = []
    for entry in sorted(_root().iterdir()):
        source = entry / "flashrl_source.json"
        try:
            gone = not Path(json.loads(source.read_text())["bf16_model"]).is_dir()
            old = time.time() - source.stat().st_mtime > grace_s
        except (OSError, ValueError, KeyError, TypeError):  # not an entry (the lock) or one being built
            continue
        if gone and old:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _in_child(job: dict, model_dir: Path, what: str) -> None:
    res = subprocess.run([sys.executable, "-m", "flashrl_tools.runtime.core.online_cache", json.dumps(job)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        lines = res.stderr.strip().splitlines() or [f"exit code {res.returncode}"]
        raise FlashRLError(f"{what} failed: {lines[-1]}", str(model_dir))


def _child(job: dict) -> None:
    from flashrl_tools.quant.mixed import parse_keep_args

    keep = parse_keep_args(job["keep"])
    if job["op"] == "quantize":
        from flashrl_tools.quant.quantize import quantize

        quantize(Path(job["src"]), Path(job["dst"]), job["fn"], force=True, keep=keep, pow2=job.get("pow2", False))
    else:
        from flashrl_tools.profile.apply import requantize_checkpoint
        from flashrl_tools.profile.format import load_profile

        requantize_checkpoint(Path(job["src"]), load_profile(Path(job["profile"])), Path(job["dst"]), force=True,
                              keep=keep)


if __name__ == "__main__":
    try:
        _child(json.loads(sys.argv[1]))
    except FlashRLError as e:
        sys.exit(f"{e}")
