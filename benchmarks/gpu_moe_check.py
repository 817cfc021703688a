"""GPU checks of MoE models (vLLM 0.26, H100/H200): 8-bit MoE engines vs BF16, and exact syncs.

HF-initialised random Qwen3-MoE and Mixtral models (real structure, not dummy weights) and a
perturbed copy of each (every weight x (1 + 0.05 N(0,1)): a stand-in for an optimizer step).
Per FLASHRL_CONFIG (bf16, int8, fp8, fp8_channel and fp8_block YAMLs):
  - bound: the 8-bit engine's teacher-forced logprobs vs the BF16 engine's (mean / max |Δ|),
    beside the same numbers for a dense Qwen3 of the same width (the "same order as dense" check);
  - exactness: push the perturbed BF16 weights (one tensor per call with checkpoint names; the
    trainer's in-memory state dict with transformers 5's fused expert tensors; vLLM's own
    reload_weights), each compared with a fresh engine started on the perturbed policy with the
    same config (= the same 8-bit weights); then the original weights pushed back (restore).
`--vllm-online-fp8` adds the path the issue measured: vLLM's own online FP8 MoE synced.
`--tp 2 [--ep]`: tensor parallel (and expert parallel) engines.
Prints a table, writes JSON. Usage: python benchmarks/gpu_moe_check.py --json OUT [--tp 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("gpu_runtime_check", HERE / "gpu_runtime_check.py")
grc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(grc)

ARCHS = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512, decoder_sparse_step=1,
                      mlp_only_layers=[], norm_topk_prob=True, head_dim=64),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=512),
    "qwen3": dict(intermediate_size=2048, head_dim=64),  # dense reference, same width
}
COMMON = dict(vocab_size=384, hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
              max_position_embeddings=2048, tie_word_embeddings=False, torch_dtype="bfloat16")


def make_model(path: Path, arch: str) -> None:
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3Config, Qwen3MoeConfig

    from flashrl_tools.models.tiny import byte_tokenizer

    cls = {"qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig, "qwen3": Qwen3Config}[arch]
    cfg = cls(**{**COMMON, **ARCHS[arch]})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)


def diffs(a: dict, b: dict) -> tuple[float, float]:
    d = [abs(x - y) for la, lb in zip(a["logprobs"], b["logprobs"]) for x, y in zip(la, lb)]
    return statistics.fmean(d), max(d)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, default=Path("gpu_moe_check.json"))
    ap.add_argument("--archs", default="qwen3_moe,mixtral")
    ap.add_argument("--configs", default="bf16,int8,fp8,fp8_channel,fp8_block")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", action="store_true", help="expert parallelism (with --tp)")
    ap.add_argument("--compiled", action="store_true", help="torch.compile + CUDA graphs (else eager)")
    ap.add_argument("--vllm-online-fp8", action="store_true")
    ap.add_argument("--no-dense", action="store_true")
    ap.add_argument("--no-bound", action="store_true", help="skip the BF16 engine (exactness checks only)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--engine-args", type=json.loads, default={}, help="extra vllm.LLM arguments as JSON")
    args = ap.parse_args()
    import vllm

    gpu = torch.cuda.is_available()  # on CPU: a smoke run of the script (bf16 only)
    tmp = args.workdir or Path(tempfile.mkdtemp(prefix="gpu-moe-"))
    tmp.mkdir(parents=True, exist_ok=True)
    kw = {"gpu_memory_utilization": 0.25 if gpu else 0.3, "tensor_parallel_size": args.tp}
    if not args.compiled:
        kw["enforce_eager"] = True
    else:
        kw["enforce_eager"] = False
    if args.ep:
        kw["enable_expert_parallel"] = True
    kw.update(args.engine_args)
    eng = {"engine_kwargs": kw}
    results = {"device": torch.cuda.get_device_name() if gpu else "CPU", "gpus": torch.cuda.device_count(),
               "vllm": vllm.__version__,
               "tp": args.tp, "ep": args.ep, "engines": "compiled" if args.compiled else "eager", "bounds": [],
               "syncs": []}
    archs = args.archs.split(",") + ([] if args.no_dense else ["qwen3"])
    for arch in archs:
        m, mp = tmp / arch, tmp / f"{arch}-perturbed"
        if not (m / "config.json").is_file():
            make_model(m, arch)
            grc.perturb(m, mp)
        bf16 = None if args.no_bound else \
            grc.probe(tmp, f"{arch}-bf16", {"FLASHRL_CONFIG": "bf16"}, model=str(m), **eng)["stages"][0]
        configs = [c for c in args.configs.split(",") if arch != "qwen3" or c != "bf16"]
        for cfg in configs:
            env_cfg = cfg
            if cfg in ("fp8_channel", "fp8_block"):
                y = tmp / f"{cfg}.yaml"
                y.write_text(f"version: 1\nconfigs:\n- fn: {cfg}\n  logprobs_mode: processed_logprobs\n")
                env_cfg = str(y)
            env = {"FLASHRL_CONFIG": env_cfg}
            tag = f"{arch}-{cfg}"
            if arch == "qwen3":  # dense reference: the bound only
                start = grc.probe(tmp, tag, env, model=str(m), **eng)["stages"][0]
                mean, mx = diffs(start, bf16)
                results["bounds"].append({"arch": arch, "config": cfg, "mean_dlogp_vs_bf16": mean, "max_dlogp_vs_bf16": mx})
                print(results["bounds"][-1], flush=True)
                continue
            fresh = grc.probe(tmp, f"{tag}-fresh", env, model=str(mp), **eng)["stages"][0]
            r = grc.probe(tmp, f"{tag}-sync", env, model=str(m), push=[str(mp), str(m)], push_trainer=[str(mp)],
                          reload=[str(mp)], **eng, push_device="cuda" if gpu else None)
            start, pushed, restored, trainer, reloaded = r["stages"]
            if cfg != "bf16" and bf16 is not None:
                mean, mx = diffs(start, bf16)
                results["bounds"].append({"arch": arch, "config": cfg, "mean_dlogp_vs_bf16": mean,
                                          "max_dlogp_vs_bf16": mx})
                print(results["bounds"][-1], flush=True)
            row = {"arch": arch, "config": cfg,
                   "changed_by_sync": diffs(start, pushed)[1],
                   "checkpoint_names_vs_fresh": diffs(pushed, fresh)[1],
                   "trainer_fused_names_vs_fresh": diffs(trainer, fresh)[1],
                   "reload_weights_vs_fresh": diffs(reloaded, fresh)[1],
                   "restored_vs_start": diffs(restored, start)[1],
                   "tokens_equal": pushed["tokens"] == fresh["tokens"] and trainer["tokens"] == fresh["tokens"],
                   "sync_s": pushed.get("seconds"), "trainer_sync_s": trainer.get("seconds"),
                   "inplace_layers": r.get("inplace_layers")}
            results["syncs"].append(row)
            print(row, flush=True)
        if args.vllm_online_fp8 and arch != "qwen3":  # vLLM's own online FP8 MoE, synced (bf16 config)
            k = {"engine_kwargs": {**kw, "quantization": "fp8"}}
            fresh = grc.probe(tmp, f"{arch}-vfp8-fresh", {}, model=str(mp), **k)["stages"][0]
            r = grc.probe(tmp, f"{arch}-vfp8-sync", {"FLASHRL_CONFIG": "bf16"}, model=str(m), push=[str(mp)], **k)
            results["syncs"].append({"arch": arch, "config": "vLLM online fp8 (not our path)",
                                     "checkpoint_names_vs_fresh": diffs(r["stages"][1], fresh)[1]})
            print(results["syncs"][-1], flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"\nMoE on {results['device']} x{results['gpus']}, vLLM {results['vllm']}, TP={args.tp}"
          f"{' EP' if args.ep else ''}, {results['engines']}")
    print(f"{'arch':10} {'config':14} {'mean|Δ| vs bf16':>16} {'max|Δ| vs bf16':>15}")
    for b in results["bounds"]:
        print(f"{b['arch']:10} {b['config']:14} {b['mean_dlogp_vs_bf16']:16.4f} {b['max_dlogp_vs_bf16']:15.4f}")
    print(f"{'arch':10} {'config':14} {'ckpt names':>10} {'fused names':>11} {'reload':>8} {'restore':>8} {'sync s':>7}")
    for s in results["syncs"]:
        def f(k):
            return f"{s[k]:.1e}" if isinstance(s.get(k), float) else "-"
        print(f"{s['arch']:10} {s['config'][:14]:14} {f('checkpoint_names_vs_fresh'):>10} "
              f"{f('trainer_fused_names_vs_fresh'):>11} {f('reload_weights_vs_fresh'):>8} {f('restored_vs_start'):>8} "
              f"{s.get('sync_s') or 0:7.2f}")


if __name__ == "__main__":
    main()
