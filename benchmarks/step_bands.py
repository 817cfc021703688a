"""Where a rollout's time goes by how many requests are still running (`rl_step.py --step-bands`).

A GRPO rollout starts with every sample decoding at once and ends with its longest few: the same 8-bit
saving per weight byte is worth a different share of each engine step at 128 sequences and at 4.
`StepClock` wraps `llm.llm_engine.step` for one `generate`: each call is charged the time since the
previous call returned (so the charges add up to the generate's loop, the front end's output processing
included) and is filed under the number of requests unfinished when it began -- the decode batch while
every request fits in the KV cache (with preemptions, waiting requests count too). In vLLM's default
engine-core process `step()` returns each engine step's outputs as they arrive, so the intervals are the
engine's step cadence; in-process they are the steps themselves. With an FP8 KV cache the rollout after a
sync begins with the scales' recalibration: its prefills, one request each, are charged to band "1".
SGLang's steps run in its scheduler's process: `LoggedSteps` reads the line its runtime appends per processed
step (FLASHRL_STEP_LOG, core/logs.py `step_line`) and charges each the time since the one before (the first: since
the generate began), filed under the unfinished requests the line records -- with the overlap scheduler, the
cadence at which step results come back, as in vLLM's engine-core process.
"""

from __future__ import annotations

import time
from pathlib import Path

# (low, high) unfinished requests per band; None: no upper bound
BANDS = ((1, 1), (2, 4), (5, 16), (17, 32), (33, 64), (65, 128), (129, None))


def band_name(low: int, high: int | None) -> str:
    return str(low) if high == low else f"{low}+" if high is None else f"{low}-{high}"


class StepClock:
    """with StepClock(llm.llm_engine) as clock: llm.generate(...); clock.bands() -> one dict per band."""

    def __init__(self, engine):
        self.engine, self.samples = engine, []
        self._own = "step" in vars(engine)  # an instance attribute already (restored as it was)
        self._step = engine.step

    def __enter__(self) -> StepClock:
        last = [time.perf_counter()]

        def step():
            unfinished = self.engine.get_num_unfinished_requests()
            out = self._step()
            now = time.perf_counter()
            self.samples.append((unfinished, now - last[0]))
            last[0] = now
            return out

        self.engine.step = step
        return self

    def __exit__(self, *exc) -> None:
        if self._own:
            self.engine.step = self._step
        else:
            del self.engine.step

    def bands(self) -> list[dict]:
        return bands(self.samples)


class LoggedSteps:
    """with LoggedSteps(path): engine.generate(...); .bands() -- the steps an engine process logged to `path`
    (FLASHRL_STEP_LOG) while the block ran (module docstring)."""

    SETTLE_S = 0.2  # the last step's line is written just after its outputs went out: wait for it

    def __init__(self, path: str | Path):
        self.path, self.samples = Path(path), []

    def __enter__(self) -> LoggedSteps:
        self._offset = self.path.stat().st_size if self.path.exists() else 0
        self._t0 = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(self.SETTLE_S)
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self._offset)
            lines = f.read().splitlines()
        last = self._t0
        for line in lines:
            fields = line.split()
            if len(fields) != 4 or float(fields[0]) <= last:
                continue  # a line being written, or from before the block
            self.samples.append((int(fields[3]), float(fields[0]) - last))
            last = float(fields[0])

    def bands(self) -> list[dict]:
        return bands(self.samples)


def bands(samples: list[tuple[int, float]]) -> list[dict]:
    """(unfinished requests, seconds) per step -> per band: steps, seconds, ms per step, share of the clocked time."""
    total = sum(s for _, s in samples) or 1.0
    rows = []
    for low, high in BANDS:
        times = [s for n, s in samples if n >= low and (high is None or n <= high)]
        rows.append({"band": band_name(low, high), "steps": len(times), "seconds": sum(times),
                     "ms_per_step": 1e3 * sum(times) / len(times) if times else None,
                     "share": sum(times) / total})
    return rows


def print_bands(rows: list[dict]) -> None:
    """The rollouts' bands side by side, each config's seconds also as a ratio of its shape's BF16 row."""
    banded = [r for r in rows if "error" not in r and r["rollout_2"].get("bands")]
    if not banded:
        return
    base = {r["shape"]: {b["band"]: b for b in r["rollout_2"]["bands"]} for r in banded if r["config"] == "bf16"}
    print("\nrollout after the sync by unfinished requests: seconds (ms per step, x the shape's bf16 seconds)")
    print(f"{'shape':8} {'config':9} " + " ".join(f"{band_name(lo, hi):>22}" for lo, hi in BANDS))
    for r in banded:
        cells = []
        for b in r["rollout_2"]["bands"]:
            ref = base.get(r["shape"], {}).get(b["band"])
            x = f" {b['seconds'] / ref['seconds']:.2f}x" if ref and ref["seconds"] else ""
            cells.append(f"{b['seconds']:.2f} ({b['ms_per_step']:.2f}{x})" if b["steps"] else "-")
        print(f"{r['shape']:8} {r['config']:9} " + " ".join(f"{c:>22}" for c in cells))
        roof = (r.get("roofline") or {}).get("bands") or []
        if any(b["fraction"] for b in roof):  # the share of each band's least bytes at the peak (roofline.py)
            print(f"{'':8} {'roofline':9} " + " ".join(f"{b['fraction']:>22.2f}" if b["fraction"] else f"{'-':>22}"
                                                      for b in roof))
