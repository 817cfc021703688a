"""Trainer logs -> learning curves (PNG) and a table (JSON): does an 8-bit rollout still learn, and
how much faster is its step?

    python benchmarks/rl_curves.py --out docs/rl/verl-smollm2 bf16/0=logs/bf16-s0.jsonl int8/0=... ...

Each RUN is CONFIG/SEED=PATH. PATH is a log of examples/trl_grpo.py (one JSON object per step) or
verl's file logger (`trainer.logger=[...,"file"]`: {"step", "data": {...}} per step); the format is
recognised per line. Per step it reads:

| measure | verl key | TRL example key |
| --- | --- | --- |
| reward | critic/score/mean | reward |
| token KL(rollout ‖ trainer) | rollout_corr/kl | - (TRL does not log it) |
| mean \\|Δ log p\\| | rollout_corr/log_ppl_abs_diff | sampling/sampling_logp_difference/mean |
| IS weights clipped (fraction) | rollout_corr/rollout_is_ratio_fraction_high + _low | - |
| rollout seconds | timing_s/gen | rollout_seconds |

Writes OUT.png (reward, mismatch, rollout seconds vs step; one line per run, one colour per
config) and OUT.json: per run the final reward (mean of the last `--last` steps), mean mismatch
and rollout seconds (over steps <= `--until` when given), the final engine check when the log has one;
per config the seeds' mean and spread, and for every config but bf16 whether its final reward lies within the bf16 seeds'
spread (or how far outside).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

MEASURES = {  # name -> (verl keys summed, TRL keys summed)
    "reward": (["critic/score/mean"], ["reward"]),
    "token_kl": (["rollout_corr/kl"], []),
    "abs_dlogp": (["rollout_corr/log_ppl_abs_diff"], ["sampling/sampling_logp_difference/mean"]),
    "is_clipped_frac": (["rollout_corr/rollout_is_ratio_fraction_high", "rollout_corr/rollout_is_ratio_fraction_low"],
                        []),
    "rollout_s": (["timing_s/gen"], ["rollout_seconds"]),
}


class LogError(ValueError):
    pass


def read_log(path: Path) -> tuple[list[dict], dict | None]:
    """(per-step measures, the final engine check or None) of one trainer log."""
    steps, final = [], None
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise LogError(f"cannot read {path}: {e.strerror}") from None
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
        out = {"step": int(row["step"])}
        for name, (verl_keys, trl_keys) in MEASURES.items():
            keys = verl_keys if verl else trl_keys
            got = [values[k] for k in keys if isinstance(values.get(k), (int, float))]
            out[name] = sum(got) if keys and len(got) == len(keys) else None
        steps.append(out)
    if not steps:
        raise LogError(f"{path}: no steps")
    return sorted(steps, key=lambda r: r["step"]), final


def _mean(values) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.fmean(values) if values else None


def summarize(runs: dict[str, list[dict]], finals: dict[str, dict | None], last: int) -> dict:
    table = {"runs": {}, "configs": {}}
    for label, steps in runs.items():
        tail = steps[-last:]
        table["runs"][label] = {
            "steps": len(steps), "final_reward": _mean(r["reward"] for r in tail),
            "first_reward": _mean(r["reward"] for r in steps[:last]),
            **{f"mean_{m}": _mean(r[m] for r in steps) for m in MEASURES if m != "reward"},
            "final_engine_check": finals.get(label)}
    by_config: dict[str, list[str]] = {}
    for label in runs:
        by_config.setdefault(label.split("/")[0], []).append(label)
    for config, labels in by_config.items():
        finals_r = [table["runs"][lb]["final_reward"] for lb in labels]
        table["configs"][config] = {"seeds": len(labels), "final_reward_mean": _mean(finals_r),
                                    "final_reward_min": min(finals_r), "final_reward_max": max(finals_r),
                                    "rollout_s_mean": _mean(table["runs"][lb]["mean_rollout_s"] for lb in labels)}
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
    return table


def plot(runs: dict[str, list[dict]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("reward", "reward"), ("token_kl", "token KL(rollout‖trainer)"), ("abs_dlogp", "mean |Δ log p|"),
              ("is_clipped_frac", "IS weights clipped"), ("rollout_s", "rollout s / step")]
    panels = [p for p in panels if any(r[p[0]] is not None for steps in runs.values() for r in steps)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    colours = {}
    for label, steps in runs.items():
        config = label.split("/")[0]
        colour = colours.setdefault(config, f"C{len(colours)}")
        for ax, (key, name) in zip(axes[0], panels):
            pts = [(r["step"], r[key]) for r in steps if r[key] is not None]
            if pts:
                ax.plot(*zip(*pts), color=colour, alpha=0.8, lw=1.2,
                        label=config if label == next(lb for lb in runs if lb.split("/")[0] == config) else None)
            ax.set_title(name, fontsize=10)
            ax.set_xlabel("step")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="CONFIG/SEED=PATH")
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.png and OUT.json")
    ap.add_argument("--title", default="")
    ap.add_argument("--last", type=int, default=10, help="steps averaged for the final reward")
    ap.add_argument("--until", type=int, default=None,
                    help="the table reads steps <= UNTIL only (runs that stopped at different steps "
                         "compared at the same step); the plot shows every step")
    args = ap.parse_args(argv)
    runs, finals = {}, {}
    try:
        for spec in args.runs:
            label, sep, path = spec.partition("=")
            if not sep or "/" not in label:
                raise LogError(f"run {spec!r}: expected CONFIG/SEED=PATH, e.g. int8/0=logs/int8-s0.jsonl")
            runs[label], finals[label] = read_log(Path(path))
    except LogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    upto = {lb: [r for r in steps if args.until is None or r["step"] <= args.until] for lb, steps in runs.items()}
    table = {**summarize(upto, finals, args.last), "until_step": args.until}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(runs, args.out.with_suffix(".png"), args.title)
    tmp = args.out.with_suffix(".tmp.json")
    tmp.write_text(json.dumps(table, indent=2))
    tmp.replace(args.out.with_suffix(".json"))
    print(f"{'config':8} {'seeds':>5} {'final reward':>12} {'spread':>15} {'rollout s':>9}  vs bf16")
    for config, row in table["configs"].items():
        print(f"{config:8} {row['seeds']:5} {row['final_reward_mean']:12.3f} "
              f"{row['final_reward_min']:7.3f}-{row['final_reward_max']:.3f} "
              f"{row['rollout_s_mean'] if row['rollout_s_mean'] is not None else float('nan'):9.2f}  "
              f"{row.get('vs_bf16', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
