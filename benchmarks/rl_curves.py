"""Trainer logs -> learning curves (PNG) and a table (JSON, markdown): does an 8-bit rollout still learn, and
how much faster is its step?

    python benchmarks/rl_curves.py --out docs/rl/verl-smollm2 bf16/0=logs/bf16-s0.jsonl int8/0=... ...
    python benchmarks/rl_curves.py --out docs/rl/arms --dir benchmarks/results/training_arms   # every run there

Each RUN is CONFIG/SEED=PATH. PATH is a log of examples/trl_grpo.py (one JSON object per step) or
verl's file logger (`trainer.logger=[...,"file"]`: {"step", "data": {...}} per step); the format is
recognised per line; a verl log's sidecar RUN.heldout.jsonl (examples/verl/heldout_eval.py) is read with it, and
its RUN.log (scripts/gpu_verl_runs.sh: the run's output) for the engines' FLASHRL_CODE_CHANGES lines (per sync, the
share of 4-bit codes it changed). Per step it reads:

| measure | verl key | TRL example key |
| --- | --- | --- |
| reward | critic/score/mean | reward |
| token KL(rollout ‖ trainer) | rollout_corr/kl | - (TRL does not log it) |
| \\|Δ mean log p\\| per sequence | rollout_corr/log_ppl_abs_diff | - |
| mean \\|Δ log p\\| per token | rollout_corr/flashrl_abs_logp_diff_mean | sampling/sampling_logp_difference/mean |
| p99 \\|Δ log p\\| per token | rollout_corr/flashrl_abs_logp_diff_p99 | - |
| IS weights clipped (fraction) | rollout_corr/rollout_is_ratio_fraction_high + _low | - |
| tokens with p_train / p_rollout > 2 | rollout_corr/flashrl_ratio_above_2 | - |
| response length | response_length/mean | - |
| rollout seconds | timing_s/gen | rollout_seconds |
| held-out accuracy (a BF16 engine on the trainer's weights) | heldout/bf16_accuracy | heldout_accuracy |

Writes OUT.md (the table of the README / RESULTS: `markdown`), OUT.png (reward, held-out accuracy, mismatch,
rollout seconds vs step; per config the seeds' mean with a band from the lowest to the highest seed) and
OUT.json: per run the final reward (mean of the last
`--last` steps), the last held-out accuracy, the area under the reward curve (its mean over the steps),
the first step whose `--last`-step mean reward reaches `--target`, the held-out accuracy at the first evaluation
(step 0: the start model) and the last, mean mismatch and rollout seconds (over
steps <= `--until` when given), the final engine check when the log has one (and its verdict: check_verdict);
per config the verdicts counted, the seeds' mean,
spread and 95 % interval (Student's t over the seeds) of the final reward and held-out accuracy, and for
every config but bf16 whether its final reward lies within the bf16 seeds' spread (or how far outside) and
whether its 95 % interval is apart from bf16's (`separable_from_bf16`; `heldout_separable_from_bf16` the
same for the held-out accuracy). `comparisons`: each arm minus bf16 and each precision's TIS effect (CONFIG -
CONFIG-notis, CONFIG-mis - CONFIG) as differences of seed means with Welch 95 % intervals, for the final held-out
accuracy, its area under the curve (the mean over the evaluations) and the final reward; `--target-acc` adds the
first evaluated step reaching that held-out accuracy. The verl keys `rollout_corr/flashrl_*` come from
flashrl_tools/verl_metrics.py.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections import Counter
from pathlib import Path

MEASURES = {  # name -> (verl keys summed, TRL keys summed)
    "reward": (["critic/score/mean"], ["reward"]),
    "token_kl": (["rollout_corr/kl"], []),
    "abs_dlogp": (["rollout_corr/log_ppl_abs_diff"], ["sampling/sampling_logp_difference/mean"]),
    "abs_dlogp_token": (["rollout_corr/flashrl_abs_logp_diff_mean"], ["sampling/sampling_logp_difference/mean"]),
    "abs_dlogp_p99": (["rollout_corr/flashrl_abs_logp_diff_p99"], []),
    "is_clipped_frac": (["rollout_corr/rollout_is_ratio_fraction_high", "rollout_corr/rollout_is_ratio_fraction_low"],
                        []),
    "ratio_above_2": (["rollout_corr/flashrl_ratio_above_2"], []),
    "response_len": (["response_length/mean"], []),
    "rollout_s": (["timing_s/gen"], ["rollout_seconds"]),
    "heldout_acc": (["heldout/bf16_accuracy"], ["heldout_accuracy"]),
}
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)  # two-sided 95 %, 1-10 dof


class LogError(ValueError):
    pass


def read_log(path: Path) -> tuple[list[dict], dict | None]:
    """(per-step measures, the final engine check or None) of one trainer log; lines of the same step (the
    trainer's, a later evaluation's) are one step."""
    steps: dict[int, dict] = {}
    final = None
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise LogError(f"cannot read {path}: {e.strerror}") from None
    sidecar = path.with_name(path.name.removesuffix(".jsonl") + ".heldout.jsonl")
    if sidecar.is_file():  # examples/verl/heldout_eval.py's results for this run
        lines += sidecar.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise LogError(f"{path}:{n}: not a JSON line") from None
        if "final_check" in row:
            final = row["final_check"]
            continue
        verl = isinstance(row.get("data"), dict)
        values = row["data"] if verl else row
        if "step" not in row:
            raise LogError(f"{path}:{n}: no 'step' (not a TRL example or verl file-logger line)")
        out = steps.setdefault(int(row["step"]), {"step": int(row["step"]), **dict.fromkeys(MEASURES)})
        for name, (verl_keys, trl_keys) in MEASURES.items():
            keys = verl_keys if verl else trl_keys
            got = [values[k] for k in keys if isinstance(values.get(k), (int, float))]
            if keys and len(got) == len(keys):
                out[name] = sum(got)
    if not steps:
        raise LogError(f"{path}: no steps")
    return [steps[k] for k in sorted(steps)], final


CODES_LINE = re.compile(r"4-bit codes changed: ([0-9.]+) % of")


def read_code_changes(path: Path) -> list[float]:
    """Per sync, the % of 4-bit codes the sync changed (FLASHRL_CODE_CHANGES=1: runtime/core/code_changes.py's line
    in the run's RUN.log beside its RUN.jsonl, one a sync and engine); [] without that log or those lines."""
    log = path.with_name(path.name.removesuffix(".jsonl") + ".log")
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    return [float(m.group(1)) for m in CODES_LINE.finditer(text)]


def codes_summary(shares: list[float]) -> dict | None:
    """A run's code changes: syncs seen, the median and least % a sync changed, the syncs that changed none."""
    if not shares:
        return None
    return {"syncs": len(shares), "median_pct": statistics.median(shares), "min_pct": min(shares),
            "syncs_with_none": sum(x == 0 for x in shares)}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.fmean(values) if values else None


def interval(values: list) -> list[float] | None:
    """The 95 % interval of the mean of seeds' values (Student's t), or None for fewer than two."""
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return None
    t = T95[len(values) - 2] if len(values) <= len(T95) + 1 else 1.96
    m, half = statistics.fmean(values), t * statistics.stdev(values) / math.sqrt(len(values))
    return [m - half, m + half]


def difference(a: list, b: list) -> dict | None:
    """mean(a) - mean(b) with its 95 % interval (Welch's t: unequal variances, Welch-Satterthwaite degrees of
    freedom), and whether the interval excludes 0; None unless both have two values or more."""
    a, b = [v for v in a if v is not None], [v for v in b if v is not None]
    if len(a) < 2 or len(b) < 2:
        return None
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    diff, se = statistics.fmean(a) - statistics.fmean(b), math.sqrt(va + vb)
    if se == 0:
        return {"diff": diff, "ci95": [diff, diff], "separable": diff != 0}
    dof = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    t = T95[max(1, math.floor(dof)) - 1] if dof < len(T95) + 1 else 1.96  # floor: the wider, conservative t
    lo, hi = diff - t * se, diff + t * se
    return {"diff": diff, "ci95": [lo, hi], "separable": lo > 0 or hi < 0}


def steps_to_accuracy(steps: list[dict], target: float | None) -> int | None:
    """The first evaluated step whose held-out accuracy reaches `target`."""
    if target is None:
        return None
    return next((r["step"] for r in steps if r["heldout_acc"] is not None and r["heldout_acc"] >= target), None)


def steps_to(steps: list[dict], target: float | None, window: int) -> int | None:
    """The first step whose last `window` steps' mean reward reaches `target`."""
    if target is None:
        return None
    rewards = [(r["step"], r["reward"]) for r in steps if r["reward"] is not None]
    for i in range(len(rewards)):
        if statistics.fmean(v for _, v in rewards[max(0, i - window + 1):i + 1]) >= target:
            return rewards[i][0]
    return None


def check_verdict(final: dict | None) -> str | None:
    """A run's final engine check (examples/verl/final_check.py): "equal" (the synced engine held a fresh engine's
    bits), "equal but KV scales" (only FP8 KV-cache scales differ -- which an engine recalibrates after each sync and
    the check leaves out; checks written before it also left out vLLM's CPU copies of them name those), "differs",
    or None (no check)."""
    if not final:
        return None
    if final.get("equal"):
        return "equal"
    from flashrl_tools.runtime.core.digest import KV_SCALE_NAMES

    names = set(final.get("differing_by_name") or {})
    if names and names <= KV_SCALE_NAMES and not final.get("tensors_only_in_one"):
        return "equal but KV scales"
    return "differs"


def summarize(runs: dict[str, list[dict]], finals: dict[str, dict | None], last: int,
              target: float | None = None, target_acc: float | None = None, codes: dict | None = None) -> dict:
    """`codes`: per run label, its syncs' % of 4-bit codes changed (read_code_changes)."""
    codes = codes or {}
    table = {"runs": {}, "configs": {}}
    for label, steps in runs.items():
        tail = steps[-last:]
        heldout = [r["heldout_acc"] for r in steps if r["heldout_acc"] is not None]
        table["runs"][label] = {
            "steps": len(steps), "final_reward": _mean(r["reward"] for r in tail),
            "first_reward": _mean(r["reward"] for r in steps[:last]),
            "final_heldout_acc": heldout[-1] if heldout else None, "first_heldout_acc": heldout[0] if heldout else None,
            "reward_auc": _mean(r["reward"] for r in steps),
            "heldout_auc": _mean(heldout),  # the mean over the evaluations (every CHECK_EVERY steps)
            "steps_to_target": steps_to(steps, target, last),
            "steps_to_heldout_target": steps_to_accuracy(steps, target_acc),
            **{f"mean_{m}": _mean(r[m] for r in steps) for m in MEASURES if m not in ("reward", "heldout_acc")},
            "final_engine_check": finals.get(label), "engine_check": check_verdict(finals.get(label)),
            "codes_changed": codes_summary(codes.get(label, []))}
    by_config: dict[str, list[str]] = {}
    for label in runs:
        by_config.setdefault(label.split("/")[0], []).append(label)
    for config, labels in by_config.items():
        rows = [table["runs"][lb] for lb in labels]
        finals_r = [r["final_reward"] for r in rows]
        heldout = [r["final_heldout_acc"] for r in rows]
        table["configs"][config] = {"seeds": len(labels), "final_reward_mean": _mean(finals_r),
                                    "final_reward_min": min(finals_r), "final_reward_max": max(finals_r),
                                    "final_reward_ci95": interval(finals_r),
                                    "final_heldout_acc_mean": _mean(heldout), "final_heldout_acc_ci95": interval(heldout),
                                    "final_heldout_acc_min": min((h for h in heldout if h is not None), default=None),
                                    "final_heldout_acc_max": max((h for h in heldout if h is not None), default=None),
                                    "first_heldout_acc_mean": _mean(r["first_heldout_acc"] for r in rows),
                                    "reward_auc_mean": _mean(r["reward_auc"] for r in rows),
                                    "heldout_auc_mean": _mean(r["heldout_auc"] for r in rows),
                                    "steps_to_target": [r["steps_to_target"] for r in rows],
                                    "steps_to_heldout_target": [r["steps_to_heldout_target"] for r in rows],
                                    "rollout_s_mean": _mean(r["mean_rollout_s"] for r in rows),
                                    "token_kl_mean": _mean(r["mean_token_kl"] for r in rows),
                                    "codes_changed_median_pct": _mean(r["codes_changed"]["median_pct"] for r in rows
                                                                      if r["codes_changed"]),
                                    "codes_syncs_with_none": sum(r["codes_changed"]["syncs_with_none"] for r in rows
                                                                 if r["codes_changed"]),
                                    "codes_syncs": sum(r["codes_changed"]["syncs"] for r in rows if r["codes_changed"]),
                                    "engine_checks": dict(Counter(r["engine_check"] or "none" for r in rows))}
    base = table["configs"].get("bf16")
    for config, row in table["configs"].items():
        if base is None or config == "bf16":
            continue
        lo, hi, got = base["final_reward_min"], base["final_reward_max"], row["final_reward_mean"]
        row["vs_bf16"] = ("within the bf16 seeds' spread" if lo <= got <= hi else
                          f"{lo - got:.2g} below the bf16 seeds' lowest" if got < lo else
                          f"{got - hi:.2g} above the bf16 seeds' highest")
        if base["rollout_s_mean"] and row["rollout_s_mean"]:
            row["rollout_s_vs_bf16"] = row["rollout_s_mean"] / base["rollout_s_mean"]
        if base["token_kl_mean"] and row["token_kl_mean"] is not None:  # verl's NVFP4 recipe: ~100x without QAT
            row["token_kl_vs_bf16"] = row["token_kl_mean"] / base["token_kl_mean"]
        for key, name in (("final_reward_ci95", "separable_from_bf16"),
                          ("final_heldout_acc_ci95", "heldout_separable_from_bf16")):
            a, b = row[key], base[key]
            row[name] = None if a is None or b is None else (a[1] < b[0] or a[0] > b[1])
    table["comparisons"] = comparisons(table)
    return table


def comparisons(table: dict) -> dict:
    """Issue 44's questions as differences of seed means with Welch 95 % intervals: every arm against bf16, and
    each precision's TIS effect (CONFIG - CONFIG-notis; CONFIG-mis - CONFIG), on the final held-out accuracy, its
    area under the curve and the final reward."""
    runs, configs = table["runs"], table["configs"]

    def values(config, key):
        return [r[key] for label, r in runs.items() if label.split("/")[0] == config]

    def compare(a, b):
        return {key: difference(values(a, key), values(b, key))
                for key in ("final_heldout_acc", "heldout_auc", "final_reward")}
    out = {}
    for config in configs:
        if config not in ("bf16", "bf16-notis") and "bf16" in configs:  # bf16-notis: its TIS effect below
            out[f"{config} - bf16"] = compare(config, "bf16")
        if f"{config}-notis" in configs:
            out[f"{config} - {config}-notis (TIS effect)"] = compare(config, f"{config}-notis")
        if f"{config}-mis" in configs:
            out[f"{config}-mis - {config} (masking vs truncation)"] = compare(f"{config}-mis", config)
    return out


def markdown(table: dict) -> str:
    """The table of the README / RESULTS (OUT.md): per arm its seeds' held-out accuracy at the first and the last
    evaluation with the 95 % interval, the held-out AUC, the final reward, the mismatch (and the token KL as a
    multiple of bf16's), the IS ratios outside verl's bounds (fraction_high + _low), the steps to --target-acc,
    rollout seconds and the final checks (and, where an arm logged them, the 4-bit codes a sync changed); then
    every comparison (Welch 95 %)."""
    runs = table["runs"]

    def f(x, fmt=".3f"):
        return "-" if x is None else format(x, fmt)

    def seeds_mean(config, key):
        return _mean(r[key] for lb, r in runs.items() if lb.split("/")[0] == config and r[key] is not None)

    target = table.get("target_acc")
    codes = any(row["codes_syncs"] for row in table["configs"].values())  # a 4-bit arm logged its code changes
    lines = ["| arm | seeds | held-out first -> last (BF16 engine), per seed | 95 % interval | held-out AUC | "
             "reward, last steps | token mean / p99 \\|Δ log p\\| | token KL (x bf16) | IS ratios out of bounds | "
             f"steps to {f(target, '.2f') if target is not None else 'target'} | rollout s | final check |"
             + (" 4-bit codes a sync changed: median % (syncs with none) |" if codes else ""),
             "| --- " * (12 + codes) + "|"]
    for config, row in table["configs"].items():
        per_seed = [r["final_heldout_acc"] for lb, r in runs.items() if lb.split("/")[0] == config]
        clipped = seeds_mean(config, "mean_is_clipped_frac")
        name = config.replace("-notis", ", no TIS").replace("-mis", ", MIS").replace("+kv", " + FP8 KV")
        ci = row["final_heldout_acc_ci95"]
        ratio = row.get("token_kl_vs_bf16")
        kl = f"{f(row['token_kl_mean'], '.2g')}{f' ({ratio:.2g}x)' if ratio is not None else ''}"
        code_cell = ("-" if not row["codes_syncs"] else
                     f"{row['codes_changed_median_pct']:.3g} % ({row['codes_syncs_with_none']} of {row['codes_syncs']})")
        lines.append(
            f"| {name} | {row['seeds']} | {f(row['first_heldout_acc_mean'])} -> {' / '.join(f(h) for h in per_seed)} | "
            f"{f'{ci[0]:.3f}-{ci[1]:.3f}' if ci else '-'} | {f(row['heldout_auc_mean'])} | "
            f"{f(row['final_reward_mean'])} | {f(seeds_mean(config, 'mean_abs_dlogp_token'))} / "
            f"{f(seeds_mean(config, 'mean_abs_dlogp_p99'), '.2f')} | {kl} | "
            f"{'-' if not clipped else f'{100 * clipped:.2g} %'} | "
            f"{' / '.join('-' if s is None else str(s) for s in row['steps_to_heldout_target'])} | "
            f"{f(row['rollout_s_mean'], '.2f')} | {', '.join(f'{k} ({n})' for k, n in row['engine_checks'].items())} |"
            + (f" {code_cell} |" if codes else ""))
    if table["comparisons"]:
        lines += ["", "| difference (seed means, Welch 95 %) | final held-out | held-out AUC | final reward |",
                  "| --- | --- | --- | --- |"]
        for name, row in table["comparisons"].items():
            cells = ["-" if d is None else f"{d['diff']:+.3f} ({d['ci95'][0]:+.3f}..{d['ci95'][1]:+.3f})"
                     f"{' *' if d['separable'] else ''}" for d in
                     (row[k] for k in ("final_heldout_acc", "heldout_auc", "final_reward"))]
            lines.append(f"| {name} | {' | '.join(cells)} |")
        lines.append("")
        lines.append("\\* the interval excludes 0")
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, list[dict]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(("reward",), "reward"), (("heldout_acc",), "held-out accuracy (BF16 engine)"),
              (("token_kl",), "token KL(rollout‖trainer)"), (("abs_dlogp_token", "abs_dlogp"), "mean |Δ log p|"),
              (("abs_dlogp_p99",), "p99 |Δ log p|"),
              (("ratio_above_2", "is_clipped_frac"), "IS ratio > 2 (clipped at C = 2)"),
              (("response_len",), "response length"), (("rollout_s",), "rollout s / step")]
    def present(key):
        return any(r[key] is not None for steps in runs.values() for r in steps)
    panels = [(next(k for k in keys if present(k)), name) for keys, name in panels if any(map(present, keys))]
    rows = 1 if len(panels) <= 4 else 2
    cols = math.ceil(len(panels) / rows)
    fig, grid = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    axes = [[ax for row in grid for ax in row]]
    for ax in axes[0][len(panels):]:
        ax.set_visible(False)
    by_config: dict[str, list[list[dict]]] = {}
    for label, steps in runs.items():
        by_config.setdefault(label.split("/")[0], []).append(steps)
    for i, (config, seeds) in enumerate(by_config.items()):
        for ax, (key, name) in zip(axes[0], panels):
            per_step: dict[int, list[float]] = {}
            for steps in seeds:
                for r in steps:
                    if r[key] is not None:
                        per_step.setdefault(r["step"], []).append(r[key])
            xs = sorted(per_step)
            if xs:  # the seeds' mean, and a band from the lowest seed to the highest
                ax.plot(xs, [statistics.fmean(per_step[x]) for x in xs], color=f"C{i}", lw=1.4,
                        label=f"{config} ({len(seeds)} seed{'s' if len(seeds) > 1 else ''})")
                if len(seeds) > 1:
                    ax.fill_between(xs, [min(per_step[x]) for x in xs], [max(per_step[x]) for x in xs],
                                    color=f"C{i}", alpha=0.2, lw=0)
            ax.set_title(name, fontsize=10)
            ax.set_xlabel("step")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out)


def run_specs(directory: Path) -> list[str]:
    """CONFIG/SEED=PATH for every PREFIX-CONFIG-sSEED.jsonl in `directory` (empty logs skipped: runs that died at
    start), by config then seed."""
    import re

    found = []
    for path in sorted(directory.glob("*.jsonl")):
        m = re.fullmatch(r"[^-]+-(.+)-s(\d+)\.jsonl", path.name)
        if m and path.stat().st_size:
            found.append((m.group(1), int(m.group(2)), path))
    return [f"{c}/{seed}={path}" for c, seed, path in sorted(found)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="*", help="CONFIG/SEED=PATH")
    ap.add_argument("--dir", type=Path, default=None, help="also every PREFIX-CONFIG-sSEED.jsonl in this directory "
                    "(scripts/gpu_verl_runs.sh's logs, e.g. verl-int8-notis-s2.jsonl -> int8-notis/2)")
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.png, OUT.json and OUT.md (the table)")
    ap.add_argument("--title", default="")
    ap.add_argument("--last", type=int, default=10, help="steps averaged for the final reward")
    ap.add_argument("--target", type=float, default=None, help="reward whose first reaching (mean of --last steps) "
                    "is reported per run")
    ap.add_argument("--target-acc", type=float, default=None,
                    help="held-out accuracy whose first reaching (an evaluated step) is reported per run")
    ap.add_argument("--until", type=int, default=None,
                    help="the table reads steps <= UNTIL only (runs that stopped at different steps "
                         "compared at the same step); the plot shows every step")
    args = ap.parse_args(argv)
    runs, finals, codes = {}, {}, {}
    try:
        specs = list(args.runs) + (run_specs(args.dir) if args.dir else [])
        if not specs:
            raise LogError("no runs: give CONFIG/SEED=PATH or --dir with PREFIX-CONFIG-sSEED.jsonl logs")
        for spec in specs:
            label, sep, path = spec.partition("=")
            if not sep or "/" not in label:
                raise LogError(f"run {spec!r}: expected CONFIG/SEED=PATH, e.g. int8/0=logs/int8-s0.jsonl")
            runs[label], finals[label] = read_log(Path(path))
            codes[label] = read_code_changes(Path(path))
    except LogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    upto = {lb: [r for r in steps if args.until is None or r["step"] <= args.until] for lb, steps in runs.items()}
    table = {**summarize(upto, finals, args.last, args.target, args.target_acc, codes), "until_step": args.until,
             "target": args.target, "target_acc": args.target_acc}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(runs, args.out.with_suffix(".png"), args.title)
    tmp = args.out.with_suffix(".tmp.json")
    tmp.write_text(json.dumps(table, indent=2))
    tmp.replace(args.out.with_suffix(".json"))
    tmp = args.out.with_suffix(".tmp.md")
    tmp.write_text(markdown(table))
    tmp.replace(args.out.with_suffix(".md"))
    def ci(pair):
        return f"{pair[0]:.3f}-{pair[1]:.3f}" if pair else "-"
    print(f"{'config':11} {'seeds':>5} {'final reward':>12} {'spread':>13} {'95% interval':>13} {'held-out':>8} "
          f"{'AUC':>6} {'rollout s':>9}  {'engine checks':22} vs bf16")
    for config, row in table["configs"].items():
        heldout = row["final_heldout_acc_mean"]
        print(f"{config:11} {row['seeds']:5} {row['final_reward_mean']:12.3f} "
              f"{row['final_reward_min']:6.3f}-{row['final_reward_max']:.3f} {ci(row['final_reward_ci95']):>13} "
              f"{heldout if heldout is not None else float('nan'):8.3f} {row['reward_auc_mean']:6.3f} "
              f"{row['rollout_s_mean'] if row['rollout_s_mean'] is not None else float('nan'):9.2f}  "
              f"{', '.join(f'{n} {k}' for k, n in row['engine_checks'].items()):22} {row.get('vs_bf16', '')}")
    if table["comparisons"]:
        print(f"\n{'difference (95 % interval, Welch)':44} {'final held-out':>26} {'held-out AUC':>26} {'final reward':>26}")
    for name, row in table["comparisons"].items():
        cells = []
        for key in ("final_heldout_acc", "heldout_auc", "final_reward"):
            d = row[key]
            cells.append("-" if d is None else f"{d['diff']:+.3f} ({d['ci95'][0]:+.3f}..{d['ci95'][1]:+.3f})"
                         f"{' *' if d['separable'] else ''}")
        print(f"{name:44} {cells[0]:>26} {cells[1]:>26} {cells[2]:>26}")
    if any(d and d["separable"] for row in table["comparisons"].values() for d in row.values()):
        print("* the interval excludes 0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
