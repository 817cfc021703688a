"""Which safetensors files make up a model directory (through its index when sharded), without torch: config
validation (`resolve`, `publish`) lists and hashes them in processes that load no tensor."""

from __future__ import annotations

import json
from pathlib import Path

from flashrl_tools.errors import FlashRLError

INDEX_NAME = "model.safetensors.index.json"


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory (via its index when sharded)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FlashRLError("model directory not found", str(model_dir),
                           "pass a directory holding config.json and *.safetensors, or 'default'")
    index = model_dir / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise FlashRLError(f"unreadable safetensors index ({e})", str(index),
                               "re-save the checkpoint with save_pretrained") from None
        files = [model_dir / n for n in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FlashRLError("shard listed in the index is missing", missing[0],
                               "download or copy the complete checkpoint")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FlashRLError("no *.safetensors weights found", str(model_dir),
                           "convert the model to safetensors (save_pretrained(safe_serialization=True))")
    return files
