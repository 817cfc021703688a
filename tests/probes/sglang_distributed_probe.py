"""SGLang's `update_weights_from_distributed` with FLASHRL_CONFIG (from the environment): this process is
the trainer (rank 0 of a group of 1 + tp_size), the engine's schedulers ranks 1.. . NCCL refuses two ranks on one GPU,
so the group is gloo (SGLang's `init_weights_update_group(backend=...)`: the broadcast goes through the
host; the receive path and what follows are the same). Steps: observe at start, the perturbed weights per
tensor (one call naming every tensor), the originals back as one flattened bucket, the perturbed as a
bucket again, each observed. One process per config: SGLang loads its plugins once per process.
Usage: python sglang_distributed_probe.py REQUEST.json RESULT.json
REQUEST: {"original": dir, "perturbed": dir, "sequences": [[ids]], "max_tokens": n, "engine_kwargs": {...}}
RESULT: {"start", "per_tensor", "bucket_restore", "bucket": observation, "push_seconds": [s, s, s]}"""

import json
import socket
import sys
import threading
import time

GROUP = "flashrl-check"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def beside(fn):
    """Run fn beside the engine's blocking call (both sides of a collective; also tests/probes/wire_probe.py);
    `join` re-raises its error."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in join
            box["error"] = e
    t = threading.Thread(target=run)
    t.start()

    def join():
        t.join()
        if "error" in box:
            raise box["error"]
        return box.get("value")
    return join


def send(engine, group, path: str, bucket: bool) -> float:
    import torch
    import torch.distributed as dist

    from flashrl_tools.safetensors_io import CheckpointReader

    tensors = [(n, t.cuda()) for n, t in CheckpointReader(path).iter_tensors()]
    names, dtypes = [n for n, _ in tensors], [str(t.dtype).removeprefix("torch.") for _, t in tensors]
    shapes = [list(t.shape) for _, t in tensors]
    t0 = time.perf_counter()
    if bucket:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        flat = FlattenedTensorBucket(named_tensors=tensors).get_flattened_tensor()
        join = beside(lambda: dist.broadcast(flat, src=0, group=group))
        ok, message = engine.update_weights_from_distributed(names, dtypes, shapes, GROUP,
                                                             load_format="flattened_bucket")[:2]
    else:
        join = beside(lambda: [dist.broadcast(x, src=0, group=group) for _, x in tensors])
        ok, message = engine.update_weights_from_distributed(names, dtypes, shapes, GROUP)[:2]
    join()
    torch.cuda.synchronize()
    if not ok:
        raise RuntimeError(f"SGLang refused update_weights_from_distributed: {message}")
    return time.perf_counter() - t0


def main():
    import sglang
    import torch.distributed as dist
    from sglang.srt.utils import init_custom_process_group

    from flashrl_tools.verify.sglang_job import observe

    req = json.loads(open(sys.argv[1]).read())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    engine = sglang.Engine(model_path=req["original"], dtype="bfloat16", random_seed=0, attention_backend="triton",
                           disable_radix_cache=True, log_level="error", **req.get("engine_kwargs", {}))
    step = {"op": "observe", "sequences": req["sequences"], "max_tokens": req["max_tokens"]}
    try:
        port, world = _free_port(), 1 + engine.server_args.tp_size  # TP > 1: every rank receives the broadcast
        join = beside(lambda: init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}",
                                                         world_size=world, rank=0, group_name=GROUP))
        ok, message = engine.init_weights_update_group("127.0.0.1", port, 1, world, GROUP, backend="gloo")[:2]
        group = join()
        if not ok:
            raise RuntimeError(f"init_weights_update_group: {message}")
        out, seconds = {"start": observe(engine, step)}, []
        for tag, path, bucket in (("per_tensor", req["perturbed"], False), ("bucket_restore", req["original"], True),
                                  ("bucket", req["perturbed"], True)):
            seconds.append(send(engine, group, path, bucket))
            out[tag] = observe(engine, step)
    finally:
        engine.shutdown()
    with open(sys.argv[2], "w") as f:
        json.dump({**out, "push_seconds": seconds}, f)


if __name__ == "__main__":
    main()
