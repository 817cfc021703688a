"""One full sync with the trainer quantizing (flashrl_tools.wire) vs the engine quantizing BF16, per shape.

Per shape and config (each in a fresh engine process, FLASHRL_CONFIG = the config, dummy weights of the
shape): the trainer's BF16 tensors are made on the engine's device (random, the policy's names and shapes;
the time to make them is subtracted), then
  bf16 push     `model.load_weights` one tensor per call, BF16 (the engine converts: today's path)
  8-bit push    `engine_tensors` on the same device (the trainer-side quantization, timed apart), then
                `model.load_weights` of its int8 / fp8 tensors and scales (the engine writes them as they are)
Reported: bytes on the wire (exact, from the tensors) and their ratio to BF16, trainer-side quantize
seconds, engine write seconds of each push, and the network time on paper (bytes / link bandwidth) for
100 and 400 Gb/s links.
With --ipc (GPU) the pushes go from the benchmark's process (the trainer: tensors made on its GPU, made lazily,
bucket by bucket) through vLLM's CUDA-IPC weight-transfer engine, packed, into the engine core (a process of
its own): BF16 vs the trainer's 8-bit tensors, each timed from `start_weight_update` to `finish_weight_update`
(the 8-bit time includes the trainer's quantization).

    python benchmarks/wire_sync.py --shapes 7b,14b,32b --configs int8,fp8_channel --json benchmarks/results/wire/bytes.json
    python benchmarks/wire_sync.py --ipc --preset gpu --json benchmarks/results/wire/times_ipc.json
    python benchmarks/wire_sync.py --preset smoke       # CPU, config-only tiny shape (CI)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import bench_parser, output_args, preset_options, run_worker, serve_worker, vllm_settings  # noqa: E402
from shapes import model_dir  # noqa: E402

PRESETS = {"gpu": dict(shapes="7b,14b,32b", configs="int8,fp8_channel"),
           "cpu": dict(shapes="default", configs="int8"),
           "smoke": dict(shapes="tiny", configs="int8")}
LINKS_GBPS = (100, 400)
YAMLS = {"fp8_channel": "- fn: fp8_channel\n  logprobs_mode: processed_logprobs\n"}


def push_in_worker(model_path: str, config: str):
    """A worker function (collective_rpc): a BF16 push, then the same weights quantized on the trainer's side
    and pushed as 8-bit tensors; timed, bytes counted."""
    def run(worker):
        import torch

        from flashrl_tools.model_structure import _meta_model
        from flashrl_tools.wire import engine_tensors

        model = worker.model_runner.model
        dev = next(model.parameters()).device
        cuda = dev.type == "cuda"
        _, meta = _meta_model(Path(model_path), allow_quantized=True)
        shapes = [(n, t.shape) for n, t in meta.state_dict().items()
                  if not (n == "lm_head.weight" and meta.config.tie_word_embeddings)]
        spent = {"make": 0.0, "quantize": 0.0}

        def sync():
            if cuda:
                torch.cuda.synchronize()

        def tensors():
            g = torch.Generator(device=dev).manual_seed(0)
            for name, shape in shapes:
                t0 = time.perf_counter()
                t = (torch.randn(shape, generator=g, device=dev, dtype=torch.float32) * 0.02).to(torch.bfloat16)
                sync()
                spent["make"] += time.perf_counter() - t0
                yield name, t

        out = {}
        spent["make"] = 0.0
        t0 = time.perf_counter()
        bf16_bytes = 0
        for name, t in tensors():
            bf16_bytes += t.numel() * t.element_size()
            model.load_weights([(name, t)])
        sync()
        out["bf16_push_s"] = time.perf_counter() - t0 - spent["make"]
        spent["make"] = 0.0
        wire_bytes, write_s = 0, 0.0
        t_all = time.perf_counter()
        for bucket in engine_tensors(tensors(), model_path, config, bucket_bytes=256 << 20):
            sync()
            t0 = time.perf_counter()
            for name, t in bucket:
                wire_bytes += t.numel() * t.element_size()
                model.load_weights([(name, t)])
            sync()
            write_s += time.perf_counter() - t0
        total = time.perf_counter() - t_all
        out.update(wire_bytes=wire_bytes, bf16_bytes=bf16_bytes, engine_write_s=write_s,
                   trainer_quantize_s=total - write_s - spent["make"],
                   syncs_completed=model.flashrl_sync.completed)
        return out

    return run


def worker(spec: dict) -> dict:
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM

    ipc = {"weight_transfer_config": {"backend": "ipc"}} if spec.get("ipc") else {}
    llm = LLM(model=spec["model"], load_format="dummy" if spec["dummy"] else "auto", skip_tokenizer_init=True,
              dtype="bfloat16", max_model_len=512, gpu_memory_utilization=spec["gpu_memory_utilization"],
              enforce_eager=True, seed=0, enable_prefix_caching=False, **ipc)  # a sync: no graphs needed
    if ipc:
        return {**ipc_pushes(llm, spec["model"], spec["config"]), **vllm_settings(llm)}
    return {**llm.collective_rpc(push_in_worker(spec["model"], spec["config"]))[0], **vllm_settings(llm)}


def ipc_pushes(llm, model_path: str, config: str) -> dict:
    """This process as the trainer: BF16 and then 8-bit tensors through vLLM's CUDA-IPC engine (packed)."""
    from dataclasses import asdict

    import torch
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    from flashrl_tools.model_structure import _meta_model
    from flashrl_tools.wire import engine_tensors

    llm.init_weight_transfer_engine({"init_info": {}})
    _, meta = _meta_model(Path(model_path), allow_quantized=True)
    shapes = [(n, t.shape) for n, t in meta.state_dict().items()
              if not (n == "lm_head.weight" and meta.config.tie_word_embeddings)]
    count = {"bytes": 0}
    # the packed buffer must hold the largest tensor (vLLM's default 1 GiB < a 7B embedding's 1.5 GB)
    largest = max(shape.numel() * 2 for _, shape in shapes)
    buffer_bytes = max(1 << 30, -(-largest // (1 << 20)) << 20)

    def tensors():  # the trainer's BF16 weights, made as they are sent (bounded memory)
        g = torch.Generator(device="cuda").manual_seed(0)
        for name, shape in shapes:
            yield name, (torch.randn(shape, generator=g, device="cuda", dtype=torch.float32) * 0.02).to(torch.bfloat16)

    def counted(pairs):
        for name, t in pairs:
            count["bytes"] += t.numel() * t.element_size()
            yield name, t

    def push(pairs) -> float:
        count["bytes"] = 0
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.start_weight_update()
        IPCWeightTransferEngine.trainer_send_weights(counted(pairs), {
            "send_mode": lambda info: llm.update_weights({"update_info": asdict(info)}), "packed": True,
            "packed_buffer_size_bytes": buffer_bytes})
        llm.finish_weight_update()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    bf16_s = push(tensors())
    bf16_bytes = count["bytes"]
    wire_s = push(pair for bucket in engine_tensors(tensors(), model_path, config, bucket_bytes=256 << 20)
                  for pair in bucket)
    return {"bf16_bytes": bf16_bytes, "wire_bytes": count["bytes"], "ipc_bf16_s": bf16_s,
            "ipc_8bit_with_quantize_s": wire_s, "packed_buffer_bytes": buffer_bytes}


def config_value(config: str, work: Path) -> str:
    if config not in YAMLS:
        return config
    path = work / f"{config}.yaml"
    path.write_text("version: 1\nconfigs:\n" + YAMLS[config])
    return str(path)


def print_table(rows: list, device: str, version: str) -> None:
    print(f"\nOne full sync, trainer-side 8-bit vs BF16, on {device}, vLLM {version}")
    print(f"{'shape':7} {'config':12} {'BF16 GB':>8} {'wire GB':>8} {'ratio':>6} {'quantize s':>10} {'write s':>8} "
          f"{'bf16 push s':>11} " + " ".join(f"{f'net {g}G bf16/8b s':>18}" for g in LINKS_GBPS))
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:7} {r['config']:12} error: {r['error']}")
            continue
        nets = " ".join(f"{r[f'network_bf16_s_{g}g']:8.2f} / {r[f'network_8bit_s_{g}g']:7.2f}" for g in LINKS_GBPS)
        print(f"{r['shape']:7} {r['config']:12} {r['bf16_bytes'] / 1e9:8.2f} {r['wire_bytes'] / 1e9:8.2f} "
              f"{r['wire_vs_bf16']:6.3f} {r['trainer_quantize_s']:10.3f} {r['engine_write_s']:8.3f} "
              f"{r['bf16_push_s']:11.3f} {nets}")


def main() -> None:
    if serve_worker(worker):
        return
    ap = bench_parser(__doc__, PRESETS)
    ap.add_argument("--configs")
    output_args(ap)
    ap.add_argument("--ipc", action="store_true", help="GPU: push through vLLM's CUDA-IPC weight-transfer engine")
    a = ap.parse_args()
    import torch

    opts, util, work = preset_options(a, PRESETS, gpu_util=0.6)
    rows = []
    for shape in opts["shapes"].split(","):
        path, dummy = model_dir(shape, work)
        for config in opts["configs"].split(","):
            value = config_value(config, Path(tempfile.mkdtemp(dir=work)))
            env = {**os.environ, "FLASHRL_CONFIG": value, "FLASHRL_SYNC_TIMING": "1"}
            env.pop("FLASHRL_KV_CACHE_DTYPE", None)
            if a.ipc:  # CUDA IPC: the engine core in a process of its own
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            r = {"shape": shape, "config": config, **run_worker(__file__, {"model": str(path), "dummy": dummy,
                                                                          "config": value, "ipc": a.ipc,
                                                                          "gpu_memory_utilization": util}, env)}
            if "error" not in r and a.ipc:
                r["wire_vs_bf16"] = r["wire_bytes"] / r["bf16_bytes"]
                r["ipc_8bit_vs_bf16"] = r["ipc_8bit_with_quantize_s"] / r["ipc_bf16_s"]
            elif "error" not in r:
                r["wire_vs_bf16"] = r["wire_bytes"] / r["bf16_bytes"]
                r["write_vs_bf16_push"] = r["engine_write_s"] / r["bf16_push_s"]
                for gbps in LINKS_GBPS:
                    r[f"network_bf16_s_{gbps}g"] = r["bf16_bytes"] * 8 / (gbps * 1e9)
                    r[f"network_8bit_s_{gbps}g"] = r["wire_bytes"] * 8 / (gbps * 1e9)
            rows.append(r)
            print(json.dumps(r), flush=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    import vllm

    if a.ipc:
        print(f"\nOne full sync through vLLM's CUDA-IPC engine (packed), on {device}, vLLM {vllm.__version__}")
        print(f"{'shape':7} {'config':12} {'BF16 GB':>8} {'wire GB':>8} {'ratio':>6} {'BF16 s':>8} {'8-bit s':>8} "
              f"{'8-bit/BF16':>10}")
        for r in rows:
            if "error" in r:
                print(f"{r['shape']:7} {r['config']:12} error: {r['error']}")
                continue
            print(f"{r['shape']:7} {r['config']:12} {r['bf16_bytes'] / 1e9:8.2f} {r['wire_bytes'] / 1e9:8.2f} "
                  f"{r['wire_vs_bf16']:6.3f} {r['ipc_bf16_s']:8.3f} {r['ipc_8bit_with_quantize_s']:8.3f} "
                  f"{r['ipc_8bit_vs_bf16']:10.3f}")
    else:
        print_table(rows, device, vllm.__version__)
    if a.json:
        from flashrl_tools.fsutil import atomic_write_text

        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(a.json), json.dumps({"device": device, "vllm": vllm.__version__,
                                                    "date": time.strftime("%Y-%m-%d"), "settings": opts,
                                                    "rows": rows}, indent=1))
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
