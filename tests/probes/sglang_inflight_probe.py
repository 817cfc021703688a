"""An in-flight weight update on SGLang 0.5.17 (the offline Engine's TokenizerManager, as slime / AReaL /
verl's SGLang server drive it): R greedy requests streaming, `pause_generation(mode)`, a request sent
during the pause (it waits), the new weights pushed one tensor per `update_weights_from_tensor` (SGLang's
default flush_cache=True; `--push distributed`: as one flattened bucket through `update_weights_from_distributed`,
this process the trainer, rank 0 of a gloo group -- NCCL refuses two ranks on one GPU), `continue_generation`,
a request right after it, everything drained; abort
mode: each aborted request resubmitted as prompt + its partial tokens (one batch); then the kept
requests' own prompt again. In-place mode adds a continue before the sync completed (the requests the
pause held are aborted with the reason, a new request is refused) and the sync completed after it.
FLASHRL_CONFIG / FLASHRL_KV_CACHE_DTYPE from the environment; the radix cache is on.

    python sglang_inflight_probe.py run A B --mode abort|retract|in_place OUT.json [--engine-args JSON]
                                    [--push tensor|distributed]
    python sglang_inflight_probe.py serve B REQUEST.json OUT.json [--engine-args JSON]

`run` writes what the engine returned and where each request was when the pause took it; `serve` (the
fresh engine on B, same settings) answers batches of [rid, token ids, max tokens], each batch one
batched request, and scores token ids teacher-forced. The GPU test (tests/gpu/test_sglang_inflight.py) compares them."""

import argparse
import asyncio
import json
import sys
import time

def prompt(i: int) -> list[int]:
    """74 tokens of its own per request (ids below 384, the GPU tests' vocabulary): no request shares a prefix
    with another, so which blocks the radix cache reuses depends on no timing -- only the request's own earlier
    prefill can be reused, and after an update only if the namespaces by version failed (pause.salt)."""
    return [20 + (i * 37 + j * 11) % 350 for j in range(74)]


def key(rid: str) -> str:
    """The radix-cache namespace of a request compared with the fresh engine: its own (full prefill on both)."""
    return f"cmp-{rid}"


def phase(name: str) -> None:
    print(f"PHASE {name} {time.strftime('%T')}", file=sys.stderr, flush=True)


def start(model: str, engine_args: dict):
    import sglang

    from flashrl_tools.verify.sglang_job import own_nccl_port

    args = dict(dtype="bfloat16", random_seed=0, attention_backend="triton", log_level="error",
                context_length=512, mem_fraction_static=0.3, max_total_tokens=8192, nccl_port=own_nccl_port())
    return sglang.Engine(model_path=model, **{**args, **engine_args})


class Streams:
    """Requests through the TokenizerManager (streamed), their outputs as they come."""

    def __init__(self, engine):
        self.tm, self.seen, self.first = engine.tokenizer_manager, {}, {}

    async def gen(self, rid: str, ids: list[int], tokens: int, extra_key: str | None = None) -> dict:
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(input_ids=ids, rid=rid, stream=True, return_logprob=True, extra_key=extra_key,
                               sampling_params={"temperature": 0.0, "max_new_tokens": tokens, "ignore_eos": True})
        self.seen[rid], last = 0, None
        try:
            async for out in self.tm.generate_request(obj, None):
                self.first.setdefault(rid, time.perf_counter())
                self.seen[rid], last = len(out["output_ids"]), out
        except ValueError as e:  # SGLang raises for some aborts (RequestAbortedError)
            return {"tokens": [], "logprobs": [], "finish_reason": "abort", "message": f"{type(e).__name__}: {e}"}
        meta = last["meta_info"]
        reason = meta.get("finish_reason") or {}
        return {"tokens": list(last["output_ids"]),
                "logprobs": [lp for lp, _, _ in meta.get("output_token_logprobs") or []],
                "finish_reason": reason.get("type"), "message": reason.get("message")}


PUSH = {"how": "tensor", "group": None}  # --push; the trainer's side of the gloo group (distributed)


async def join_group(engine) -> None:
    """`--push distributed`: the weight-update group, this process rank 0 (the trainer), the scheduler rank 1."""
    import torch.distributed as dist
    from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput
    from sglang.srt.utils import init_custom_process_group
    from sglang_distributed_probe import GROUP, _free_port, beside

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    port = _free_port()
    join = beside(lambda: init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}",
                                                     world_size=2, rank=0, group_name=GROUP))
    ok, message = (await engine.tokenizer_manager.init_weights_update_group(InitWeightsUpdateGroupReqInput(
        master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, group_name=GROUP,
        backend="gloo"), None))[:2]
    PUSH["group"] = join()
    if not ok:
        raise RuntimeError(f"init_weights_update_group: {message}")


async def push_distributed(engine, tensors: list) -> tuple[bool, str]:
    """The tensors as one flattened bucket through `update_weights_from_distributed`, the broadcast beside it."""
    import torch.distributed as dist
    from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    from sglang_distributed_probe import GROUP, beside

    tensors = [(n, t.cuda()) for n, t in tensors]
    flat = FlattenedTensorBucket(named_tensors=tensors).get_flattened_tensor()
    join = beside(lambda: dist.broadcast(flat, src=0, group=PUSH["group"]))
    ok, message = (await engine.tokenizer_manager.update_weights_from_distributed(UpdateWeightsFromDistributedReqInput(
        names=[n for n, _ in tensors], dtypes=[str(t.dtype).removeprefix("torch.") for _, t in tensors],
        shapes=[list(t.shape) for _, t in tensors], group_name=GROUP, flush_cache=True,
        load_format="flattened_bucket"), None))[:2]
    join()
    return ok, message


async def push(engine, path: str, count: int | None = None) -> tuple[bool, str]:
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
    from sglang.srt.utils import MultiprocessingSerializer

    from flashrl_tools.safetensors_io import CheckpointReader

    if PUSH["how"] == "distributed":
        return await push_distributed(engine, list(CheckpointReader(path).iter_tensors())[:count])
    for i, (name, tensor) in enumerate(CheckpointReader(path).iter_tensors()):
        if count is not None and i >= count:
            break
        payload = [MultiprocessingSerializer.serialize([(name, tensor.cuda())])] * engine.server_args.tp_size
        ok, message = (await engine.tokenizer_manager.update_weights_from_tensor(
            UpdateWeightsFromTensorReqInput(serialized_named_tensors=payload, load_format=None, flush_cache=True),
            None))[:2]
        if not ok:
            return False, message
    return True, ""


async def run(engine, a: str, b: str, mode: str, requests: int, tokens: int, pause_after: int) -> dict:
    from sglang.srt.managers.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput

    tm, s = engine.tokenizer_manager, Streams(engine)
    res: dict = {"mode": mode, "push_path": PUSH["how"]}
    if PUSH["how"] == "distributed":
        await join_group(engine)
    kept = {f"r{i}": asyncio.create_task(s.gen(f"r{i}", prompt(i), tokens)) for i in range(requests)}
    while not all(s.seen.get(r, 0) >= pause_after for r in kept):
        for t in kept.values():
            if t.done() and t.exception():
                raise t.exception()
        await asyncio.sleep(0.002)
    phase("pause")
    await tm.pause_generation(PauseGenerationReqInput(mode=mode))
    # (retract: no request joins the retracted ones' recompute, so their batch is a fresh engine's)
    during = None if mode == "retract" else asyncio.create_task(s.gen("during", prompt(50), 8, key("during")))
    phase("push")
    res["push"] = await push(engine, b)
    await asyncio.sleep(0.3)  # outputs the scheduler sent before it paused have arrived
    res["at_pause"] = {r: s.seen[r] for r in kept}
    res["during_waited"] = "during" not in s.first
    phase("continue")
    t0 = time.perf_counter()
    await tm.continue_generation(ContinueGenerationReqInput())
    t1 = time.perf_counter()
    res["continue_s"] = t1 - t0
    if mode != "retract":
        after = asyncio.create_task(s.gen("after", prompt(60), 8, key("after")))
        while "after" not in s.first and not after.done():
            await asyncio.sleep(0.0005)
        res.update(first_token_after_continue_s=s.first.get("after", t1) - t1,
                   tokens_in_flight_at_first_token=sum(tokens - s.seen[r] for r in kept if not kept[r].done()))
    phase("drain")
    res["kept"] = {r: await t for r, t in kept.items()}
    res["admitted"] = {} if during is None else {"during": await during, "after": await after}
    if mode == "abort":  # resubmitted as prompt + partial tokens, one at a time (AReaL-style)
        phase("resubmit")
        res["resubmitted"] = {r: await s.gen(f"re-{r}", prompt(int(r[1:])) + o["tokens"], tokens - len(o["tokens"]),
                                             key(f"re-{r}")) for r, o in res["kept"].items()}
    res["admitted"]["repeat0"] = await s.gen("repeat0", prompt(0), 8, key("repeat0"))
    if mode == "in_place":
        res["mid_sync"] = await mid_sync(engine, s, a, b, tokens)
    res["kv_scales"] = kv_scales(engine)
    return res


async def mid_sync(engine, s: Streams, a: str, b: str, tokens: int) -> dict:
    """Requests in flight, pause in place, 3 tensors of A pushed (a sync begun), continue: refused with the reason
    (the engine stays paused with what it kept); a request sent then waits; B in full, continue: the kept requests
    finish, the waiting one is served, and a request = fresh engine."""
    from sglang.srt.managers.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput

    tm = engine.tokenizer_manager
    held = {f"m{i}": asyncio.create_task(s.gen(f"m{i}", prompt(70 + i), tokens)) for i in range(2)}
    while not all(s.seen.get(r, 0) >= 4 for r in held):
        await asyncio.sleep(0.002)
    await tm.pause_generation(PauseGenerationReqInput(mode="in_place"))
    out = {"partial_push": await push(engine, a, count=3), "continue_refused": None}
    try:
        await tm.continue_generation(ContinueGenerationReqInput())
    except Exception as e:  # the refusal (SyncIncomplete)
        out["continue_refused"] = str(e)
    new = asyncio.create_task(s.gen("mid-new", prompt(80), 8))
    await asyncio.sleep(0.5)
    out["new_waited"] = not new.done() and "mid-new" not in s.first
    out["held_at_refusal"] = {r: s.seen.get(r, 0) for r in held}
    out["full_push"] = await push(engine, b)
    await tm.continue_generation(ContinueGenerationReqInput())
    out.update(held={r: await t for r, t in held.items()}, new=await new)
    out["repeat0"] = await s.gen("mid-repeat0", prompt(0), 8, key("mid-repeat0"))
    return out


def kv_scales(engine):
    from flashrl_tools.verify.sglang_job import kv_scales as read

    return read(engine) if str(engine.server_args.kv_cache_dtype).startswith("fp8") else None


async def serve(engine, req: dict) -> dict:
    """`batches`: lists of [rid, ids, max tokens, radix namespace or null], each list sent as one batched
    request; `score`: [rid, ids, start]: the teacher-forced logprobs of ids[start:]."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    tm, out, scored = engine.tokenizer_manager, {}, {}
    for batch in req.get("batches", []):
        keys = [k for *_, k in batch]
        obj = GenerateReqInput(input_ids=[ids for _, ids, _, _ in batch], rid=[rid for rid, *_ in batch],
                               return_logprob=True, extra_key=None if keys == [None] * len(keys) else keys,
                               sampling_params=[{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}
                                                for _, _, n, _ in batch])
        got = await tm.generate_request(obj, None).__anext__()
        for (rid, *_), g in zip(batch, got):
            out[rid] = {"tokens": list(g["output_ids"]),
                        "logprobs": [lp for lp, _, _ in g["meta_info"]["output_token_logprobs"]]}
    for rid, ids, start in req.get("score", []):
        obj = GenerateReqInput(input_ids=ids, rid=rid, return_logprob=True, logprob_start_len=start,
                               sampling_params={"temperature": 0.0, "max_new_tokens": 1})
        got = await tm.generate_request(obj, None).__anext__()
        scored[rid] = [lp for lp, _, _ in got["meta_info"]["input_token_logprobs"]]
    return {"outputs": out, "scored": scored, "kv_scales": kv_scales(engine)}


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("a")
    r.add_argument("b")
    r.add_argument("--mode", required=True, choices=("abort", "retract", "in_place"))
    r.add_argument("--requests", type=int, default=8)
    r.add_argument("--tokens", type=int, default=96)
    r.add_argument("--pause-after", type=int, default=12)
    r.add_argument("--push", choices=("tensor", "distributed"), default="tensor")
    v = sub.add_parser("serve")
    v.add_argument("b")
    v.add_argument("request", help="JSON: {batches, score} (serve's docstring)")
    for p in (r, v):
        p.add_argument("out")
        p.add_argument("--engine-args", type=json.loads, default={})
    x = ap.parse_args()
    engine = start(x.a if x.cmd == "run" else x.b, x.engine_args)
    try:
        if x.cmd == "run":
            PUSH["how"] = x.push
            result = engine.loop.run_until_complete(run(engine, x.a, x.b, x.mode, x.requests, x.tokens,
                                                        x.pause_after))
        else:
            result = engine.loop.run_until_complete(serve(engine, json.loads(open(x.request).read())))
    finally:
        engine.shutdown()
    with open(x.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
