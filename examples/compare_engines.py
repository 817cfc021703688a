"""Generate with a BF16 and an 8-bit checkpoint in vLLM and show them side by side.

Each engine runs in its own process (`flashrl_tools.verify.engines.run_engine`, the engine job `flashrl
verify` uses). The 8-bit engine also scores the BF16 engine's greedy tokens (teacher forcing), giving
the per-token logprob gap.
Usage: python examples/compare_engines.py BF16_DIR|default QUANTIZED_DIR [--max-tokens N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from flashrl_tools.errors import FlashRLError
from flashrl_tools.models import resolve_model
from flashrl_tools.verify.engines import run_engine

MESSAGES = ["What is the capital of France?", "Write a haiku about the sea.", "What is 12 + 7?"]


def _one_line(text: str) -> str:
    return text.replace("\n", "⏎")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bf16")
    ap.add_argument("quantized")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    bf16_dir, q_dir = resolve_model(args.bf16), Path(args.quantized)
    tok = AutoTokenizer.from_pretrained(bf16_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for m in MESSAGES]
    greedy = {"op": "sample", "prompts": prompts, "temperature": 0.0, "max_tokens": args.max_tokens}
    console = Console()
    try:
        with console.status("running the BF16 engine"):
            bf16 = run_engine(bf16_dir, [greedy], None, "BF16")[0]["rollouts"]
        continued = [p + r["token_ids"] for p, r in zip(prompts, bf16)]
        with console.status("running the 8-bit engine"):
            q, scored = run_engine(q_dir, [greedy, {"op": "observe", "sequences": continued, "max_tokens": 1}],
                                   None, "8-bit")
    except FlashRLError as e:
        sys.exit(f"error: {e}")
    table = Table(title=f"BF16 vs {q_dir.name} (greedy, {args.max_tokens} tokens)")
    for col in ("prompt", "BF16", "8-bit", "equal tokens", "|Δ logp| mean / max"):
        table.add_column(col)
    for msg, p, a, b, lps in zip(MESSAGES, prompts, bf16, q["rollouts"], scored["logprobs"]):
        equal = sum(x == y for x, y in zip(a["token_ids"], b["token_ids"]))
        gaps = [abs(x - y) for x, y in zip(a["logprobs"], lps[len(p) - 1:])]  # the continuation's positions
        table.add_row(msg, _one_line(tok.decode(a["token_ids"])), _one_line(tok.decode(b["token_ids"])),
                      f"{equal}/{len(a['token_ids'])}", f"{sum(gaps) / len(gaps):.3f} / {max(gaps):.3f}")
    console.print(table)


if __name__ == "__main__":
    main()
