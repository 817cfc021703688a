"""Print what finished lifecycle probes of benchmarks/gpu_lifecycle_check.py say (work dir in progress)."""
import json
import sys
from pathlib import Path


def diff(a, b):
    return max(abs(x - y) for la, lb in zip(a["logprobs"], b["logprobs"]) for x, y in zip(la, lb))


work = Path(sys.argv[1])
for life in sorted(work.glob("*-life.json")):
    tag = life.name.removesuffix("-life.json")
    fresh = work / f"{tag}-fresh.json"
    if not fresh.is_file():
        continue
    st, f = json.loads(life.read_text()), json.loads(fresh.read_text())
    s, fr = st["stages"], f["stages"]["fresh"]
    fd, ld = f["digest"], st["digest"]
    bad = sorted(n for n in fd.keys() & ld.keys() if fd[n] != ld[n])
    kv = {k: s[k].get("kv_scales") == fr.get("kv_scales") for k in ("push_nosleep", "verl_replica", "verl")} \
        if "kv_scales" in fr else {}
    print(f"{tag:26} nosleep {diff(s['push_nosleep'], fr):.1e} back {diff(s['back_nosleep'], s['start']):.1e} "
          f"verl-order {diff(s['verl_replica'], fr):.1e} L1 {diff(s['level1'], s['verl_replica']):.1e} "
          f"trl {diff(s['trl'], s['start']):.1e} verl {diff(s['verl'], fr):.1e} "
          f"refused {'yes' if st['refused'] and 'full weight sync' in st['refused'] else st['refused']} "
          f"kv {kv} differ {len(bad)} {bad[:4]} fp8path {s.get('verl_fp8_path')}")
