"""Tiny random-weight checkpoints (seeded, deterministic) for fast tests of other architectures.

Each comes with a byte-level tokenizer built locally (no hub), so vLLM can serve it.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import torch

from flashrl_tools.fsutil import atomic_output_dir, check_output_dir

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB_SIZE = 320  # 256 bytes + specials, padded to a multiple of 64


class TinyArch(str, Enum):
    llama = "llama"
    qwen2 = "qwen2"
    qwen3 = "qwen3"
    qwen3_moe = "qwen3_moe"  # sparse MoE: router `mlp.gate`, experts gate/up/down_proj
    mixtral = "mixtral"  # sparse MoE: router `block_sparse_moe.gate`, experts w1/w3/w2


# MoE: 4 experts, 2 active, small expert width; every decoder layer sparse.
_MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.0)


def tiny_config(arch: TinyArch, tied: bool):
    from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        rms_norm_eps=1e-6, torch_dtype="bfloat16",
    )
    if arch is TinyArch.llama:
        return LlamaConfig(**common)
    if arch is TinyArch.qwen2:
        return Qwen2Config(**common)  # q/k/v projections carry a bias
    if arch is TinyArch.qwen3_moe:
        return Qwen3MoeConfig(head_dim=32, num_experts=4, moe_intermediate_size=64, decoder_sparse_step=1,
                              mlp_only_layers=[], norm_topk_prob=True, **_MOE, **common)
    if arch is TinyArch.mixtral:
        return MixtralConfig(num_local_experts=4, **_MOE, **{**common, "intermediate_size": 64})
    return Qwen3Config(head_dim=32, **common)  # q/k norms inside attention


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i + len(SPECIAL_TOKENS) for i, tok in enumerate(alphabet)}
    vocab.update({tok: i for i, tok in enumerate(SPECIAL_TOKENS)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(out: Path, arch: TinyArch | str = TinyArch.llama, tied: bool = False,
                    seed: int = 0, force: bool = False) -> Path:
    from transformers import AutoModelForCausalLM, GenerationConfig

    arch = TinyArch(arch)
    out = Path(out)
    check_output_dir(out, force)
    config = tiny_config(arch, tied)
    tokenizer = byte_tokenizer()
    config.eos_token_id = tokenizer.eos_token_id
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    finally:
        torch.random.set_rng_state(generator_state)
    with atomic_output_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id).save_pretrained(tmp)
    return out
