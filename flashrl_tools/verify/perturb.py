"""A stand-in for an optimizer step: a BF16 checkpoint with some tensors randomly perturbed."""

from __future__ import annotations

from pathlib import Path

import torch

from flashrl_tools.safetensors_io import CheckpointReader, PlannedTensor, write_checkpoint

LINEARS = ("proj.weight",)
# every trained weight: linears, MoE experts and routers (Mixtral's w1/w2/w3, gate), embeddings and
# norms (a tied lm_head and SmoothQuant-rescaled norms must follow a sync)
ALL_TRAINED = (".weight",)


def perturb(src: Path, dst: Path, rel: float = 0.05, seed: int = 0, match: tuple[str, ...] = LINEARS) -> Path:
    """Tensors whose name ends with `match` multiplied entrywise by (1 + rel * N(0, 1)); the
    others, and the config/tokenizer files, copied."""
    src, dst = Path(src), Path(dst)
    reader = CheckpointReader(src)
    g = torch.Generator().manual_seed(seed)
    plan = [PlannedTensor(n, reader.shape(n), reader.dtype(n)) for n in reader.names()]

    def produce():
        for n, t in reader.iter_tensors():
            if n.endswith(match):
                t = (t.float() * (1 + rel * torch.randn(t.shape, generator=g))).to(t.dtype)
            yield n, t

    dst.mkdir(parents=True)
    write_checkpoint(dst, plan, produce)
    for f in src.iterdir():
        if f.suffix in (".json", ".jinja", ".txt", ".model") and f.name != "flashrl_manifest.json":
            (dst / f.name).write_bytes(f.read_bytes())
    return dst
