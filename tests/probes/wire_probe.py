"""Trainer-quantized weights into vLLM on a GPU (issue 43): this process is the trainer and holds the new
weights on the GPU; the engine (FLASHRL_CONFIG from the environment) runs in its own process (vLLM's
multiprocess engine core: CUDA IPC needs another process) with the IPC weight-transfer backend.

Stages, each followed by an observation (greedy tokens, teacher-forced logprobs) and the workers' weight
digest (runtime/core/digest.py):
  engine-side   the new BF16 weights, one tensor per `load_weights` (collective_rpc): the engine quantizes
  then, each after the original BF16 weights were pushed back (`restore-*`):
  load_weights  `wire.engine_tensors` of the new weights (8-bit + scales), one bucket per `load_weights`
  ipc           the same through vLLM's IPC engine (start / update_weights / finish), unpacked
  ipc-packed    the same, packed buffers
  ipc-bf16      the new BF16 weights through the IPC engine (the engine quantizes)
  nccl, nccl-packed, nccl-bf16   (two GPUs) the same through vLLM's NCCL engine from the trainer on GPU 1
                (tests/probes/nccl_trainer.py), unpacked and packed, and BF16
  transfer      (CPU) the 8-bit tensors, saved to a checkpoint, through the weight-transfer API with the CPU
                tests' checkpoint backend (sync_probe.py: loads like the IPC backend)
A refusal: one 8-bit tensor with a scale of the wrong shape (one line, the engine keeps serving).
The start is observed twice: an observation that does not repeat bit for bit cannot tell a sync's fault. With vLLM's
multiprocess engine core (which CUDA IPC needs) two prompts of one `generate` call share their prefill step or not by
timing -- the core starts a step as soon as the first request arrives -- and a kernel whose sums depend on the rows
of the batch (vLLM 0.26's W4A16 kernels, Machete and Marlin, pick their tiles and splits by the token count) may then
give other bits with the same weights (the likely reading of the GPU run of 2026-11-30: the 4-bit cases' digests all
equal, their logprobs not): `--one-prompt-per-call` observes each prompt in a call of its own.
With --fresh the engine is then shut down and a fresh one (the same settings, no transfer backend) started on NEW
is observed once (`fresh`, beside the stages): what every push path must equal.
Usage: python wire_probe.py ORIGINAL NEW OUT.json [--bucket-bytes N] [--one-prompt-per-call] [--fresh]"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # functions and IPC handles to the workers


def digest(worker):
    from flashrl_tools.runtime.core.digest import model_digest

    return model_digest(worker.model_runner.model, "vllm")


def kernel_values(pattern: str):
    """collective_rpc: the kernel-held tensors whose name holds `pattern` (runtime/core/digest.py names, without
    `kernel:`), each with whether it is the layer's own parameter (same storage) and whether its values equal the
    parameter it stands for (MoE quant configs: `_w1` / `_w2` scales = `w13_weight_scale` / `w2_weight_scale`)."""
    def run(worker):
        import torch

        from flashrl_tools.runtime.core.digest import kernel_held_tensors

        model = worker.model_runner.model
        params = dict(model.named_parameters())
        out = {}
        for name, t in kernel_held_tensors(model, "vllm", device_type=t_device(model)).items():
            if pattern not in name:
                continue
            prefix, _, rest = name.partition(".quant_method")
            which = {"_w1": "w13_weight_scale", "_w2": "w2_weight_scale"}.get(rest.rsplit(".", 2)[-2])
            cands = [f"{q}.{which}" for q in (prefix, prefix.replace(".routed_experts", ""))] if which else []
            param = next((params[c] for c in cands if c in params), None)
            out[name] = {"shape": list(t.shape), "param": next((c for c in cands if c in params), None),
                         "equals_param": param is not None and param.shape == t.shape and bool(torch.equal(param, t))}
        return out
    return run


def t_device(model) -> str:
    return next(model.parameters()).device.type


def load(buckets):
    import torch

    FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    """collective_rpc: each bucket (CPU tensors, sent with the call) through the worker's `load_weights`."""

    # FP8 as uint8 views: torch's pickle of a CPU float8 tensor does not load in vLLM's engine core
    # ("UntypedStorage has no attribute dtype"; the call then never returns)
    sent = [[(n, t.view(torch.uint8) if t.dtype in FP8 else t, str(t.dtype).removeprefix("torch.")) for n, t in b]
            for b in buckets]

    def push(worker):
        import torch

        model, t0 = worker.model_runner.model, time.perf_counter()
        for bucket in sent:
            model.load_weights([(n, t.view(getattr(torch, d))) for n, t, d in bucket])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    return push


def ipc(llm, tensors, packed: bool) -> float:
    """The trainer's CUDA tensors through vLLM's IPC weight-transfer engine, as its trainer-side helper sends."""
    from dataclasses import asdict

    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    t0 = time.perf_counter()
    llm.start_weight_update()
    IPCWeightTransferEngine.trainer_send_weights(
        iter(tensors), {"send_mode": lambda info: llm.update_weights({"update_info": asdict(info)}),
                        "packed": packed})
    llm.finish_weight_update()
    return time.perf_counter() - t0


def nccl(llm, group, tensors, packed: bool) -> float:
    """The tensors (copied to the trainer's GPU) broadcast through vLLM's NCCL engine."""
    import nccl_trainer
    from sglang_distributed_probe import beside

    tensors = [(n, t.to(f"cuda:{nccl_trainer.TRAINER_GPU}")) for n, t in tensors]
    t0 = time.perf_counter()
    llm.start_weight_update()
    join = beside(lambda: llm.update_weights({"update_info": nccl_trainer.update_info(tensors, packed)}))
    nccl_trainer.send(group, tensors, packed)
    join()
    llm.finish_weight_update()
    return time.perf_counter() - t0


def checkpoint(llm, tensors, out: str) -> float:
    """The tensors saved as a checkpoint, through the weight-transfer API (the checkpoint backend)."""
    from safetensors.torch import save_file

    path = f"{out}.wire"
    os.makedirs(path, exist_ok=True)
    save_file({n: t.cpu().contiguous() for n, t in tensors}, f"{path}/model.safetensors")
    t0 = time.perf_counter()
    llm.start_weight_update()
    llm.update_weights({"update_info": {"path": path}})
    llm.finish_weight_update()
    return time.perf_counter() - t0


def aliased(name: str, rank: int, a: dict, b: dict) -> bool:
    """A kernel-held tensor in one stage's digest only, whose values (`--kernel-values`) equal the parameter it
    stands for: in the other stage the kernel holds that parameter itself (vLLM's MoE quant config after a
    layerwise reload), which that stage's digest covers under the parameter's name. The same values."""
    if not name.startswith("kernel:"):
        return False
    if (name in a["digest"][rank]) == (name in b["digest"][rank]):
        return False
    held = a if name in a["digest"][rank] else b
    values = held.get("kernel_values")
    row = values[rank].get(name.removeprefix("kernel:")) if values else None
    return bool(row and row["equals_param"])


def verdict(res: dict) -> dict:
    """What must hold: every path's digest and observation = the engine-side sync's, each restore = the start,
    the sync changed the weights, the mismatched tensor refused in one line and a full push served after."""
    st = {s["tag"]: s for s in res["stages"]}
    ref, start = st["engine-side"], st["start"]

    def same(a, b):
        return not any(differences(a, b).values())
    checks = {"the engine-side sync changed the weights": ref["digest"] != start["digest"]}
    if "start_again" in res:  # the observation itself repeats bit for bit
        checks["the start observed twice = itself"] = same(res["start_again"], start)
    for tag, stage in st.items():
        if tag.startswith("restore-"):
            checks[f"{tag} = start"] = same(stage, start)
        elif tag not in ("start", "engine-side"):
            checks[f"{tag} = engine-side sync"] = same(stage, ref)
    if "refusal" not in res:  # --no-refusal
        return checks
    refusal = res.get("refusal") or ""
    checks["a mismatched 8-bit tensor is refused in one line"] = "does not match this engine's" in refusal and \
        "expected" in refusal and refusal.count("flashrl_tools.errors") <= 1
    return checks


def differences(a: dict, b: dict) -> dict:
    """What differs between two stages: outputs, and the digest entries (per TP rank, the first few names)."""
    out = {"tokens": a["tokens"] != b["tokens"], "logprobs": a["logprobs"] != b["logprobs"]}
    for rank, (da, db) in enumerate(zip(a["digest"], b["digest"])):
        names = sorted(k for k in set(da) | set(db) if da.get(k) != db.get(k) and not aliased(k, rank, a, b))
        if names:
            out[f"digest_rank{rank}"] = {"count": len(names), "first": names[:6]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("original")
    ap.add_argument("new")
    ap.add_argument("out")
    ap.add_argument("--bucket-bytes", type=int, default=8 << 20)
    ap.add_argument("--engine-args", type=json.loads, default={})
    ap.add_argument("--paths", default="load_weights,ipc,ipc-packed,ipc-bf16", help="comma-separated (CPU: load_weights)")
    ap.add_argument("--no-refusal", action="store_true")
    ap.add_argument("--kernel-values", default=None, help="record kernel-held tensors whose name holds this")
    ap.add_argument("--fresh", action="store_true", help="then observe a fresh engine started on NEW (its own start: "
                    "on a CPU host cheaper in this process than in another, which imports vLLM again)")
    ap.add_argument("--one-prompt-per-call", action="store_true",
                    help="observe each prompt in a generate call of its own (a multiprocess engine core's batches)")
    x = ap.parse_args()
    paths = x.paths.split(",")
    import torch
    from vllm import LLM, SamplingParams

    from flashrl_tools.safetensors_io import CheckpointReader
    from flashrl_tools.verify.engine_job import push_checkpoint
    from flashrl_tools.wire import engine_tensors, wire_bytes

    seqs = [[5, 70, 75, 82, 3, 40, 50, 60, 70, 80, 90, 100], [7, 8, 9, 10, 11, 200, 201, 202, 203, 204]]
    ipc_paths = any(p.startswith("ipc") for p in paths)
    nccl_paths = any(p.startswith("nccl") for p in paths)
    transfer = {"weight_transfer_config": {"backend": "ipc"}} if ipc_paths else {}
    if nccl_paths:  # one backend per engine
        transfer = {"weight_transfer_config": {"backend": "nccl"}}
    if "transfer" in paths:  # registered in the workers by the import of transfer_ext
        here = os.path.dirname(os.path.abspath(__file__))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        transfer = {"weight_transfer_config": {"backend": "flashrl_probe_checkpoint"},
                    "worker_extension_cls": "transfer_ext.Ext"}
    settings = dict(dtype="bfloat16", max_model_len=512, enforce_eager=True, seed=0, enable_prefix_caching=False,
                    **x.engine_args)
    llm = LLM(model=x.original, **transfer, **settings)
    group = None
    if nccl_paths:
        import nccl_trainer
        from sglang_distributed_probe import beside

        info = nccl_trainer.init_info()
        join = beside(lambda: llm.init_weight_transfer_engine({"init_info": info}))
        group = nccl_trainer.trainer_group(info)
        join()
    elif transfer:
        llm.init_weight_transfer_engine({"init_info": {}})
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def observe(tag, seconds=None):
        p = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=0)
        if x.one_prompt_per_call:  # each prefill alone: the batch's rows never depend on timing
            outs = [llm.generate([{"prompt_token_ids": s}], p, use_tqdm=False)[0] for s in seqs]
        else:
            outs = llm.generate([{"prompt_token_ids": s} for s in seqs], p, use_tqdm=False)
        stage = {"tag": tag, "seconds": seconds, "digest": llm.collective_rpc(digest),  # one per TP rank
                 "tokens": [list(o.outputs[0].token_ids) for o in outs],
                 "logprobs": [[lp[t].logprob for t, lp in zip(s[1:], o.prompt_logprobs[1:])] for s, o in zip(seqs, outs)]}
        if x.kernel_values:
            stage["kernel_values"] = llm.collective_rpc(kernel_values(x.kernel_values))
        return stage

    device = "cuda" if torch.cuda.is_available() else "cpu"
    new = [(n, t.to(device)) for n, t in CheckpointReader(x.new).iter_tensors()]  # the trainer's copy
    sync()
    t0 = time.perf_counter()
    buckets = list(engine_tensors(new, x.original, bucket_bytes=x.bucket_bytes))
    sync()
    quantize_s = time.perf_counter() - t0
    wire = [pair for b in buckets for pair in b]
    res = {"config": os.environ.get("FLASHRL_CONFIG"), "trainer_quantize_s": quantize_s,
           "bytes": {"bf16": sum(t.numel() * t.element_size() for _, t in new), "wire": wire_bytes(buckets)},
           "stages": [observe("start")]}
    res["start_again"] = observe("start")

    def restore():
        llm.collective_rpc(push_checkpoint(x.original))
        res["stages"].append(observe(f"restore-{res['stages'][-1]['tag']}"))

    t0 = time.perf_counter()
    llm.collective_rpc(push_checkpoint(x.new))
    res["stages"].append(observe("engine-side", time.perf_counter() - t0))
    restore()
    cpu = [[(n, t.cpu()) for n, t in b] for b in buckets]
    pushes = {"load_weights": lambda: llm.collective_rpc(load(cpu))[0],
              "ipc": lambda: ipc(llm, wire, packed=False), "ipc-packed": lambda: ipc(llm, wire, packed=True),
              "ipc-bf16": lambda: ipc(llm, new, packed=True), "transfer": lambda: checkpoint(llm, wire, x.out),
              "nccl": lambda: nccl(llm, group, wire, False), "nccl-packed": lambda: nccl(llm, group, wire, True),
              "nccl-bf16": lambda: nccl(llm, group, new, False)}
    for i, path in enumerate(paths):
        if i:
            restore()
        res["stages"].append(observe(path, pushes[path]()))
    def done():
        nonlocal llm
        if x.fresh:
            llm.llm_engine.engine_core.shutdown()
            llm = LLM(model=x.new, **settings)
            res["fresh"] = observe("fresh")
        with open(x.out, "w") as f:
            json.dump(res, f)

    if x.no_refusal:  # (a TP = 2 executor answers the next call with the other rank's error of this one)
        return done()
    from flashrl_tools.runtime.core.convert import CONVERTED

    tensors = dict(wire)
    name = next(n for n, t in wire if t.element_size() == 1 and n.endswith(".weight") and f"{n}_scale" in tensors)
    marker = [(CONVERTED, tensors[CONVERTED].cpu())] if CONVERTED in tensors else []  # a calibrated sync starts so
    try:  # a scale of the wrong shape
        llm.collective_rpc(load([marker + [(name, tensors[name].cpu()),
                                           (f"{name}_scale", tensors[f"{name}_scale"][:1].cpu())]]))
        res["refusal"] = None
    except Exception as e:  # noqa: BLE001 -- the refusal, as the caller sees it
        res["refusal"] = f"{type(e).__name__}: {e}"
    llm.collective_rpc(push_checkpoint(x.new))  # the engine still serves: a full push completes a sync
    res["stages"].append(observe("after-refusal"))
    done()


if __name__ == "__main__":
    main()
    from flashrl_tools.verify.engine_job import exit_engine_process

    exit_engine_process(0)
    sys.exit(0)
