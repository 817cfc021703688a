"""`flashrl tune`: the fewest layers kept in BF16 for a token-KL budget, verified with the engine.

1. Rank: every unit (a vLLM layer: qkv, o, gate_up, down per decoder layer) fake-quantized alone
   in transformers; token KL from the BF16 model on the policy's own samples (tuning prompts).
2. Curve: keep the k most sensitive units in BF16, for k on a grid: KL vs fraction of linear-weight
   bytes in 8 bit.
3. Budget: `--max-kl K` (the `verify drift` token KL of the engine), or `--max-kl-ratio R`: K = R x
   the BF16 engine's own drift (the floor). One `verify drift` of the all-8-bit config on the
   tuning prompts gives the floor and maps fake-quant KL to engine KL (engine minus floor, over
   fake-quant: the scale `alpha`).
4. Pick: the fewest units with alpha x fake KL <= K - floor, then `verify drift` of that config on
   prompts and samples not used to tune; a miss moves to the next curve point (up to `tries`).
5. With `--w4a16`, from the verified 8-bit pick: each 8-bit unit W4A16 can serve moved to 4 bits alone (the rest
   as picked), ranked least sensitive first; the KL-vs-bytes curve of moving the first m; the most units whose
   estimate meets the budget, verified with `verify drift` (a miss tries fewer).
The config (YAML, `keep_bf16` listing the kept units, `w4a16_layers` the 4-bit ones) and a report (JSON + PNG
curve) are written atomically; the prompts are split: even-numbered for tuning, odd-numbered for the verification.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from flashrl_tools.errors import FlashRLError
from flashrl_tools.fsutil import atomic_write_text
from flashrl_tools.quant.mixed import fp8_block_unservable, kept_modules, layer_index
from flashrl_tools.quant.formats import QuantFn, Strategy
from flashrl_tools.config.schema import RolloutConfig
from flashrl_tools.tune import search

DEFAULT_RATIO = 3.0  # the goal: token KL <= 3x the BF16 engine's own floor


@dataclass(frozen=True)
class TuneSettings:
    max_kl: float | None = None
    max_kl_ratio: float | None = None  # DEFAULT_RATIO when neither is given
    n_tune: int = 16  # sequences the fake-quant KL is measured on
    n_verify: int = 64  # rollouts per engine in `verify drift`
    max_tokens: int = 64
    seed: int = 0
    tries: int = 3


def base_entry(fn: QuantFn, config: Path | None, pow2: bool = False) -> RolloutConfig:
    """What to start from: the RTN format (FP8: power-of-two scales if asked), or a calibrated
    YAML (SmoothQuant profile)."""
    from flashrl_tools.config.resolve import resolve
    from flashrl_tools.setup.write import build_entry

    if config is None:
        return build_entry(fn.value, None, None, {"fp8_scale_pow2": True} if pow2 else {})
    if pow2:
        raise FlashRLError("--pow2-scales with --config: set fp8_scale_pow2 in that config instead", str(config))
    entry = resolve(str(config)).entry
    if entry.fn.value != fn.value:
        raise FlashRLError(f"--config is for fn {entry.fn.value} but --fn is {fn.value}", str(config))
    if entry.keep_bf16 or entry.first_layers_bf16 or entry.last_layers_bf16:
        raise FlashRLError("--config already keeps layers in BF16", str(config), "start from the config without them")
    return entry


def tune(bf16: Path, fn: QuantFn, out_config: Path, report_path: Path, settings: TuneSettings = TuneSettings(),
         config: Path | None = None, prompts_file: Path | None = None, progress=lambda s: None,
         bar=lambda done, total: None, pow2: bool = False, four_bit: bool = False) -> dict:
    from flashrl_tools.model_structure import model_layout
    from flashrl_tools.profile.format import load_profile
    from flashrl_tools.tune.fakequant import FakeQuantModel, SequenceBatch, sample_responses, token_kl
    from flashrl_tools.prompts import load_prompts, tokenize

    if settings.max_kl is not None and settings.max_kl_ratio is not None:
        raise FlashRLError("give --max-kl or --max-kl-ratio, not both")
    ratio = settings.max_kl_ratio if settings.max_kl is None else None
    ratio = DEFAULT_RATIO if settings.max_kl is None and ratio is None else ratio
    entry = base_entry(fn, config, pow2)
    _BF16_RUNS.clear()  # this tune's own
    if fn.packed:
        raise FlashRLError(f"tune --fn {fn.value}: tune starts from an 8-bit format", None,
                           "use --fn int8 (or an FP8 format) with --w4a16 to move layers to 4 bits")
    if four_bit and entry.profile:
        raise FlashRLError("--w4a16 with a calibrated --config: 4-bit layers beside a profile are not served yet",
                           str(config), "drop --config (round-to-nearest int8) or --w4a16")
    profile = load_profile(Path(entry.profile)) if entry.profile else None
    linear = set(profile.meta.quantized) if profile else set(model_layout(bf16).linear_weights)
    prompts = load_prompts(prompts_file)
    if len(prompts) < 2:
        raise FlashRLError("tune needs at least 2 prompts (half tune, half verify)", str(prompts_file or "built-in"))
    tune_prompts, verify_prompts = prompts[0::2], prompts[1::2]

    seconds, t0 = {}, time.perf_counter()
    progress("loading the BF16 policy (transformers, fp32) and fake-quantizing every linear layer")
    fq = FakeQuantModel(bf16, fn, linear, profile, entry.fp8_scale_pow2)
    ids = tokenize(tune_prompts, bf16)
    chosen = [ids[i % len(ids)] for i in range(settings.n_tune)]
    progress(f"sampling {settings.n_tune} responses from the BF16 policy")
    responses = sample_responses(fq.model, chosen, settings.max_tokens, settings.seed)
    batch = SequenceBatch.of(chosen, responses).to(fq.device)
    fq.cache_layer_outputs(batch)
    logp = fq.response_logprobs(batch)

    def measure(quantized: set[str], four: set[str] = frozenset()) -> float:
        fq.set_quantized(quantized, four)
        first = min((layer_index(u) for u in quantized | four if layer_index(u) is not None), default=0)
        return token_kl(fq.response_logprobs(batch, replay_layers=first), logp)

    # fp8_block: units vLLM cannot serve in blocks stay BF16 in every config tried (first in `order`)
    forced = fp8_block_unservable({n: tuple(lin.original.shape) for n, lin in fq.linears.items()}) \
        if fn.strategy is Strategy.block else []
    if forced and len(forced) == len(fq.units):
        raise FlashRLError("vLLM cannot serve any linear layer of this model in fp8_block (input widths or fused "
                           "shards not multiples of 128)", str(bf16), "use --fn fp8_channel or int8")
    if forced:
        progress(f"{len(forced)} layers kept in BF16: vLLM cannot serve them in fp8_block (not multiples of 128)")
    names = [u for u in fq.units if u not in forced]
    progress(f"sensitivity of {len(names)} layers (each 8-bit alone)")
    sens = search.sensitivities(names, measure, bar)
    order = forced + search.ranking(sens)
    progress("KL vs fraction of weights in 8 bit")
    ks = sorted({len(forced)} | {k for k in search.grid(len(order)) if k >= len(forced)})
    points = search.curve(order, fq.unit_bytes, measure, ks, bar)
    seconds["rank_and_curve"], t0 = time.perf_counter() - t0, time.perf_counter()

    with tempfile.TemporaryDirectory(prefix="flashrl-tune-") as tmp:
        work = Path(tmp)
        verify_file = work / "verify_prompts.txt"
        tune_file = work / "tune_prompts.txt"
        verify_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in verify_prompts))
        tune_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in tune_prompts))

        progress("verify drift of the all-8-bit config (tuning prompts): the BF16 floor and the KL scale")
        full = _drift(entry, forced, bf16, work / "full.yaml", tune_file, settings, settings.seed)
        floor, full_kl = full["floor"], full["kl"]
        seconds["all_8bit_drift"], t0 = time.perf_counter() - t0, time.perf_counter()
        budget = settings.max_kl if settings.max_kl is not None else ratio * floor
        fake0 = points[0].kl  # the all-8-bit config (fp8_block: but its unservable units)
        alpha = (full_kl - floor) / fake0 if fake0 > 0 and full_kl > floor else 1.0
        target = (budget - floor) / alpha
        progress(f"budget {budget:.4g} (floor {floor:.4g}); fake-quant target {target:.4g}")
        candidate = search.pick(order, fq.unit_bytes, measure, points, target) if target > 0 else None
        verifications, picked = [], None
        if candidate is not None:
            # all units in BF16 is not an 8-bit config: the curve's last point is never verified
            ks = sorted({candidate.kept} | {p.kept for p in points if p.kept > candidate.kept} - {len(order)})
            for k in ks[: settings.tries]:
                progress(f"verify drift with {k} layers in BF16 (fresh prompts and samples)")
                keep = order[:k]
                v = _drift(entry, keep, bf16, work / f"keep{k}.yaml", verify_file, settings, settings.seed + 1)
                fraction = sum(fq.unit_bytes[u] for u in order[k:]) / sum(fq.unit_bytes.values())
                verifications.append({"kept": k, "fraction_8bit": fraction, "engine_kl": v["kl"],
                                      "floor": v["floor"], "passed": v["kl"] <= budget})
                if v["kl"] <= budget:
                    picked = (k, keep, fraction)
                    break
        seconds["pick_and_verify"], t0 = time.perf_counter() - t0, time.perf_counter()
        four = None
        if four_bit:
            four = _four_bit_step(fq, order, picked, measure, target, budget, entry, bf16, work, verify_file,
                                  settings, progress, bar)
            seconds["four_bit"] = time.perf_counter() - t0

    report = {
        "model": str(bf16), "fn": fn.value, "base_config": str(config) if config else fn.value,
        "settings": asdict(settings),
        "budget": {"max_kl": budget, "ratio": ratio, "floor": floor, "all_8bit_engine_kl": full_kl,
                   "alpha": alpha, "fake_quant_target": target},
        "units": [{"unit": u, "weights": len(fq.units[u]), "bytes_bf16": fq.unit_bytes[u], "sensitivity": sens.get(u),
                   "rank": order.index(u) + 1} for u in fq.units],
        "forced_bf16": forced,
        "curve": [p.to_dict() for p in points],
        "candidate": candidate.to_dict() if candidate else None,
        "verifications": verifications,
        "met": picked is not None,
        "seconds": seconds,
    }
    if four is not None:
        report["four_bit"] = four
    if picked is not None:
        k, keep, fraction = picked
        w4 = (four or {}).get("pick") or []
        chosen_entry = entry.model_copy(update={"keep_bf16": keep, "w4a16_layers": w4})
        report["pick"] = {"kept_units": keep, "kept_modules": kept_modules(
            [w for u in keep for w in fq.units[u]]), "fraction_8bit": fraction, "w4a16_units": w4,
            "bytes_vs_bf16": search.bytes_vs_bf16(fq.unit_bytes, set(keep), set(w4)),
            "bf16_bytes": sum(fq.unit_bytes[u] for u in keep), "config": str(out_config)}
        from flashrl_tools.setup.write import setup

        setup(out_config, chosen_entry)
    report_path = Path(report_path)
    atomic_write_text(report_path, json.dumps(report, indent=1))
    plot_curve(report, report_path.with_suffix(".png"))
    return report


def _four_bit_step(fq, order: list[str], picked, measure, target: float, budget: float, entry: RolloutConfig,
                   bf16: Path, work: Path, verify_file: Path, settings: TuneSettings, progress, bar) -> dict:
    """Step 5 (module docstring): which 8-bit units of the verified pick go to W4A16; `pick` the verified ones."""
    if picked is None:
        return {"skipped": "no 8-bit config met the budget", "pick": None}
    keep = set(picked[1])
    eight = set(order) - keep
    eligible = [u for u in order if u in eight and fq.four_bit_ok(u)]
    if not eligible:
        return {"skipped": "no 8-bit layer can be served W4A16 (input columns not in groups of 128)", "pick": None}
    progress(f"4-bit sensitivity of {len(eligible)} layers (each moved from 8 to 4 bits alone)")
    sens = search.sensitivities(eligible, lambda four: measure(eight, four), bar)
    ranked = sorted(eligible, key=lambda u: (sens[u], eligible.index(u)))  # least sensitive first
    progress("KL vs bytes with the least sensitive layers at 4 bits")
    points = search.four_bit_curve(ranked, fq.unit_bytes, keep, lambda four: measure(eight, four), bar)
    out = {"eligible": len(eligible), "sensitivity": sens, "order": ranked, "curve": [p.to_dict() for p in points],
           "verifications": [], "pick": None}
    for p in search.pick_four(points, target)[: settings.tries]:
        units = ranked[: p.four]
        progress(f"verify drift with {p.four} layers at 4 bits (fresh prompts and samples)")
        v = _drift(entry, list(picked[1]), bf16, work / f"four{p.four}.yaml", verify_file, settings,
                   settings.seed + 1, units)
        out["verifications"].append({"four": p.four, "bytes_vs_bf16": p.bytes_vs_bf16, "engine_kl": v["kl"],
                                     "floor": v["floor"], "passed": v["kl"] <= budget})
        if v["kl"] <= budget:
            out["pick"] = units
            break
    return out


_BF16_RUNS: dict = {}  # the BF16 engine's rollouts per prompts / sampling, shared by one tune's verifications


def _drift(entry: RolloutConfig, keep: list[str], bf16: Path, yaml_path: Path, prompts: Path,
           settings: TuneSettings, seed: int, four: list[str] = ()) -> dict:
    from flashrl_tools.config.resolve import resolve
    from flashrl_tools.setup.write import setup
    from flashrl_tools.verify.drift import Settings, run_drift

    setup(yaml_path, entry.model_copy(update={"keep_bf16": keep, "w4a16_layers": list(four)}))
    report = run_drift(resolve(str(yaml_path)), bf16, Settings(n=settings.n_verify, max_tokens=settings.max_tokens,
                                                              seed=seed), prompts, bf16_runs=_BF16_RUNS)
    return {"floor": report["engines"]["bf16"]["metrics"]["kl_k3"],
            "kl": report["engines"]["quantized"]["metrics"]["kl_k3"]}


def plot_curve(report: dict, path: Path) -> None:
    """KL against linear-weight bytes (over BF16's): the 8-bit curve, the 4-bit step's, the engine's checks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    b = report["budget"]
    est = lambda kl: max(kl * b["alpha"] + b["floor"], 1e-6)  # noqa: E731
    ax.plot([1 - p["fraction_8bit"] / 2 for p in report["curve"]], [est(p["kl"]) for p in report["curve"]], "o-",
            label="8-bit, k layers BF16: floor + alpha x fake-quant KL (tuning sample)")
    four = report.get("four_bit") or {}
    if four.get("curve"):
        ax.plot([p["bytes_vs_bf16"] for p in four["curve"]], [est(p["kl"]) for p in four["curve"]], "s-",
                color="purple", label="then m layers W4A16 (estimate)")
    ax.axhline(b["max_kl"], color="red", ls="--", label=f"budget {b['max_kl']:.3g}")
    ax.axhline(b["floor"], color="gray", ls=":", label=f"BF16 engine floor {b['floor']:.3g}")
    ax.plot([0.5], [b["all_8bit_engine_kl"]], "ks", label="engine, all 8-bit (tuning sample)")
    for v in report["verifications"]:
        ax.plot([1 - v["fraction_8bit"] / 2], [v["engine_kl"]], "g*" if v["passed"] else "rx", ms=11,
                label=f"engine, {v['kept']} layers BF16 (fresh sample)")
    for v in four.get("verifications", []):
        ax.plot([v["bytes_vs_bf16"]], [v["engine_kl"]], "m*" if v["passed"] else "rx", ms=11,
                label=f"engine, {v['four']} layers 4-bit (fresh sample)")
    ax.set_yscale("log")
    ax.set_xlabel("linear-weight bytes / BF16's")
    ax.set_ylabel("token KL (rollout || trainer)")
    base = report["base_config"]
    start = report["fn"] if base == report["fn"] else f"{report['fn']} from {Path(base).name}"
    ax.set_title(f"flashrl tune ({start}): {Path(report['model']).name}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
