"""Real trainers' engine lifecycle on the GPU (issue 29): sleep mode, bucketed pushes, verl's own sync.

For each case (FLASHRL_CONFIG x architecture x KV cache) two processes (examples/lifecycle_probe.py),
both compiled (torch.compile + FULL_AND_PIECEWISE CUDA graphs) with `enable_sleep_mode=True`:
  - fresh: the config on the perturbed BF16 weights (HF-initialised random Qwen2 / Qwen3-MoE);
  - lifecycle: the config on the original weights, driven like verl (sleep(2), wake weights,
    bucketed push from one reused buffer poisoned after each bucket, whole-model
    process_weights_after_loading, reset prefix cache, wake kv_cache), like TRL (sleep(2), wake
    weights, one load_weights per parameter), a level-1 cycle, a level-2 wake without a push
    (must be refused), and with --verl verl 0.9.1's own update_weights_from_ipc + BucketedWeightSender
    (CUDA IPC from a trainer process, fp32 tensors).
Checks per case (max |Δ log p| over teacher-forced positions; 0.0 expected): synced vs fresh
(no sleep, verl order, verl's code), restore vs start (TRL order), level 1, FP8 KV scales
bit-equal to the fresh engine's, the refusal, and which tensors (parameters, buffers, kernel-held
tensors) differ from the fresh engine's after the last sync.
Case `sq-int8` (with --sq DIR, kv off only): a calibrated config -- SmolLM2 (the default model), a
`flashrl profile` of the SmoothQuant W8A8 checkpoint (DIR/p.safetensors, DIR/config.json its
quantization_config: scripts/gpu_stage_sq.sh) and the YAML naming both; the served checkpoint and
the fresh reference are the profile applied to the original / perturbed BF16 weights, the fresh
engine a plain vLLM engine (no FLASHRL_CONFIG) on the latter. A profile reproduces its checkpoint
only to its exact fraction (>= 99.9 % of INT8 entries, tests/test_profile.py; re-profiling the
reproduction does not converge either): the engine starts on the calibrated checkpoint itself, so
pushing the originals back gives the profile applied to them, not the checkpoint's bytes. That
case's restores are compared with a third engine, a plain one on the profile applied to the
originals; `start_vs_restore_reference` says how far the checkpoint itself is from it, and
`checkpoint_entries_not_reproduced` how many of its entries differ (counted on the CPU).
Usage: python benchmarks/gpu_lifecycle_check.py --json OUT [--cases dense-int8,moe-fp8,...] [--kv off,on]
       [--verl] [--jobs N] [--engine-args JSON] [--eager] [--sq DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import load_sibling  # noqa: E402
PROBE = HERE.parent / "examples" / "lifecycle_probe.py"
SEQS = [[5, 70, 75, 82, 3, 40, 50, 60, 70, 80, 90, 100], [7, 8, 9, 10, 11, 200, 201, 202, 203, 204]]
# config name -> FLASHRL_CONFIG (a shortcut, or a YAML written into the work dir)
YAMLS = {
    "fp8_channel": "- fn: fp8_channel\n  logprobs_mode: processed_logprobs\n",
    "fp8_block": "- fn: fp8_block\n  logprobs_mode: processed_logprobs\n",
    "int8_keep": "- fn: int8\n  logprobs_mode: processed_logprobs\n  first_layers_bf16: 1\n  keep_bf16: ['*.down_proj']\n",
}
CASES = ["dense-bf16", "dense-int8", "dense-fp8", "dense-fp8_channel", "dense-fp8_block", "dense-int8_keep",
         "moe-int8", "moe-fp8"]



def make_sq(work: Path, sq: Path, grc) -> tuple[Path, Path, Path, Path, Path]:
    """The calibrated case's models: (BF16 original, BF16 perturbed, YAML, fresh reference checkpoint,
    the profile applied to the original: the restores' reference)."""
    from flashrl_tools.models.default import ensure_default_model
    from flashrl_tools.profile.apply import requantize_checkpoint
    from flashrl_tools.profile.format import load_profile

    orig, pert, yaml = Path(ensure_default_model()), work / "sq-perturbed", work / "sq.yaml"
    served, prof = work / "sq-orig-int8", work / "sq-profile.safetensors"
    if not (pert / "config.json").is_file():
        grc.perturb(orig, pert)
    if not (served / "config.json").is_file():  # the calibrated checkpoint, rebuilt from the carried profile
        requantize_checkpoint(orig, load_profile(sq / "p.safetensors"), served, template=sq)
    if not prof.is_file():  # its own profile (the runtime checks that a profile belongs to its checkpoint)
        subprocess.run([sys.executable, "-m", "flashrl_tools", "profile", "-m", str(orig), "-qm", str(served),
                        "-o", str(prof), "--fn", "int8"], check=True, capture_output=True)
    if not (work / "sq-pert-int8" / "config.json").is_file():
        requantize_checkpoint(pert, load_profile(prof), work / "sq-pert-int8")
    if not (work / "sq-orig-requant" / "config.json").is_file():
        requantize_checkpoint(orig, load_profile(prof), work / "sq-orig-requant")
    yaml.write_text(f"version: 1\nconfigs:\n- fn: int8\n  model: {served}\n"
                    f"  profile: {prof}\n  logprobs_mode: processed_logprobs\n")
    return orig, pert, yaml, work / "sq-pert-int8", work / "sq-orig-requant"


def entries_differing(a: Path, b: Path) -> int:
    """Entries (INT8 weights, scales, norms) that differ between two checkpoints of the same names (CPU)."""
    from flashrl_tools.safetensors_io import CheckpointReader

    rb = CheckpointReader(b)
    return sum(int((x != rb.get(n)).sum()) for n, x in CheckpointReader(a).iter_tensors())


def make_models(work: Path, sq: Path | None = None) -> dict[str, tuple[Path, ...]]:
    grc, moe = load_sibling("gpu_runtime_check"), load_sibling("gpu_moe_check")
    out = {}
    if sq is not None:
        out["sq"] = make_sq(work, sq, grc)
    dense, moe_dir = work / "dense", work / "moe"
    if not (dense / "config.json").is_file():
        grc.make_model(dense, dict(vocab_size=384, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                   num_attention_heads=16, num_key_value_heads=4), 0, True)
        grc.perturb(dense, work / "dense-perturbed")
    if not (moe_dir / "config.json").is_file():
        moe.make_model(moe_dir, "qwen3_moe")
        grc.perturb(moe_dir, work / "moe-perturbed")
    out["dense"] = (dense, work / "dense-perturbed")
    out["moe"] = (moe_dir, work / "moe-perturbed")
    return out


def run_probe(work: Path, tag: str, env: dict, req: dict, timeout: float) -> dict:
    rq, out, log = work / f"{tag}-req.json", work / f"{tag}.json", work / f"{tag}.log"
    rq.write_text(json.dumps({"sequences": SEQS, "max_tokens": 8, **req}))
    full = {k: v for k, v in os.environ.items() if k not in ("FLASHRL_CONFIG", "FLASHRL_KV_CACHE_DTYPE")}
    with open(log, "w") as f:
        res = subprocess.run([sys.executable, str(PROBE), str(rq), str(out)], stdout=f, stderr=subprocess.STDOUT,
                             env={**full, **env}, timeout=timeout)
    if res.returncode != 0 or not out.is_file():
        tail = log.read_text()[-4000:]
        return {"error": f"exit {res.returncode}", "log_tail": tail}
    return json.loads(out.read_text())


def max_diff(a: dict, b: dict) -> float:
    return max(abs(x - y) for la, lb in zip(a["logprobs"], b["logprobs"]) for x, y in zip(la, lb))


def same(a: dict, b: dict) -> dict:
    return {"max_dlogp": max_diff(a, b), "tokens_equal": a["tokens"] == b["tokens"],
            **({"kv_scales_equal": a["kv_scales"] == b["kv_scales"]} if "kv_scales" in a else {})}


def run_case(case: str, kv: str, models: dict, work: Path, args) -> dict:
    arch, config = case.split("-", 1)
    tag = f"{case}-kv{kv}"
    flashrl = config
    if config in YAMLS:
        y = work / f"{config}.yaml"
        y.write_text("version: 1\nconfigs:\n" + YAMLS[config])
        flashrl = str(y)
    env = {"FLASHRL_CONFIG": flashrl, **({"FLASHRL_KV_CACHE_DTYPE": "fp8"} if kv == "on" else {})}
    orig, pert, *sq = models[arch]
    fresh_env, fresh_model, restore_ref = env, pert, None
    if sq:  # the calibrated config: its YAML; the fresh reference is a plain engine on the profile's output
        env["FLASHRL_CONFIG"] = str(sq[0])
        fresh_env, fresh_model = {k: v for k, v in env.items() if k != "FLASHRL_CONFIG"}, sq[1]
    ekw = {"gpu_memory_utilization": 0.05, "kv_cache_memory_bytes": 1 << 30, **args.engine_args}
    if args.eager:
        ekw["enforce_eager"] = True
    t0 = time.perf_counter()
    fresh = run_probe(work, f"{tag}-fresh", {**fresh_env, "VLLM_CACHE_ROOT": str(work / "vc" / f"{tag}-f")},
                      {"model": str(fresh_model), "fresh": True, "engine_kwargs": ekw, "sleep": not args.no_sleep},
                      args.timeout)
    life = run_probe(work, f"{tag}-life", {**env, "VLLM_CACHE_ROOT": str(work / "vc" / f"{tag}-l")},
                     {"model": str(orig), "original": str(orig), "perturbed": str(pert), "verl": args.verl,
                      "engine_kwargs": ekw, "bucket_mb": args.bucket_mb, "sleep": not args.no_sleep},
                     args.timeout)
    if sq:  # what pushing the originals back must give: a plain engine on the profile applied to them
        restore_ref = run_probe(work, f"{tag}-restore", {**fresh_env, "VLLM_CACHE_ROOT": str(work / "vc" / f"{tag}-r")},
                                {"model": str(sq[2]), "fresh": True, "engine_kwargs": ekw, "sleep": not args.no_sleep},
                                args.timeout)
    row = {"case": case, "kv": kv, "config": config, "wall_s": round(time.perf_counter() - t0, 1)}
    if any("error" in r for r in (fresh, life, restore_ref or {})):
        row["error"] = {"fresh": fresh.get("log_tail"), "lifecycle": life.get("log_tail"),
                        "restore": (restore_ref or {}).get("log_tail")}
        return row
    row.update(compare(fresh, life, args.verl, args.no_sleep, restore_ref))
    if sq:
        served = work / "sq-orig-int8"  # make_sq: the calibrated checkpoint the YAML serves
        row["checkpoint_entries_not_reproduced"] = entries_differing(served, sq[2])
    return row


def compare(fresh: dict, life: dict, verl: bool, no_sleep: bool, restore_ref: dict | None = None) -> dict:
    """One case's checks from the two probes' results (three for a calibrated config: `restore_ref`,
    a fresh engine on the profile applied to the originals, is what restores must equal)."""
    f, st = fresh["stages"]["fresh"], life["stages"]
    back = restore_ref["stages"]["fresh"] if restore_ref else st["start"]
    fd, ld = fresh["digest"], life["digest"]
    row = {"tensors_differing_from_fresh": sorted(n for n in fd.keys() & ld.keys() if fd[n] != ld[n]),
           "tensors_only_in_one": sorted(fd.keys() ^ ld.keys())[:20],
           "push_nosleep_vs_fresh": same(st["push_nosleep"], f),
           "back_nosleep_vs_start": same(st["back_nosleep"], back),
           "changed_by_sync": max_diff(st["start"], st["push_nosleep"]),
           "inplace_layers": life.get("inplace_layers"), "timing": life.get("timing")}
    if restore_ref:  # not a check: how far the calibrated checkpoint is from its profile's reproduction
        row["start_vs_restore_reference"] = max_diff(st["start"], back)
    if not no_sleep:
        row.update({
            "verl_order_vs_fresh": same(st["verl_replica"], f),
            "level1_vs_before": same(st["level1"], st["verl_replica"]),
            "trl_order_restore_vs_start": same(st["trl"], back),
            ("verl_code_vs_fresh" if verl else "verl_order_again_vs_fresh"): same(st["verl"], f),
            "refused": life["refused"], "verl_fp8_path_taken": st.get("verl_fp8_path")})
    checks = [v for v in row.values() if isinstance(v, dict) and "max_dlogp" in v]
    row["passed"] = (all(c["max_dlogp"] == 0.0 and c["tokens_equal"] and c.get("kv_scales_equal", True)
                         for c in checks) and row["changed_by_sync"] > 0.01 and not row["tensors_differing_from_fresh"]
                     and (no_sleep or ("full weight sync" in (row["refused"] or "") and not row["verl_fp8_path_taken"])))
    return row


def from_dir(work: Path, verl: bool, no_sleep: bool) -> list[dict]:
    """Rows for every case whose two probes finished in `work` (a run in progress, or results
    copied back from the GPU host)."""
    rows = []
    for life in sorted(work.glob("*-life.json")):
        tag = life.name.removesuffix("-life.json")
        fresh, restore = work / f"{tag}-fresh.json", work / f"{tag}-restore.json"
        if fresh.is_file():
            case, kv = tag.rsplit("-kv", 1)
            ref = json.loads(restore.read_text()) if restore.is_file() else None
            rows.append({"case": case, "kv": kv, **compare(json.loads(fresh.read_text()), json.loads(life.read_text()),
                                                           verl, no_sleep, ref)})
    return rows


def print_table(result: dict, verl: bool, no_sleep: bool) -> None:
    print(f"\nengine lifecycle on {result['device']}, vLLM {result['vllm']}, {result['engines']}, "
          f"{'no sleep mode' if no_sleep else 'sleep mode'}")
    keys = ["push_nosleep_vs_fresh", "back_nosleep_vs_start"] if no_sleep else \
        ["push_nosleep_vs_fresh", "verl_order_vs_fresh", "level1_vs_before", "trl_order_restore_vs_start",
         "verl_code_vs_fresh" if verl else "verl_order_again_vs_fresh"]
    print(f"{'case':22} {'kv':3} " + " ".join(f"{k[:14]:>14}" for k in keys) + "  refused  differ  pass")
    for r in result["cases"]:
        if "error" in r:
            print(f"{r['case']:22} {r['kv']:3} ERROR")
            continue
        cells = " ".join(f"{r[k]['max_dlogp']:14.2e}" for k in keys)
        print(f"{r['case']:22} {r['kv']:3} {cells}  {'yes' if r.get('refused') else '-':7} "
              f"{len(r['tensors_differing_from_fresh']):6}  {'ok' if r['passed'] else 'FAIL'}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, default=Path("gpu_lifecycle_check.json"))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--kv", default="off,on", help="off, on or off,on: without / with FLASHRL_KV_CACHE_DTYPE=fp8")
    ap.add_argument("--verl", action="store_true", help="also verl 0.9.1's own sync code (needs verl)")
    ap.add_argument("--jobs", type=int, default=6, help="cases side by side on the GPU")
    ap.add_argument("--bucket-mb", type=int, default=4)
    ap.add_argument("--eager", action="store_true", help="enforce_eager engines (default: compiled)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--no-sleep", action="store_true", help="baseline: engines without sleep mode, pushes only")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--engine-args", type=json.loads, default={})
    ap.add_argument("--sq", type=Path, default=None, help="the sq-int8 case's profile dir (scripts/gpu_stage_sq.sh)")
    ap.add_argument("--report-dir", type=Path, default=None,
                    help="no engines: the table (and --json) of the probes finished in this work dir")
    ap.add_argument("--device", default=None, help="with --report-dir: the GPU the probes ran on")
    args = ap.parse_args()
    if args.report_dir is not None:
        result = {"device": args.device or "?", "vllm": "0.26.0", "verl": args.verl, "sleep_mode": not args.no_sleep,
                  "engines": "eager" if args.eager else "compiled (FULL_AND_PIECEWISE)",
                  "cases": from_dir(args.report_dir, args.verl, args.no_sleep)}
        args.json.write_text(json.dumps(result, indent=2))
        print_table(result, args.verl, args.no_sleep)
        return
    import torch
    import vllm

    work = args.workdir or Path(tempfile.mkdtemp(prefix="gpu-lifecycle-"))
    work.mkdir(parents=True, exist_ok=True)
    models = make_models(work, args.sq)
    todo = [(c, kv) for c in args.cases.split(",") for kv in args.kv.split(",") if not (c.startswith("sq-") and kv == "on")]
    result = {"device": torch.cuda.get_device_name(), "vllm": vllm.__version__, "verl": args.verl,
              "sleep_mode": not args.no_sleep,
              "engines": "eager" if args.eager else "compiled (FULL_AND_PIECEWISE)", "cases": []}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(args.jobs) as pool:  # the JSON is rewritten as each case finishes
        for row in as_completed([pool.submit(run_case, c, kv, models, work, args) for c, kv in todo]):
            result["cases"].append(row.result())
            args.json.write_text(json.dumps(result, indent=2))
    result["cases"].sort(key=lambda r: todo.index((r["case"], r["kv"])))
    args.json.write_text(json.dumps(result, indent=2))
    print_table(result, args.verl, args.no_sleep)


if __name__ == "__main__":
    main()
