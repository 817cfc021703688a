"""`flashrl verify reload`: does a weight sync land exactly where and how it should?

One engine starts with the config on the BF16 policy; BF16 checkpoints are pushed into it the
way a trainer does (`model.load_weights`, one tensor per call): the policy itself, then updated
(perturbed) weights, then the policy again. After each push its greedy tokens and teacher-forced
logprobs of fixed sequences are compared with a fresh engine started from the offline
quantization of the same BF16 weights (`quantize`, or `requantize` with the config's profile;
vLLM's own online FP8 for `fp8`). Both sides then run the same kernels on what must be
bit-identical weights, so the tolerance only absorbs reduction-order noise; a no-op sync, a
misplaced tensor, stale scales or a missing norm rescale move logprobs by far more.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from flashrl_tools.fsutil import atomic_write_text

from flashrl_tools.quant.mixed import KeepSpec
from flashrl_tools.config.resolve import RuntimeConfig
from flashrl_tools.verify.engines import engine_job, run_engine
from flashrl_tools.verify.perturb import ALL_TRAINED, perturb
from flashrl_tools.prompts import load_prompts, tokenize

DEFAULT_TOL = 1e-3  # nats; measured difference between a synced and a fresh engine: 0.0
MAX_TOKENS = 8


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str


def compare(a: dict, b: dict) -> tuple[float, int, int]:
    """(max |delta logprob| over all teacher-forced positions, equal greedy sequences, total)."""
    diff = max(abs(x - y) for la, lb in zip(a["logprobs"], b["logprobs"]) for x, y in zip(la, lb))
    equal = sum(ta == tb for ta, tb in zip(a["tokens"], b["tokens"]))
    return diff, equal, len(a["tokens"])


def same_check(name: str, a: dict, b: dict, tol: float) -> Check:
    diff, equal, total = compare(a, b)
    ok = diff <= tol and equal == total
    return Check(name, ok, f"max |Δ log p| {diff:.2e} (tol {tol:g}), greedy outputs equal {equal}/{total}")


def changed_check(name: str, a: dict, b: dict, tol: float) -> Check:
    diff, _, _ = compare(a, b)
    return Check(name, diff > 10 * tol, f"max |Δ log p| {diff:.2e} (must exceed {10 * tol:g})")


def reference_model(rc: RuntimeConfig, bf16: Path, out: Path, engine: str = "vllm") -> tuple[Path, str | None]:
    """The fresh engine a correct sync of `bf16` must equal: (model dir, FLASHRL_CONFIG)."""
    if not rc.fn.quantized:
        return bf16, None
    fn = rc.fn.value
    if engine == "vllm" and rc.fn.vllm_online_fp8:  # vLLM's online FP8 of the BF16 weights (its runtime)
        return bf16, "fp8"
    from flashrl_tools.model_structure import is_moe
    from flashrl_tools.runtime import engine_capabilities
    from flashrl_tools.runtime.core.plan import served_format

    fn = served_format(rc, engine_capabilities(engine), is_moe(rc.entry.model or bf16))[0].value
    if rc.entry.profile is not None:
        from flashrl_tools.profile.apply import requantize_checkpoint
        from flashrl_tools.profile.format import load_profile

        return requantize_checkpoint(bf16, load_profile(Path(rc.entry.profile)), out, force=True,
                                     keep=KeepSpec.of(rc.entry)), None
    from flashrl_tools.quant.quantize import quantize

    from flashrl_tools.model_structure import read_config
    from flashrl_tools.quant.quant_config import has_pow2_scales

    # online: the config's key; a given checkpoint: its own mark
    model_pow2 = rc.entry.model is not None and has_pow2_scales(read_config(Path(rc.entry.model)))
    pow2 = rc.entry.fp8_scale_pow2 or model_pow2
    return quantize(bf16, out, fn, force=True, keep=KeepSpec.of(rc.entry), pow2=pow2).out, None


def sequences_for(bf16: Path, count: int = 4) -> list[list[int]]:
    return tokenize(load_prompts()[:count], bf16)


def reference_outputs(rc: RuntimeConfig, bf16: Path, perturbed: Path, sequences, work: Path,
                      progress=lambda s: None, engine: str = "vllm") -> dict:
    refs = {}
    for tag, src in (("original", bf16), ("perturbed", perturbed)):
        progress(f"fresh engine on the offline quantization of the {tag} weights")
        model, config = reference_model(rc, src, work / f"reference-{tag}", engine)
        kv = rc.entry.kv_cache_dtype if rc.entry.fp8_kv_cache else None
        if kv and config is None:  # the runtime calibrates FP8 KV scales: it must run there too
            config = "bf16"  # (serves `model` as it is; the reference receives no sync)
        refs[tag] = run_engine(model, [{"op": "observe", "sequences": sequences, "max_tokens": MAX_TOKENS}],
                               config, f"reference ({tag})", kv_cache_dtype=kv, engine=engine)[0]
    return refs


def synced_outputs(rc: RuntimeConfig, bf16: Path, perturbed: Path, sequences, fault: str | None = None,
                   engine: str = "vllm") -> list[dict]:
    obs = {"op": "observe", "sequences": sequences, "max_tokens": MAX_TOKENS}
    steps = [obs, {"op": "push", "path": str(bf16)}, obs, {"op": "push", "path": str(perturbed)}, obs,
             {"op": "push", "path": str(bf16)}, obs]
    kv = rc.entry.kv_cache_dtype if rc.entry.fp8_kv_cache else None
    results = run_engine(bf16, steps, rc.source, "synced", fault=fault, kv_cache_dtype=kv, engine=engine)
    return [results[i] for i in (0, 2, 4, 6)]


def evaluate(synced: list[dict], refs: dict, tol: float) -> list[Check]:
    start, after_policy, after_update, after_restore = synced
    return [
        same_check("sync of the policy's weights = fresh engine", after_policy, refs["original"], tol),
        changed_check("sync of updated weights changes the outputs", after_policy, after_update, tol),
        same_check("sync of updated weights = fresh engine", after_update, refs["perturbed"], tol),
        same_check("restore: policy pushed back = first sync", after_restore, after_policy, tol),
    ] + ([
        kv_scales_check("FP8 KV scales after the policy's sync = fresh engine's", after_policy, refs["original"]),
        kv_scales_check("FP8 KV scales recalibrated for updated weights = fresh engine's", after_update,
                        refs["perturbed"]),
        kv_scales_check("FP8 KV scales after restore = first sync's", after_restore, after_policy),
    ] if "kv_scales" in after_update else [])


def kv_scales_check(name: str, a: dict, b: dict) -> Check:
    """Recalibration is deterministic: equal weights must give bit-equal scales."""
    sa, sb = a.get("kv_scales", {}), b.get("kv_scales", {})
    if set(sa) != set(sb):
        return Check(name, False, f"different attention layers ({len(sa)} vs {len(sb)})")
    diff = [f"{layer}.{kind}" for layer in sa for kind in sa[layer] if sa[layer][kind] != sb[layer].get(kind)]
    kinds = "/".join(next(iter(sa.values()), {}))  # q/k/v on vLLM, k/v on SGLang (it does not scale q)
    detail = f"{len(sa)} layers x {kinds} equal" if not diff else f"{len(diff)} scales differ (first: {diff[0]})"
    return Check(name, not diff, detail)


def _reference_key(rc: RuntimeConfig, bf16: Path, engine: str = "vllm") -> dict:
    files = sorted(Path(bf16).glob("*.safetensors"))
    return {"engine": engine, "config": rc.source, "kv_cache_dtype": rc.entry.kv_cache_dtype, "model": str(Path(bf16).resolve()),
            "profile": rc.entry.profile, "entry": rc.entry.model_dump(mode="json"),
            "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]}


def verify_reload(rc: RuntimeConfig, bf16: Path, work: Path, tol: float = DEFAULT_TOL, fault: str | None = None,
                  progress=lambda s: None, engine: str = "vllm") -> tuple[list[Check], dict]:
    """Returns the checks and the fresh engines' outputs. `work` keeps the perturbed checkpoint
    and the fresh engines' outputs; a rerun with the same config and model reuses them."""
    engine_job(engine)  # an unknown or missing engine fails before anything is written
    sequences = sequences_for(bf16)
    perturbed = work / "perturbed-bf16"
    if not (perturbed / "config.json").is_file():
        progress("perturbing the BF16 weights (a stand-in for an optimizer step)")
        shutil.rmtree(perturbed, ignore_errors=True)
        perturb(bf16, perturbed, match=ALL_TRAINED)
    cache, key = work / "references.json", _reference_key(rc, bf16, engine)
    cached = json.loads(cache.read_text()) if cache.is_file() else {}
    if cached.get("key") == key:
        refs = cached["references"]
    else:
        refs = reference_outputs(rc, bf16, perturbed, sequences, work, progress, engine)
        atomic_write_text(cache, json.dumps({"key": key, "references": refs}))
    progress(f"engine with FLASHRL_CONFIG={rc.source}: push policy, updated weights, policy")
    synced = synced_outputs(rc, bf16, perturbed, sequences, fault, engine)
    return evaluate(synced, refs, tol), refs


def checks_json(checks: list[Check]) -> list[dict]:
    return [asdict(c) for c in checks]
