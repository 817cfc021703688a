"""Generate with a BF16 and an 8-bit checkpoint in vLLM and show them side by side.

Each engine runs in its own process (examples/vllm_probe.py). The 8-bit engine also scores the
BF16 engine's greedy tokens (teacher forcing), giving the per-token logprob gap.
Usage: python examples/compare_engines.py BF16_DIR|default QUANTIZED_DIR [--max-tokens N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from flashrl_tools.models import resolve_model

PROBE = Path(__file__).with_name("vllm_probe.py")
MESSAGES = ["What is the capital of France?", "Write a haiku about the sea.", "What is 12 + 7?"]


def run_probe(model: Path, tmp: Path, tag: str, max_tokens: int, score=None) -> dict:
    req, out = tmp / f"{tag}-req.json", tmp / f"{tag}.json"
    req.write_text(json.dumps({"messages": MESSAGES, "max_tokens": max_tokens, "score": score}))
    res = subprocess.run([sys.executable, str(PROBE), str(model), str(req), str(out)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"error: vLLM failed on {model}:\n{res.stderr[-3000:]}")
    return json.loads(out.read_text())


def _one_line(text: str) -> str:
    return text.replace("\n", "⏎")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bf16")
    ap.add_argument("quantized")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    bf16_dir, q_dir = resolve_model(args.bf16), Path(args.quantized)
    console = Console()
    with tempfile.TemporaryDirectory() as tmp, console.status("running the BF16 engine"):
        bf16 = run_probe(bf16_dir, Path(tmp), "bf16", args.max_tokens)
        q = run_probe(q_dir, Path(tmp), "q", args.max_tokens,
                      score=[g["token_ids"] for g in bf16["greedy"]])
    table = Table(title=f"BF16 vs {q_dir.name} (greedy, {args.max_tokens} tokens)")
    for col in ("prompt", "BF16", "8-bit", "equal tokens", "|Δ logp| mean / max"):
        table.add_column(col)
    for msg, a, b, scored in zip(MESSAGES, bf16["greedy"], q["greedy"], q["scored"]):
        equal = sum(x == y for x, y in zip(a["token_ids"], b["token_ids"]))
        gaps = [abs(x - y) for x, y in zip(a["logprobs"], scored)]
        table.add_row(msg, _one_line(a["text"]), _one_line(b["text"]), f"{equal}/{len(a['token_ids'])}",
                      f"{sum(gaps) / len(gaps):.3f} / {max(gaps):.3f}")
    console.print(table)


if __name__ == "__main__":
    main()
