"""SGLang's `update_weights_from_distributed` with FLASHRL_CONFIG (issue 32): the trainer broadcasts
BF16 tensors over a process group, SGLang's scheduler receives them and calls `model.load_weights`
(the runtime re-quantizes them in place), per tensor and as a flattened bucket (slime's and verl's
NCCL path; SGLang 0.5.17 `weight_updater.py`).

One GPU: this process is the trainer (rank 0 of a 2-rank group), the engine's scheduler rank 1. NCCL
refuses two ranks on one GPU, so the group is gloo (SGLang's `init_weights_update_group(backend=...)`:
the broadcast goes through the host, the receive path and what follows are the same). Steps: start on the
original weights, the perturbed weights per tensor (one `update_weights_from_distributed` call naming
every tensor), the originals back as one flattened bucket, the perturbed as a bucket again; each compared
with a fresh engine on the offline quantization of the same weights (0.0 expected). HF-initialised
random Qwen3 (gpu_sglang_check's models). Prints a table, writes JSON.
Usage: python benchmarks/gpu_sglang_distributed_check.py --json OUT [--configs int8,fp8] [--kv]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import threading
import time
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import load_sibling  # noqa: E402

GROUP = "flashrl-check"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _in_thread(fn):
    """Run fn beside the engine's blocking call (both sides of a collective); re-raise its error."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 -- re-raised in the caller
            box["error"] = e
    t = threading.Thread(target=run)
    t.start()
    return t, box


def _join(t, box):
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


def send(engine, group, path: Path, bucket: bool) -> float:
    import torch
    import torch.distributed as dist

    from flashrl_tools.safetensors_io import CheckpointReader

    tensors = [(n, t.cuda()) for n, t in CheckpointReader(path).iter_tensors()]
    names = [n for n, _ in tensors]
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in tensors]
    shapes = [list(t.shape) for _, t in tensors]
    t0 = time.perf_counter()
    if bucket:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        flat = FlattenedTensorBucket(named_tensors=tensors).get_flattened_tensor()
        t, box = _in_thread(lambda: dist.broadcast(flat, src=0, group=group))
        ok, message = engine.update_weights_from_distributed(names, dtypes, shapes, GROUP,
                                                             load_format="flattened_bucket")[:2]
    else:
        t, box = _in_thread(lambda: [dist.broadcast(x, src=0, group=group) for _, x in tensors])
        ok, message = engine.update_weights_from_distributed(names, dtypes, shapes, GROUP)[:2]
    _join(t, box)
    torch.cuda.synchronize()
    if not ok:
        raise RuntimeError(f"SGLang refused update_weights_from_distributed: {message}")
    return time.perf_counter() - t0


def run_config(config: str, kv: str | None, models, work: Path, ekw: dict) -> dict:
    import sglang
    from sglang.srt.utils import init_custom_process_group

    from flashrl_tools.verify.sglang_job import observe

    gsc = load_sibling("gpu_sglang_check")
    orig, pert = models
    fmt = gsc.FORMAT[config]
    os.environ["FLASHRL_CONFIG"] = config
    if kv:
        os.environ["FLASHRL_KV_CACHE_DTYPE"] = kv
    engine = sglang.Engine(model_path=str(orig), dtype="bfloat16", random_seed=0, attention_backend="triton",
                           disable_radix_cache=True, log_level="error", **ekw)
    try:
        port = _free_port()
        t, box = _in_thread(lambda: init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}",
                                                              world_size=2, rank=0, group_name=GROUP))
        ok, message = engine.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, backend="gloo")[:2]
        group = _join(t, box)
        if not ok:
            raise RuntimeError(f"init_weights_update_group: {message}")
        got, seconds = {"start": observe(engine, gsc.obs())}, []
        for tag, path, bucket in (("per_tensor", pert, False), ("bucket_restore", orig, True), ("bucket", pert, True)):
            seconds.append(send(engine, group, path, bucket))
            got[tag] = observe(engine, gsc.obs())
    finally:
        engine.shutdown()
        os.environ.pop("FLASHRL_CONFIG", None)
        os.environ.pop("FLASHRL_KV_CACHE_DTYPE", None)
    fresh_config = "bf16" if kv else None
    fresh = {tag: gsc.engine(gsc.quantized(src, fmt, work), [gsc.obs()], fresh_config, f"fresh {tag}", ekw, kv)
             for tag, src in (("original", orig), ("perturbed", pert))}
    if any(isinstance(v, str) for v in fresh.values()):
        return {"config": config, "kv": kv, "error": fresh, "passed": False}
    row = {"config": config, "kv": kv, "served_format": fmt or "bf16",
           "start_vs_fresh": gsc.same(got["start"], fresh["original"][0]),
           "per_tensor_sync_vs_fresh": gsc.same(got["per_tensor"], fresh["perturbed"][0]),
           "bucket_restore_vs_start": gsc.same(got["bucket_restore"], got["start"]),
           "bucket_sync_vs_fresh": gsc.same(got["bucket"], fresh["perturbed"][0]),
           "changed_by_sync": gsc.same(got["start"], got["per_tensor"])["max_dlogp"], "push_seconds": seconds}
    checks = [row[k] for k in ("start_vs_fresh", "per_tensor_sync_vs_fresh", "bucket_restore_vs_start",
                               "bucket_sync_vs_fresh")]
    row["passed"] = all(c["max_dlogp"] == 0.0 and c["tokens_equal"] for c in checks) and row["changed_by_sync"] > 0.01
    if kv:
        row["kv_scales_equal"] = [gsc.kv_equal(got["per_tensor"], fresh["perturbed"][0]),
                                  gsc.kv_equal(got["bucket"], fresh["perturbed"][0])]
        row["passed"] = row["passed"] and all(row["kv_scales_equal"])
    return row



def _config_in_subprocess(name: str, work: Path) -> dict:
    import subprocess
    import sys

    out = work / f"dist-{name}.json"
    subprocess.run([sys.executable, __file__, "--configs", name, "--workdir", str(work), "--json", str(out)])
    if not out.is_file():
        return {"config": name, "error": "the config's process wrote no result", "passed": False}
    return json.loads(out.read_text())["rows"][0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, default=Path("gpu_sglang_distributed_check.json"))
    ap.add_argument("--configs", default="int8,fp8", help="comma-separated; a '+kv' suffix adds the FP8 KV cache")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    import sglang
    import torch

    ekw = {"mem_fraction_static": 0.3, "max_total_tokens": 8192, "cuda_graph_max_bs_decode": 8, "context_length": 512}
    work = args.workdir or Path(tempfile.mkdtemp(prefix="gpu-sglang-dist-"))
    work.mkdir(parents=True, exist_ok=True)
    models = load_sibling("gpu_sglang_check").make_models(work, {"dense"})["dense"]
    import torch.distributed as dist  # a default group in the trainer, as a trainer has one

    if len(args.configs.split(",")) == 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    names = args.configs.split(",")
    if len(names) > 1:  # one process per config: the runtime's plugin state (and FLASHRL_CONFIG) is per process,
        rows = [_config_in_subprocess(name, work) for name in names]  # a second Engine here kept the first's
    else:
        config, kv = names[0].removesuffix("+kv"), "fp8" if names[0].endswith("+kv") else None
        try:
            rows = [run_config(config, kv, models, work, ekw)]
        except Exception as e:  # noqa: BLE001 -- the failure is the row
            rows = [{"config": config, "kv": kv, "error": f"{type(e).__name__}: {e}", "passed": False}]
        print(json.dumps(rows[-1]), flush=True)
    result = {"device": torch.cuda.get_device_name(), "sglang": sglang.__version__, "group_backend": "gloo",
              "engines": f"CUDA graphs, triton attention, {json.dumps(ekw)}", "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"\nSGLang {sglang.__version__} update_weights_from_distributed (gloo group) on {result['device']}")
    keys = ("start_vs_fresh", "per_tensor_sync_vs_fresh", "bucket_restore_vs_start", "bucket_sync_vs_fresh")
    for r in rows:
        label = r["config"] + ("+kv" if r.get("kv") else "")
        if "error" in r:
            print(f"{label:8} ERROR {str(r['error'])[:300]}")
            continue
        cells = "  ".join(f"{k}: {r[k]['max_dlogp']:.2e} {'=' if r[k]['tokens_equal'] else 'x'}" for k in keys)
        print(f"{label:8} {cells}  {'ok' if r['passed'] else 'FAIL'}")


if __name__ == "__main__":
    main()
