"""verl run logs -> the logs committed beside the results: per step only the keys the curves and tables read (and a
few that explain them), floats to 6 significant digits (held-out accuracies exact), the held-out sidecar
(RUN.heldout.jsonl) merged in, the final check kept (last).

A verl file-logger line carries ~150 keys (~4 KB); 21 runs of 60 steps would add ~6 MB to a working tree that
travels with every GPU call (64 MiB in all): trimmed, ~1 MB.

    python benchmarks/trim_logs.py RES/arms-mul21 benchmarks/results/training_arms   # every *-sN.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rl_curves import MEASURES  # noqa: E402

KEEP_PREFIXES = ("critic/score/", "rollout_corr/flashrl_", "timing_s/", "fully_async/partial/")
KEEP = {k for verl_keys, _ in MEASURES.values() for k in verl_keys} | {"heldout/prompts"} | {
    "perf/time_per_step", "perf/throughput", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm",
    "actor/lr", "training/global_step", "response_length/max", "response_length/clip_ratio",
    "rollout_corr/k3_kl", "rollout_corr/chi2_token", "rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_max",
    "rollout_corr/rollout_is_min", "rollout_corr/rollout_is_std", "rollout_corr/rollout_is_eff_sample_size"}


def trim_line(row: dict) -> dict:
    if not isinstance(row.get("data"), dict):
        return row  # the final check, or a line of another logger: as it is
    data = {k: float(f"{v:.6g}") if isinstance(v, float) and not k.startswith("heldout/") else v  # 6 digits
            for k, v in row["data"].items() if k in KEEP or k.startswith(KEEP_PREFIXES)}
    return {**row, "data": data}


def trim(src: Path, dst: Path) -> int:
    """One run's log (and its held-out sidecar) as one trimmed log at `dst`; returns the lines written."""
    lines = src.read_text().splitlines()
    sidecar = src.with_name(src.name.removesuffix(".jsonl") + ".heldout.jsonl")
    if sidecar.is_file():
        lines += sidecar.read_text().splitlines()
    rows = [trim_line(json.loads(line)) for line in lines if line.strip()]
    checks = [r for r in rows if "final_check" in r]
    rows = [r for r in rows if "final_check" not in r] + checks  # the final check last (rl_curves reads it anywhere)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(dst)
    return len(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="a directory of PREFIX-CONFIG-sSEED.jsonl logs (scripts/gpu_verl_runs.sh)")
    ap.add_argument("dst", type=Path, help="where the trimmed logs go (the same names)")
    args = ap.parse_args(argv)
    logs = sorted(p for p in args.src.glob("*.jsonl") if re.fullmatch(r"[^-]+-.+-s\d+\.jsonl", p.name)
                  and p.stat().st_size) if args.src.is_dir() else []
    if not logs:
        print(f"error: no PREFIX-CONFIG-sSEED.jsonl logs in {args.src}", file=sys.stderr)
        return 2
    for path in logs:
        n = trim(path, args.dst / path.name)
        print(f"{path.name}: {n} lines, {path.stat().st_size // 1024} -> {(args.dst / path.name).stat().st_size // 1024} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
