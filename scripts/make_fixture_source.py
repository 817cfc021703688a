"""Write the BF16 source of an llmcompressor bit-exactness fixture: a tiny model (Llama, or
Qwen3-MoE) whose linear and expert weights get hard cases on top of the random init (an all-zero
row, outliers, huge and tiny rows), so the comparison exercises scale rounding, the zero-scale
rule and clipping.
Usage: python make_fixture_source.py OUT_DIR [ARCH]
"""

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from flashrl_tools.models.tiny import make_tiny_model

out = Path(sys.argv[1])
arch = sys.argv[2] if len(sys.argv) > 2 else "llama"
make_tiny_model(out, arch, tied=False, seed=0, force=True)
path = out / "model.safetensors"
sd = load_file(path)
g = torch.Generator().manual_seed(1)
for name, w in sd.items():
    if not name.endswith("proj.weight"):  # attention, MLP and every expert's gate/up/down_proj
        continue
    w = w.float()
    w[0] = 0.0  # zero row -> zero-scale rule
    w[1] *= 50.0  # large row
    w[2] *= 1e-4  # tiny row (bf16 scale loses precision)
    w[3, int(torch.randint(w.shape[1], (1,), generator=g))] = 1.0  # single outlier
    w[4:8] = torch.randn(4, w.shape[1], generator=g) * torch.logspace(-3, 1, 4)[:, None]
    sd[name] = w.to(torch.bfloat16)
save_file(sd, path, metadata={"format": "pt"})
print(f"wrote {out}")
