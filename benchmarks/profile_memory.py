"""Wall time and peak RSS of `flashrl profile` on a pair of 7B-shaped checkpoints.

Builds, from random weights on disk, a BF16 Qwen2.5-7B-shaped checkpoint and a SmoothQuant-style
W8A8 checkpoint of it (random bf16 smoothing factors on every q/k/v, gate/up and down<-up group,
then RTN with our quantizer), both sharded per layer. Then profiles the pair in a fresh process
and reads its peak RSS (VmHWM). Goal: < 2 GiB. Prints a table and writes JSON.

    python benchmarks/profile_memory.py                  # Qwen2.5-7B shapes (~23 GB on disk)
    python benchmarks/profile_memory.py --preset small   # seconds; what CI runs
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from flashrl_tools.quant.quant_config import quantization_config
from flashrl_tools.quant.quantizer import QuantFn, quantize_weight, smooth_norm, smooth_weight

PRESETS = {
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064),
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=4096),
}
GOAL_BYTES = 2 << 30


def build_pair(root: Path, shape: dict, seed: int = 0) -> tuple[Path, Path]:
    from transformers import Qwen2Config

    g = torch.Generator().manual_seed(seed)
    bf16_dir, q_dir = root / "bf16", root / "w8a8"
    bf16_dir.mkdir()
    q_dir.mkdir()
    cfg = Qwen2Config(**shape, tie_word_embeddings=False, torch_dtype="bfloat16")
    cfg.save_pretrained(bf16_dir)
    cfg.quantization_config = quantization_config(QuantFn.int8)
    cfg.save_pretrained(q_dir)
    h, inter, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]

    def rnd(*s):
        return (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)

    def factors(dim):
        return torch.exp(0.5 * torch.randn(dim, generator=g)).to(torch.bfloat16).float()

    shards = n + 1
    wmap_b, wmap_q = {}, {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        b, q = {}, {}
        if i == n:  # embeddings, final norm, lm_head
            b["model.embed_tokens.weight"] = rnd(shape["vocab_size"], h)
            b["lm_head.weight"] = rnd(shape["vocab_size"], h)
            b["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
            q.update(b)
        else:
            p = f"model.layers.{i}."
            lin = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                   "self_attn.o_proj": (h, h), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
                   "mlp.down_proj": (h, inter)}
            for name, s in lin.items():
                b[f"{p}{name}.weight"] = rnd(*s)
            for bias in ("q", "k", "v"):
                b[f"{p}self_attn.{bias}_proj.bias"] = rnd(lin[f"self_attn.{bias}_proj"][0])
            for norm in ("input_layernorm", "post_attention_layernorm"):
                b[f"{p}{norm}.weight"] = (1 + rnd(h)).to(torch.bfloat16)
            m_attn, m_mlp, m_down = factors(h), factors(h), factors(inter)
            col = {"self_attn.q_proj": m_attn, "self_attn.k_proj": m_attn, "self_attn.v_proj": m_attn,
                   "mlp.gate_proj": m_mlp, "mlp.up_proj": m_mlp, "mlp.down_proj": m_down}
            for name in lin:
                w = smooth_weight(b[f"{p}{name}.weight"], col.get(name),
                                  m_down if name == "mlp.up_proj" else None)
                qw = quantize_weight(QuantFn.int8, w)
                q[f"{p}{name}.weight"], q[f"{p}{name}.weight_scale"] = qw.weight, qw.weight_scale
            q[f"{p}input_layernorm.weight"] = smooth_norm(b[f"{p}input_layernorm.weight"], m_attn)
            q[f"{p}post_attention_layernorm.weight"] = smooth_norm(b[f"{p}post_attention_layernorm.weight"], m_mlp)
            for k, v in b.items():
                if k.endswith(".bias"):
                    q[k] = v
        save_file(b, bf16_dir / fname, metadata={"format": "pt"})
        save_file(q, q_dir / fname, metadata={"format": "pt"})
        wmap_b.update({k: fname for k in b})
        wmap_q.update({k: fname for k in q})
        del b, q
    for d, wmap in ((bf16_dir, wmap_b), (q_dir, wmap_q)):
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    return bf16_dir, q_dir


PROFILE_RUN = """
import json, sys, time
t = time.perf_counter()
from flashrl_tools.profile.build import build_profile
from flashrl_tools.profile.format import save_profile
r = build_profile(sys.argv[1], sys.argv[2], "int8")
save_profile(r.profile, sys.argv[3])
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"peak_rss_bytes": hwm, "wall_s": time.perf_counter() - t, "summary": r.summary()}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="7b")
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/profile_memory/profile_memory.json"))
    ap.add_argument("--workdir", type=Path, default=None, help="where to build the pair (needs ~23 GB for 7b)")
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    console = Console()
    root = Path(tempfile.mkdtemp(prefix="profile-mem-", dir=args.workdir))
    try:
        t0 = time.perf_counter()
        with console.status(f"building a {args.preset} checkpoint pair in {root}"):
            bf16, q = build_pair(root, PRESETS[args.preset])
        build_s = time.perf_counter() - t0
        size = sum(f.stat().st_size for d in (bf16, q) for f in d.glob("*.safetensors"))
        with console.status("profiling (fresh process)"):
            res = subprocess.run([sys.executable, "-c", PROFILE_RUN, str(bf16), str(q), str(root / "p.safetensors")],
                                 capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"error: profile run failed:\n{res.stderr[-3000:]}")
        m = json.loads(res.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {"preset": args.preset, "shape": PRESETS[args.preset], "checkpoint_pair_bytes": size,
              "build_s": round(build_s, 1), "profile_wall_s": round(m["wall_s"], 1),
              "peak_rss_bytes": m["peak_rss_bytes"], "goal_bytes": GOAL_BYTES,
              "within_goal": m["peak_rss_bytes"] < GOAL_BYTES,
              "exact_fraction": m["summary"]["exact_fraction"], "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d")}
    table = Table(title=f"flashrl profile, {args.preset} shapes (Qwen2 layout, synthetic SmoothQuant W8A8)")
    for col in ("checkpoint pair", "profile wall time", "peak RSS", "goal", "INT8 exact"):
        table.add_column(col, justify="right")
    table.add_row(f"{size / 2**30:.1f} GiB", f"{m['wall_s']:.1f} s", f"{m['peak_rss_bytes'] / 2**30:.2f} GiB",
                  "< 2 GiB " + ("ok" if result["within_goal"] else "MISSED"), f"{100 * result['exact_fraction']:.4f}%")
    console.print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
