"""GPU checks of the runtime (vLLM 0.26 on an H100/H200), one process per engine.

1. Correctness: a HF-initialised random Qwen2 model (random weights with real structure, not
   vLLM's near-uniform dummy weights) and a perturbed copy. For FLASHRL_CONFIG=int8, fp8 (vLLM
   online FP8) and a fp8_channel YAML: push the perturbed BF16 weights one tensor at a time and
   compare with a fresh engine serving the same 8-bit weights; push the original back.
   With --kv-cache-dtype fp8 (issue 15) every engine has an FP8 KV cache: bf16 joins the configs,
   fresh engines run the runtime too (its calibration sets their scales), the q/k/v scales of
   synced and fresh engines are compared, and --reload adds a sync through vLLM's reload_weights.
2. Sync wall time: a Qwen2.5-7B-shaped random checkpoint, one full sync of BF16 tensors already
   on the GPU (the trainer's copy), for bf16 / fp8 / int8.
Prints a table and writes JSON (--json). Usage: python benchmarks/gpu_runtime_check.py --json OUT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "examples" / "sync_probe.py"
SEQS = [[5, 70, 75, 82, 3, 40, 50, 60, 70, 80, 90, 100], [7, 8, 9, 10, 11, 200, 201, 202, 203, 204]]


def probe(tmp: Path, tag: str, env: dict, **req) -> dict:
    rq, out = tmp / f"{tag}-req.json", tmp / f"{tag}.json"
    rq.write_text(json.dumps({"sequences": SEQS, "max_tokens": 8, **req}))
    full = {k: v for k, v in os.environ.items() if k != "FLASHRL_CONFIG"}
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, str(PROBE), str(rq), str(out)], capture_output=True, text=True,
                         env={**full, **env})
    if res.returncode != 0:
        print(res.stderr[-6000:])
        raise SystemExit(f"probe {tag} failed")
    r = json.loads(out.read_text())
    r["wall_s"] = time.perf_counter() - t0
    return r


def max_diff(a, b):
    return max(abs(x - y) for la, lb in zip(a["logprobs"], b["logprobs"]) for x, y in zip(la, lb))


def make_model(path: Path, shape: dict, seed: int, random_init: bool) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from flashrl_tools.models.tiny import byte_tokenizer

    cfg = Qwen2Config(**shape, tie_word_embeddings=False, torch_dtype="bfloat16", max_position_embeddings=2048)
    torch.manual_seed(seed)
    if random_init:  # HF initialisation: a structured random model
        Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    else:  # 7B-sized: fill on the GPU, fast
        with torch.device("meta"):
            model = Qwen2ForCausalLM(cfg)
        sd = {k: (torch.randn(v.shape, device="cuda") * 0.02).to(torch.bfloat16).cpu() for k, v in model.state_dict().items()}
        from safetensors.torch import save_file

        path.mkdir(parents=True)
        cfg.save_pretrained(path)
        names, shard, size, i = list(sd), {}, 0, 0
        for n in names:
            shard[n] = sd.pop(n)
            size += shard[n].numel() * 2
            if size > 4 << 30 or not sd:
                save_file(shard, path / f"model-{i:05d}.safetensors", metadata={"format": "pt"})
                shard, size, i = {}, 0, i + 1
    byte_tokenizer().save_pretrained(path)


def perturb(src: Path, dst: Path) -> None:
    from flashrl_tools.safetensors_io import CheckpointReader, PlannedTensor, write_checkpoint

    r = CheckpointReader(src)
    g = torch.Generator().manual_seed(1)
    plan = [PlannedTensor(n, r.shape(n), r.dtype(n)) for n in r.names()]
    dst.mkdir(parents=True)
    write_checkpoint(dst, plan, lambda: ((n, (t.float() * (1 + 0.05 * torch.randn(t.shape, generator=g))).to(t.dtype))
                                         for n, t in r.iter_tensors()))
    for f in src.iterdir():
        if f.suffix in (".json", ".jinja"):
            (dst / f.name).write_bytes(f.read_bytes())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, default=Path("gpu_runtime_check.json"))
    ap.add_argument("--skip-7b", action="store_true")
    ap.add_argument("--only-7b", action="store_true")
    ap.add_argument("--configs", default="bf16,fp8,int8", help="7B sync timing: which FLASHRL_CONFIGs")
    ap.add_argument("--compiled", action="store_true",
                    help="correctness checks with vLLM's default torch.compile + CUDA graphs (else eager)")
    ap.add_argument("--workdir", type=Path, default=None, help="reuse models built by an earlier run")
    ap.add_argument("--kv-cache-dtype", default=None, help="fp8: every engine with an FP8 KV cache (issue 15)")
    ap.add_argument("--reload", action="store_true", help="also sync through vLLM's reload_weights")
    ap.add_argument("--engine-args", type=json.loads, default={},
                    help='extra vllm.LLM arguments as JSON, e.g. \'{"gpu_memory_utilization": 0.05, '
                         '"kv_cache_memory_bytes": 1073741824}\' to share one GPU between checks')
    ap.add_argument("--correctness-configs", default=None,
                    help="subset of bf16,int8,fp8,fp8_channel for the correctness checks (default: all)")
    args = ap.parse_args()
    if args.kv_cache_dtype:
        os.environ["FLASHRL_KV_CACHE_DTYPE"] = args.kv_cache_dtype
    from flashrl_tools.quantize import quantize

    tmp = args.workdir or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    tmp.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import vllm

    results["vllm"] = vllm.__version__
    small = dict(vocab_size=384, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                 num_attention_heads=16, num_key_value_heads=4)
    if args.only_7b:
        args.skip_7b = False
    else:
        make_model(tmp / "m", small, 0, True)
        perturb(tmp / "m", tmp / "mp")
    mode = {"enforce_eager": False} if args.compiled else {}
    results["engines"] = "compiled (torch.compile + CUDA graphs)" if args.compiled else "eager"
    ekw = {"gpu_memory_utilization": 0.3, **mode, **args.engine_args}
    eng = {"engine_kwargs": ekw}
    checks = []
    yaml_fp8 = tmp / "fp8_channel.yaml"
    yaml_fp8.write_text("version: 1\nconfigs:\n- fn: fp8_channel\n  logprobs_mode: processed_logprobs\n")
    # fresh engines need the runtime where it calibrates FP8 KV scales (it serves them unchanged)
    ref = {"FLASHRL_CONFIG": "bf16"} if args.kv_cache_dtype else {}
    cases = {
        "bf16": ({"FLASHRL_CONFIG": "bf16"}, lambda: probe(tmp, "fresh-bf16", ref, model=str(tmp / "mp"), **eng)),
        "int8": ({"FLASHRL_CONFIG": "int8"}, lambda: probe(tmp, "fresh-int8", ref, model=str(quantize(tmp / "mp", tmp / "mp-int8", "int8").out), **eng)),
        "fp8": ({"FLASHRL_CONFIG": "fp8"}, lambda: probe(tmp, "fresh-fp8", ref, model=str(tmp / "mp"), engine_kwargs={**ekw, "quantization": "fp8"})),
        "fp8_channel (yaml)": ({"FLASHRL_CONFIG": str(yaml_fp8)}, lambda: probe(tmp, "fresh-fp8c", ref, model=str(quantize(tmp / "mp", tmp / "mp-fp8c", "fp8_channel").out), **eng)),
    }
    wanted = (args.correctness_configs or ",".join(cases)).split(",")
    if not args.kv_cache_dtype and not args.correctness_configs:
        wanted.remove("bf16")  # (the original check set)
    for name, (env, fresh_fn) in ({} if args.only_7b else cases).items():
        if name.split()[0] not in wanted:
            continue
        fresh = fresh_fn()["stages"][0]
        paths = {"push": [str(tmp / "mp"), str(tmp / "m")]}
        if args.reload:
            paths["reload"] = [str(tmp / "mp"), str(tmp / "m")]
        # GPU tensors, as a trainer pushes them (CPU-quantized references: device-independent math)
        r = probe(tmp, f"sync-{name.split()[0]}", env, model=str(tmp / "m"), **paths, **eng, push_device="cuda")
        start, after, back = r["stages"][:3]
        row = {"config": name, "tokens_equal": after["tokens"] == fresh["tokens"],
               "max_dlogp_vs_fresh": max_diff(after, fresh), "changed_by_sync": max_diff(start, after),
               "restored_max_dlogp": max_diff(back, start), "sync_s": after["seconds"],
               "inplace_layers": r.get("inplace_layers")}
        if args.reload:
            r_after, r_back = r["stages"][3:5]
            row.update(reload_max_dlogp_vs_fresh=max_diff(r_after, fresh), reload_restored_max_dlogp=max_diff(r_back, start))
        if args.kv_cache_dtype:
            row["kv_scales_equal_fresh"] = after.get("kv_scales") == fresh.get("kv_scales") and bool(fresh.get("kv_scales"))
            row["kv_scales_changed_by_sync"] = after.get("kv_scales") != start.get("kv_scales")
            if args.reload:
                row["reload_kv_scales_equal_fresh"] = r_after.get("kv_scales") == fresh.get("kv_scales")
        checks.append(row)
        print(checks[-1], flush=True)
    results["correctness"] = checks
    if not args.skip_7b:
        big = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                   num_attention_heads=28, num_key_value_heads=4)
        if not (tmp / "7b" / "config.json").is_file():
            make_model(tmp / "7b", big, 0, False)
        timing = []
        for cfg in args.configs.split(","):
            r = probe(tmp, f"7b-{cfg}", {"FLASHRL_CONFIG": cfg}, model=str(tmp / "7b"), push=[str(tmp / "7b")],
                      push_device="cuda", sequences=[SEQS[0]], engine_kwargs={"gpu_memory_utilization": 0.5})
            timing.append({"config": cfg, "sync_s": r["stages"][1]["seconds"], "probe_wall_s": r["wall_s"]})
            print(timing[-1], flush=True)
        results["sync_7b"] = timing
    args.json.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
