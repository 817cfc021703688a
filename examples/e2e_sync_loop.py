"""Trainer-free end-to-end loop: an 8-bit rollout engine kept in sync with a BF16 learner.

Each step: the engine (FLASHRL_CONFIG, default int8) generates and scores a target answer;
the BF16 Hugging Face copy takes one SGD step towards that answer; its weights are pushed into
the engine with `model.load_weights([(name, tensor)])`, one tensor per call, as verl and TRL
colocate do. The engine's logprob of the target must rise step by step: the 8-bit engine follows
the BF16 learner. Prints a table; `--json` writes the numbers.

    FLASHRL_CONFIG=int8 python examples/e2e_sync_loop.py --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # colocated engine, like TRL
os.environ.setdefault("FLASHRL_CONFIG", "int8")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from flashrl_tools.models import resolve_model  # noqa: E402

PROMPT = "Tell me your favourite number."
TARGET = "My favourite number is 42."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="default")
    ap.add_argument("--steps", type=int, default=4)
    # SGD steps much smaller than one INT8 step (~absmax/127 per channel) only flip a few roundings:
    # the engine then sees noise, not the update. 5e-3 moves weights by about one INT8 step.
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    path = str(resolve_model(args.model))
    tok = AutoTokenizer.from_pretrained(path)
    prompt_ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
    target_ids = tok(TARGET, add_special_tokens=False)["input_ids"]
    learner = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    opt = torch.optim.SGD(learner.parameters(), lr=args.lr)
    llm = LLM(model=path, dtype="bfloat16", max_model_len=512, enforce_eager=True, enable_prefix_caching=False,
              gpu_memory_utilization=0.3, seed=0)

    def engine_view():
        gen = llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(temperature=0, max_tokens=12),
                           use_tqdm=False)[0].outputs[0].text
        scored = llm.generate([{"prompt_token_ids": prompt_ids + target_ids}],
                              SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        lps = [lp[t].logprob for t, lp in zip(target_ids, scored.prompt_logprobs[len(prompt_ids):])]
        return gen, sum(lps) / len(lps)

    def push(worker, state):
        model = worker.model_runner.model
        for name, tensor in state.items():
            model.load_weights([(name, tensor)])
        return model.flashrl_sync.completed if hasattr(model, "flashrl_sync") else None

    ids = torch.tensor([prompt_ids + target_ids])
    labels = ids.clone()
    labels[0, : len(prompt_ids)] = -100

    def learner_logprob() -> float:
        with torch.no_grad():
            return -learner(input_ids=ids, labels=labels).loss.item()

    rows = []
    text, lp = engine_view()
    rows.append({"step": 0, "engine_output": text, "engine_target_logprob": lp, "sync_s": None,
                 "learner_target_logprob": learner_logprob()})
    for step in range(1, args.steps + 1):
        loss = learner(input_ids=ids, labels=labels).loss  # BF16 learner: one SGD step
        opt.zero_grad()
        loss.backward()
        opt.step()
        state = {k: v.detach() for k, v in learner.state_dict().items()}
        t0 = time.perf_counter()
        llm.collective_rpc(lambda worker, state=state: push(worker, state))
        sync_s = time.perf_counter() - t0
        text, lp = engine_view()
        rows.append({"step": step, "engine_output": text, "engine_target_logprob": lp, "sync_s": sync_s,
                     "learner_target_logprob": learner_logprob()})

    table = Table(title=f"FLASHRL_CONFIG={os.environ['FLASHRL_CONFIG']}: engine follows the BF16 learner")
    for col in ("step", "sync (s)", "BF16 learner log p(target)", "8-bit engine log p(target)",
                "engine greedy output"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["step"]), "" if r["sync_s"] is None else f"{r['sync_s']:.2f}",
                      f"{r['learner_target_logprob']:.3f}", f"{r['engine_target_logprob']:.3f}",
                      r["engine_output"].replace("\n", "⏎"))
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": os.environ["FLASHRL_CONFIG"], "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
