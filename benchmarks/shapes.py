"""Model shapes for the GPU benchmarks: Qwen2.5 configs written as config-only directories
(vLLM `load_format="dummy"`), and the embedded model for CPU runs."""

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


def model_dir(shape: str, root: Path) -> tuple[Path, bool]:
    """(model directory, dummy weights?) for a shape name: 7b | 14b | 32b | tiny | default."""
    if shape == "default":
        from flashrl_tools.models import resolve_model

        return resolve_model("default"), False
    d = Path(root) / f"qwen2.5-{shape}-shape"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**_COMMON, **QWEN25[shape]}, indent=1))
    return d, True
