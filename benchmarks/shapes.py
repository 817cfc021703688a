"""Model shapes for the GPU benchmarks: Qwen2.5, Qwen3, Llama-3-70B and Qwen3-MoE configs written as config-only
directories (vLLM `load_format="dummy"`), and the embedded model for CPU runs."""

from __future__ import annotations

import json
from pathlib import Path

_COMMON = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
           "vocab_size": 152064, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
           "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "bos_token_id": 151643, "eos_token_id": 151645, "use_sliding_window": False}
QWEN25 = {
    "7b": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
           "num_attention_heads": 28, "num_key_value_heads": 4},
    "14b": {"hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48,
            "num_attention_heads": 40, "num_key_value_heads": 8},
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,  # CPU smoke test
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048},
    "32b": {"hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
            "num_attention_heads": 40, "num_key_value_heads": 8},
}


_QWEN3_COMMON = {**_COMMON, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
                 "head_dim": 128, "attention_bias": False, "max_position_embeddings": 40960}
QWEN3 = {
    "qwen3-8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,  # NeMo-RL's FP8 anchor
                 "num_attention_heads": 32, "num_key_value_heads": 8},
}


_LLAMA3_COMMON = {**_COMMON, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
                  "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                  "attention_bias": False, "mlp_bias": False, "bos_token_id": 128000, "eos_token_id": 128009}
LLAMA3 = {
    # Llama-3-70B's dims (issue 75's 70B row: BF16 140 GB, 8-bit 70 GB, 4-bit ~37 GB of weights); Llama-3.1's
    # 131,072 positions: 3's 8,192 is shorter than the RL step's 1,024 + 8,192 tokens (vLLM refused it, 2026-11-30)
    "llama3-70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                   "num_attention_heads": 64, "num_key_value_heads": 8},
}


_MOE_COMMON = {**_COMMON, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
               "vocab_size": 151936, "head_dim": 128, "decoder_sparse_step": 1, "mlp_only_layers": [],
               "norm_topk_prob": True, "attention_bias": False, "rope_theta": 1000000.0,
               "eos_token_id": 151645, "max_position_embeddings": 40960}
QWEN3_MOE = {
    # Qwen3-30B-A3B: 128 experts, 8 active per token, ~3.3B active of ~30.5B parameters
    "30b-a3b": {"hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                "num_experts": 128, "num_experts_per_tok": 8},
    "moe-tiny": {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,  # CPU smoke
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                 "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 2048},
}


def model_dir(shape: str, root: Path) -> tuple[Path, bool]:
    """(model directory, dummy weights?) for a shape name: 7b | 14b | 32b | tiny (Qwen2.5) | qwen3-8b |
    llama3-70b | 30b-a3b | moe-tiny | default."""
    if shape == "default":
        from flashrl_tools.models import resolve_model

        return resolve_model("default"), False
    if shape in LLAMA3:
        d, config = Path(root) / f"{shape}-shape", {**_LLAMA3_COMMON, **LLAMA3[shape]}
    elif shape in QWEN3_MOE:
        d, config = Path(root) / f"qwen3-moe-{shape}-shape", {**_MOE_COMMON, **QWEN3_MOE[shape]}
    elif shape in QWEN3:
        d, config = Path(root) / f"{shape}-shape", {**_QWEN3_COMMON, **QWEN3[shape]}
    else:
        d, config = Path(root) / f"qwen2.5-{shape}-shape", {**_COMMON, **QWEN25[shape]}
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, indent=1))
    return d, True
