"""Online quantization at engine start: the trainer's BF16 policy is quantized once per node
into $FLASHRL_HOME/online/<fingerprint>, and the engine loads that (vLLM's native
compressed-tensors path). A file lock makes concurrent workers wait for one writer.

The quantization runs in a child process (`flashrl quantize`): it happens in vLLM's front-end
process, which then forks the engine core; torch CPU work done in the parent (its OpenMP thread
pool) makes the forked child hang on its first parallel op (seen on GPU, vLLM 0.26: pinned
buffer allocation in the engine core never returned)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from flashrl_tools import __version__
from flashrl_tools.models.default import flashrl_home
from flashrl_tools.model_structure import has_weights
from flashrl_tools.errors import FlashRLError
from flashrl_tools.quantize import quantize_config_only
from flashrl_tools.quantizer import QuantFn
from flashrl_tools.safetensors_io import checkpoint_files


def fingerprint(model_dir: Path, fn: QuantFn) -> str:
    h = hashlib.sha256(f"{__version__}:{fn.value}".encode())
    h.update((Path(model_dir) / "config.json").read_bytes())
    for f in checkpoint_files(Path(model_dir)) if has_weights(model_dir) else []:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def ensure_quantized(model_dir: Path, fn: QuantFn) -> Path:
    root = flashrl_home() / "online"
    root.mkdir(parents=True, exist_ok=True)
    out = root / f"{Path(model_dir).name}-{fn.value}-{fingerprint(model_dir, fn)}"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").is_file():
            if has_weights(model_dir):
                _quantize_in_child(Path(model_dir), out, fn)
            else:  # config only: the engine loads dummy weights
                quantize_config_only(model_dir, out, fn)
            (out / "flashrl_source.json").write_text(json.dumps({"bf16_model": str(Path(model_dir).resolve())}))
    return out


def _quantize_in_child(model_dir: Path, out: Path, fn: QuantFn) -> None:
    cmd = [sys.executable, "-m", "flashrl_tools", "quantize", "-m", str(model_dir), "-o", str(out),
           "--fn", fn.value, "--force"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        lines = res.stderr.strip().splitlines() or [f"exit code {res.returncode}"]
        raise FlashRLError(f"online {fn.value} quantization of the policy failed: {lines[-1]}", str(model_dir))
