"""Benchmarks run in a smoke size so they cannot rot (figures come from full runs, not tests)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO


def test_profile_memory_benchmark_smoke(tmp_path):
    out = tmp_path / "pm.json"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "profile_memory.py"), "--preset", "small",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    m = json.loads(out.read_text())
    assert m["peak_rss_bytes"] > 0 and m["profile_wall_s"] > 0
    assert m["exact_fraction"] >= 0.999  # synthetic SmoothQuant factors are recovered
    assert "peak RSS" in res.stdout
