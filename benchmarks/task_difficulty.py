"""How hard each task level of examples/arith_task.py is for a model before any training (issue 44 picks the
level at which BF16 GRPO starts at <= 0.2 and has room to climb): on the held-out split (the seed verl's data
script gives the test split), chat template applied as verl's agent loop applies it, a BF16 engine
(FLASHRL_CONFIG unset), greedy accuracy and, with `--samples` rollouts per prompt at T=1, the mean reward and
the fraction of prompts with at least one rewarded rollout (a GRPO group with no reward and no variance
teaches nothing). Prints a table, writes JSON.

    python benchmarks/task_difficulty.py --levels add1,add2c,add3c,mul21 --json benchmarks/results/task_difficulty.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))

import arith_task  # noqa: E402


def measure(model: str, levels: list[str], prompts: int, samples: int, seed: int, max_tokens: int) -> list[dict]:
    os.environ.pop("FLASHRL_CONFIG", None)
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(model)
    llm = LLM(model=model, dtype="bfloat16", max_model_len=256, seed=seed, enable_prefix_caching=False)
    rows = []
    for level in levels:
        qs = arith_task.questions(prompts, seed + 1, level)  # arith_data.py's test split
        ids = [tok.apply_chat_template([{"role": "user", "content": q["question"]}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for q in qs]
        inputs = [{"prompt_token_ids": list(map(int, x))} for x in ids]
        greedy = llm.generate(inputs, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        sampled = llm.generate(inputs, SamplingParams(temperature=1.0, max_tokens=max_tokens, n=samples),  # engine seed
                               use_tqdm=False)
        g = [arith_task.score(o.outputs[0].text, q["answer"], level) for o, q in zip(greedy, qs)]
        s = [[arith_task.score(c.text, q["answer"], level) for c in o.outputs] for o, q in zip(sampled, qs)]
        rows.append({"level": level, "prompts": prompts, "samples": samples, "greedy_accuracy": sum(g) / len(g),
                     "sampled_mean_reward": sum(map(sum, s)) / (len(s) * samples),
                     "prompts_with_a_reward": sum(any(x) for x in s) / len(s),
                     "example": {"question": qs[0]["question"], "answer": qs[0]["answer"],
                                 "greedy": greedy[0].outputs[0].text[:120]}})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--levels", default=",".join(arith_task.LEVELS))
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--samples", type=int, default=8, help="rollouts per prompt at T=1 (a GRPO group)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0, help="arith_data.py's seed (the test split uses seed + 1)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    levels = a.levels.split(",")
    unknown = [lv for lv in levels if lv not in arith_task.LEVELS]
    if unknown:
        sys.exit(f"task_difficulty: unknown level(s) {', '.join(unknown)}: use {', '.join(arith_task.LEVELS)}")
    if a.model is None:
        from flashrl_tools.models.default import ensure_default_model

        a.model = str(ensure_default_model())
    rows = measure(a.model, levels, a.prompts, a.samples, a.seed, a.max_tokens)
    print(f"\nTask levels before training ({Path(a.model).name}, {a.prompts} held-out prompts, BF16)")
    print(f"{'level':7} {'greedy':>7} {'T=1 mean':>9} {f'>=1 of {a.samples}':>9}  example")
    for r in rows:
        ex = r["example"]
        print(f"{r['level']:7} {r['greedy_accuracy']:7.3f} {r['sampled_mean_reward']:9.3f} "
              f"{r['prompts_with_a_reward']:9.3f}  {ex['question']} -> {ex['greedy']!r} ({ex['answer']})")
    if a.json:
        import torch

        from flashrl_tools.fsutil import atomic_write_text

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
        atomic_write_text(a.json, json.dumps({"model": a.model, "device": device, "settings": vars(a), "rows": rows},
                                             indent=1))


if __name__ == "__main__":
    main()
