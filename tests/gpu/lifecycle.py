"""Real trainers' engine lifecycle on the GPU: one case's two (or three) engines and its verdict.

Per case (FLASHRL_CONFIG x architecture x KV cache) two processes (tests/probes/lifecycle_probe.py), both
compiled (torch.compile + FULL_AND_PIECEWISE CUDA graphs) with `enable_sleep_mode=True`:
  - fresh: the config on the perturbed BF16 weights (HF-initialised random Qwen2 / Qwen3-MoE);
  - lifecycle: the config on the original weights, driven like verl (sleep(2), wake weights, bucketed push
    from one reused buffer poisoned after each bucket, whole-model process_weights_after_loading, reset
    prefix cache, wake kv_cache), like TRL (sleep(2), wake weights, one load_weights per parameter), a
    level-1 cycle, a level-2 wake without a push (must be refused), and verl 0.9.1's own
    update_weights_from_ipc + BucketedWeightSender (CUDA IPC from a trainer process, fp32 tensors).
The verdict: synced vs fresh (no sleep, verl's order, verl's code), restore vs start (TRL's order), level 1
vs before, FP8 KV scales bit-equal, the refusal, verl's own FP8 path not taken, and no parameter, buffer
or kernel-held tensor differing from the fresh engine's after the last sync (`@tp2`: on every rank; the FP8 KV
scales of every rank).
Case `sq-int8` (with FLASHRL_GPU_SQ=DIR: a `flashrl profile` of the SmoothQuant W8A8 checkpoint,
DIR/p.safetensors, and its config.json; scripts/gpu_stage_sq.sh): a calibrated config on SmolLM2. A profile
reproduces its checkpoint only to its exact fraction, so the engine, started on the calibrated checkpoint,
holds the profile applied to the originals after they are pushed back: that case's restores are compared
with a third engine, a plain one on the profile applied to the originals (`start_vs_restore_reference`
reports how far the checkpoint itself is from it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gpu_harness as h

CASES = ["dense-bf16", "dense-int8", "dense-fp8", "dense-fp8_channel", "dense-fp8_block", "dense-int8_keep",
         "dense-w4a16", "dense-w4a16_mix", "moe-int8", "moe-fp8"]
ARCH = {"dense": "qwen2", "moe": "qwen3_moe"}


def make_sq(work: Path, sq: Path) -> tuple[Path, Path, Path, Path, Path]:
    """The calibrated case: (BF16 original, BF16 perturbed, YAML, fresh reference checkpoint, the profile
    applied to the original: the restores' reference)."""
    from flashrl_tools.models.default import ensure_default_model
    from flashrl_tools.profile.apply import requantize_checkpoint
    from flashrl_tools.profile.format import load_profile
    from flashrl_tools.verify.perturb import perturb

    orig, pert, yaml = Path(ensure_default_model()), work / "sq-perturbed", work / "sq.yaml"
    served, prof = work / "sq-orig-int8", work / "sq-profile.safetensors"
    if not (pert / "config.json").is_file():
        perturb(orig, pert, seed=1, match=("",))
    if not (served / "config.json").is_file():  # the calibrated checkpoint, rebuilt from the carried profile
        requantize_checkpoint(orig, load_profile(sq / "p.safetensors"), served, template=sq)
    if not prof.is_file():  # its own profile (the runtime checks that a profile belongs to its checkpoint)
        subprocess.run([sys.executable, "-m", "flashrl_tools", "profile", "-m", str(orig), "-qm", str(served),
                        "-o", str(prof), "--fn", "int8"], check=True, capture_output=True)
    for src, dst in ((pert, work / "sq-pert-int8"), (orig, work / "sq-orig-requant")):
        if not (dst / "config.json").is_file():
            requantize_checkpoint(src, load_profile(prof), dst)
    yaml.write_text(f"version: 1\nconfigs:\n- fn: int8\n  model: {served}\n"
                    f"  profile: {prof}\n  logprobs_mode: processed_logprobs\n")
    return orig, pert, yaml, work / "sq-pert-int8", work / "sq-orig-requant"


def entries_differing(a: Path, b: Path) -> int:
    """Entries (INT8 weights, scales, norms) that differ between two checkpoints of the same names (CPU)."""
    from flashrl_tools.safetensors_io import CheckpointReader

    rb = CheckpointReader(b)
    return sum(int((x != rb.get(n)).sum()) for n, x in CheckpointReader(a).iter_tensors())


def run_case(case: str, work: Path, verl: bool, sq: Path | None = None, bucket_mb: int = 4) -> dict:
    stem = case.replace("@", "-")  # the probes' file names; `@xqa`: both engines under FLASHRL_DECODE_ATTN=xqa
    arch, rest = case.partition("@")[0].split("-", 1)  # observing 40 sequences (XQA asserted); `@tp2`: both
    option = case.partition("@")[2]  # engines tensor-parallel over two GPUs (MoE: experts parallel too)
    xqa, tp = option == "xqa", 2 if option == "tp2" else 1
    config, kv = rest.removesuffix("+kv"), rest.endswith("+kv")
    env = {"FLASHRL_CONFIG": h.config_value(work, config), **({"FLASHRL_KV_CACHE_DTYPE": "fp8"} if kv else {}),
           **(h.XQA if xqa else {})}
    restore_model = None
    if arch == "sq":  # the calibrated config: its YAML; the fresh reference is a plain engine on the profile's output
        orig, pert, yaml, fresh_model, restore_model = make_sq(work, sq)
        env["FLASHRL_CONFIG"] = str(yaml)
        fresh_env = {k: v for k, v in env.items() if k != "FLASHRL_CONFIG"}
    else:
        orig, pert = h.model_pair(work, ARCH[arch])
        fresh_env, fresh_model = env, pert
    ekw = {**h.VLLM_ENGINE, **(h.tp_engine(tp, moe=arch == "moe") if tp > 1 else {})}

    def probe(tag, env, req):
        return h.run_probe("lifecycle_probe", work, f"life-{stem}-{tag}",
                           {**env, "VLLM_CACHE_ROOT": str(work / "vc" / f"{stem}-{tag}")},
                           {"engine_kwargs": ekw, "sleep": True, **({"sequences": h.WIDE} if xqa else {}), **req})

    fresh = probe("fresh", fresh_env, {"model": str(fresh_model), "fresh": True})
    life = probe("life", env, {"model": str(orig), "original": str(orig), "perturbed": str(pert), "verl": verl,
                               "bucket_mb": bucket_mb})
    restore = probe("restore", fresh_env, {"model": str(restore_model), "fresh": True}) if restore_model else None
    if any("error" in r for r in (fresh, life, restore or {})):
        return {"error": {"fresh": fresh.get("log_tail"), "lifecycle": life.get("log_tail"),
                          "restore": (restore or {}).get("log_tail")}}
    row = verdict(fresh, life, verl, restore)
    if kv:  # the decode kernel reads the cache the sleeps kept and the syncs rescaled
        h.expect_decode_attn(row, [fresh.get("flashrl_decode_attn"), life.get("flashrl_decode_attn")])
    if xqa:
        h.expect_xqa(row, [Path(r["log"]).read_text(errors="replace") for r in (fresh, life)])
    if tp > 1:  # both engines sharded, every rank in the digests
        row["tensor_parallel_size"] = [fresh.get("tensor_parallel_size"), life.get("tensor_parallel_size")]
        if row["tensor_parallel_size"] != [tp, tp]:
            row.setdefault("failures", []).append(f"engines at TP {row['tensor_parallel_size']}, {tp} asked")
    if restore_model:
        row["checkpoint_entries_not_reproduced"] = entries_differing(work / "sq-orig-int8", restore_model)
    return row


def verdict(fresh: dict, life: dict, verl: bool, restore_ref: dict | None = None) -> dict:
    """One case's comparisons from the probes' results; `failures` lists the checks that did not hold."""
    f, st = fresh["stages"]["fresh"], life["stages"]
    back = restore_ref["stages"]["fresh"] if restore_ref else st["start"]
    fd, ld = fresh["digest"], life["digest"]
    row = {"push_nosleep_vs_fresh": h.same(st["push_nosleep"], f),
           "back_nosleep_vs_start": h.same(st["back_nosleep"], back),
           "verl_order_vs_fresh": h.same(st["verl_replica"], f),
           "level1_vs_before": h.same(st["level1"], st["verl_replica"]),
           "trl_order_restore_vs_start": h.same(st["trl"], back),
           ("verl_code_vs_fresh" if verl else "verl_order_again_vs_fresh"): h.same(st["verl"], f),
           "changed_by_sync": h.max_diff(st["start"], st["push_nosleep"]),
           "tensors_differing_from_fresh": sorted(n for n in fd.keys() & ld.keys() if fd[n] != ld[n]),
           "tensors_only_in_one": sorted(fd.keys() ^ ld.keys())[:20],
           "refused": life["refused"], "verl_fp8_path_taken": st.get("verl_fp8_path"),
           "inplace_layers": life.get("inplace_layers"), "timing": life.get("timing")}
    if restore_ref:  # not a check: how far the calibrated checkpoint is from its profile's reproduction
        row["start_vs_restore_reference"] = h.max_diff(st["start"], back)
    failed = h.failures(row)
    if row["tensors_differing_from_fresh"]:
        failed.append(f"tensors differing from the fresh engine's: {row['tensors_differing_from_fresh'][:5]}")
    if "full weight sync" not in (row["refused"] or ""):
        failed.append(f"a wake without a push was not refused ({row['refused']})")
    if row["verl_fp8_path_taken"]:
        failed.append("verl took its own FP8 weight path")
    row["failures"] = failed
    return row
