"""Make a calibrated W8A8 checkpoint with llmcompressor: SmoothQuant + RTN (data-free weights,
activation statistics from a small built-in calibration set), like the `*-quantized.w8a8` models.

Runs in llmcompressor's own venv (see scripts/make_smoothquant_fixture.sh).
Usage: python llmcompressor_smoothquant.py SRC_BF16_DIR OUT_DIR [--down-proj]
  --down-proj  also smooth down_proj's inputs into up_proj's rows (a third mapping)
"""

import argparse

import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from llmcompressor.modifiers.smoothquant import SmoothQuantModifier
from transformers import AutoModelForCausalLM, AutoTokenizer

# No dataset hub here: a few dozen varied chat turns are enough activation statistics for SmoothQuant.
TOPICS = ["the water cycle", "prime numbers", "a binary search in Python", "the French revolution",
          "how vaccines work", "photosynthesis", "a haiku about autumn", "compound interest",
          "the rules of chess", "black holes", "how to bake bread", "recursion", "the Roman empire",
          "sorting algorithms", "climate and weather", "the human heart", "a limerick about a cat",
          "what 17 * 23 is", "how a CPU executes instructions", "the causes of World War I",
          "why the sky is blue", "a SQL join", "Newton's laws", "the meaning of entropy",
          "a short story about a robot", "how to solve 3x + 5 = 20", "the theory of evolution",
          "a JavaScript closure", "the Pythagorean theorem", "how to write a cover letter",
          "the stock market", "the difference between TCP and UDP"]


def calibration_set(tokenizer, max_len: int) -> Dataset:
    rows = []
    for t in TOPICS:
        for ask in (f"Explain {t} to a beginner.", f"Give three facts about {t}."):
            text = tokenizer.apply_chat_template([{"role": "user", "content": ask}], tokenize=False,
                                                 add_generation_prompt=True)
            enc = tokenizer(text, truncation=True, max_length=max_len)
            rows.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    return Dataset.from_list(rows)


ap = argparse.ArgumentParser()
ap.add_argument("src")
ap.add_argument("out")
ap.add_argument("--down-proj", action="store_true")
ap.add_argument("--strength", type=float, default=0.8)
args = ap.parse_args()
torch.manual_seed(0)
tok = AutoTokenizer.from_pretrained(args.src)
model = AutoModelForCausalLM.from_pretrained(args.src, dtype=torch.bfloat16)
mappings = [[["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"], "re:.*input_layernorm"],
            [["re:.*gate_proj", "re:.*up_proj"], "re:.*post_attention_layernorm"]]
if args.down_proj:
    mappings.append([["re:.*down_proj"], "re:.*up_proj"])
recipe = [SmoothQuantModifier(smoothing_strength=args.strength, mappings=mappings),
          QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])]
ds = calibration_set(tok, 256)
oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=len(ds), max_seq_length=256)
model.save_pretrained(args.out, save_compressed=True)
tok.save_pretrained(args.out)
print(f"wrote {args.out}")
