"""After a verl run of examples/verl/run_grpo_smollm2.sh (or run_fully_async_smollm2.sh): does the rollout
engine equal a fresh engine started on the trainer's final weights?

    FLASHRL_CONFIG=int8 python examples/verl/final_check.py runs/verl verl-int8-s0
    FLASHRL_CONFIG=int8 python examples/verl/final_check.py runs/verl-async async-int8-s0 --last-sync

`--last-sync` (the fully-async trainer: no validation dumps, and its rollouter's syncs are not numbered
by trainer steps): the digest of the engine's last sync (the trainer pushes its final weights before it
saves them) against the fresh engine's; the greedy comparison with verl's outputs is skipped. With
FLASHRL_KV_CACHE_DTYPE set the attention layers' KV scales are left out of the comparison (the engine
wrote its digest right after the sync, before recalibrating them; tests/gpu/ compare the recalibrated
scales with a fresh engine's).

The recipe (with FINAL_CHECK=1) saves the actor's weights as an HF model (verl's checkpoint,
`save_contents=['hf_model']`, at the last step, or at the latest CHECK_EVERY step of a run cut
short), lets the runtime write the rollout engine's weight digest after every sync
(`FLASHRL_SYNC_DIGEST`, runtime/vllm/digest.py) and dumps the greedy validation generations verl's
engine produced right after the sync of those weights. This script
starts a fresh vLLM engine with the same FLASHRL_CONFIG on the saved model and compares:
- the digest: sha1 of every parameter, buffer and kernel-held tensor (equal = same bits);
- greedy generations of the same validation prompts: identical texts (of how many), and the fresh
  engine against itself with the prompts in batches of 5 (a format whose outputs depend on the
  batch differs there too: FP8 per-tensor activation scales).
The result is appended to the run's log as {"final_check": {...}} (benchmarks/rl_curves.py reads
it) and printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path


def partial_rollouts(log: Path) -> int | None:
    """Sum of verl's `fully_async/partial/total_partial_num` over the run's log (None: not a fully-async run)."""
    if not log.is_file():
        return None
    key = "fully_async/partial/total_partial_num"
    rows = map(json.loads, filter(str.strip, log.read_text().splitlines()))
    counts = [row["data"][key] for row in rows if key in row.get("data", {})]
    return int(sum(counts)) if counts else None


def latest(paths, what: str) -> Path:
    found = sorted(paths, key=lambda p: int("".join(c for c in p.stem.split("_")[-1] if c.isdigit()) or 0))
    if not found:
        sys.exit(f"final_check: no {what} found; run the recipe with FINAL_CHECK=1")
    return found[-1]


def val_prompts(tokenizer, parquet: Path) -> list[list[int]]:
    """The validation prompts as verl's agent loop tokenizes them (chat template, generation prompt)."""
    import pandas as pd

    return [[int(t) for t in tokenizer.apply_chat_template([dict(m) for m in p], add_generation_prompt=True,
                                                            tokenize=True, return_dict=False)]
            for p in pd.read_parquet(parquet)["prompt"]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the recipe's OUT directory")
    ap.add_argument("run", help="the run's name, e.g. verl-int8-s0")
    ap.add_argument("--max-tokens", type=int, default=32, help="the recipe's max_response_length")
    ap.add_argument("--data", type=Path, default=None, help="the run's data directory (default OUT/data; "
                    "OUT/data-LEVEL for a LEVEL other than add1)")
    ap.add_argument("--last-sync", action="store_true", help="compare with the engine's last sync, without "
                    "verl's validation outputs (the fully-async recipe)")
    a = ap.parse_args(argv)
    if not os.environ.get("FLASHRL_CONFIG"):
        sys.exit("final_check: set FLASHRL_CONFIG to the run's config")
    step_dir = latest((a.out / f"ckpt-{a.run}").glob("global_step_*"), "checkpoint")
    step = int(step_dir.name.rsplit("_", 1)[1])
    ckpt = step_dir / "actor" / "huggingface"
    if a.last_sync:
        digest_file = latest((a.out / f"digest-{a.run}").glob("tp0-sync*.json"), "engine digest")
        val_file = None
    else:  # verl syncs once before step 1 and once after every update: step k's weights are sync k + 1
        digest_file = a.out / f"digest-{a.run}" / f"tp0-sync{step + 1}.json"
        val_file = a.out / f"val-{a.run}" / f"{step}.jsonl"  # verl's validation right after that sync
    for f in (digest_file, val_file):
        if f is not None and not f.is_file():
            sys.exit(f"final_check: {f} is missing (the checkpoint is of step {step})")
    run_digest = json.loads(digest_file.read_text())
    verl_rows = [] if val_file is None else [json.loads(x) for x in val_file.read_text().splitlines() if x.strip()]
    verl_outputs = {row["input"]: row["output"] for row in verl_rows}  # verl decodes both, specials skipped

    from vllm import LLM, SamplingParams

    from flashrl_tools.runtime.core.digest import compare, is_kv_scale

    llm = LLM(model=str(ckpt), dtype="bfloat16", gpu_memory_utilization=0.1, kv_cache_memory_bytes=1 << 30,
              max_model_len=256, seed=0)
    fresh = llm.collective_rpc("flashrl_digest")[0]
    kv_scales = sorted(n for n in set(run_digest["digest"]) | set(fresh) if os.environ.get("FLASHRL_KV_CACHE_DTYPE")
                       and is_kv_scale(n))
    diff = compare({n: d for n, d in run_digest["digest"].items() if n not in kv_scales},
                   {n: d for n, d in fresh.items() if n not in kv_scales})
    fresh_small, run_small = llm.collective_rpc("flashrl_small_values")[0], run_digest.get("small", {})
    values = {n: {"engine": run_small[n], "fresh": fresh_small[n]} for n in diff["differ"]
              if n in run_small and n in fresh_small}
    print("digest:", {k: v if k == "tensors" else len(v) for k, v in diff.items()}, flush=True)
    tok = llm.get_tokenizer()
    prompts = val_prompts(tok, (a.data or a.out / "data") / "test.parquet")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=a.max_tokens))
    ours = {tok.decode(p, skip_special_tokens=True): tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)
            for p, o in zip(prompts, outs)}
    matched = [k for k in ours if k in verl_outputs]
    same = sum(ours[k] == verl_outputs[k] for k in matched)
    # The same engine, the same prompts in batches of 5: where even this differs, the format's
    # outputs depend on the batch (FP8 per-tensor activation scales are one max over the batch)
    chunked = [o for i in range(0, len(prompts), 5)
               for o in llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + 5]],
                                     SamplingParams(temperature=0.0, max_tokens=a.max_tokens))]
    self_same = sum(list(x.outputs[0].token_ids) == list(y.outputs[0].token_ids) for x, y in zip(outs, chunked))
    result = {"config": os.environ["FLASHRL_CONFIG"], "checkpoint": str(ckpt), "step": step,
              # the fully-async trainer: rollouts verl aborted at a sync and resumed (prompt + their tokens)
              "partial_rollouts": partial_rollouts(a.out / f"{a.run}.jsonl"),
              "engine_sync": run_digest["sync"], "kv_scales_left_out": len(kv_scales),
              "tensors": diff["tensors"], "tensors_differ": len(diff["differ"]),
              "tensors_only_in_one": len(diff["only_first"]) + len(diff["only_second"]),
              "first_differing": (diff["differ"] + diff["only_first"] + diff["only_second"])[:5],
              "differing_by_name": dict(Counter(n.rsplit(".", 1)[-1] for n in diff["differ"]).most_common()),
              "differing_values": dict(list(values.items())[:12]),  # small tensors: engine vs fresh
              "greedy_identical": same, "greedy_prompts": len(matched), "verl_prompts": len(verl_outputs),
              "fresh_batch_vs_batches_of_5_identical": self_same, "fresh_prompts": len(prompts),
              # the invariant: the synced engine holds a fresh engine's bytes
              "equal": not (diff["differ"] or diff["only_first"] or diff["only_second"])}
    with open(a.out / f"{a.run}.jsonl", "a") as log:
        log.write(json.dumps({"final_check": result}) + "\n")
    print(json.dumps(result, indent=1))
    return 0 if result["equal"] else 1  # greedy differences are reported, judged in the table


if __name__ == "__main__":
    sys.exit(main())
