"""An in-flight weight update on vLLM's AsyncLLM, as an asynchronous RL trainer does it (PipelineRL,
prime-rl, AReaL, verl's fully-async): requests decoding, `pause_generation(mode, clear_cache)`, the new
weights pushed one tensor per `load_weights` (collective_rpc), `resume_generation`, more requests.

Starts an AsyncLLM on A (FLASHRL_CONFIG / FLASHRL_KV_CACHE_DTYPE from the environment, engine args from
--engine-args), sends R greedy requests of T tokens sharing a long prefix, pauses once each has a few
tokens, sends a request during the pause (it must wait for the resume), pushes half of B (a resume
then is refused, the engine stays paused) and the rest (collective_rpc, or with --transfer vLLM's
weight-transfer engine: start / update / finish), resumes, sends a request right after the
resume (its first-token time and the tokens still in flight then are measured: with an FP8 KV cache
the resume calibrates without a drain), waits for everything, then (abort mode) resubmits each
aborted request's prompt + partial tokens. Then a fresh engine on B with the same settings answers
the same requests: every request admitted after the update, and every resubmission, must equal it
bit for bit (tokens and logprobs), as must the FP8 KV scales; kept requests' tokens after the update
are compared with the same tokens recomputed on B (the stale-KV effect of keep mode: reported).
Prints one line `RESULT{json}` with `checks` (each must be true) and the figures.
With --floor (keep mode, FP8 KV cache) the same tokens are also recomputed on B with a BF16 KV cache:
the FP8 cache's own effect on logprobs, beside which the kept requests' stale-KV effect is judged.
With --ipc the full push comes from this process's GPU through vLLM's CUDA-IPC engine (BF16 or the trainer's
8-bit tensors, packed or not; the engine core runs in its own process).
With --nccl (two GPUs) the same through vLLM's NCCL engine, this process the trainer on GPU 1.
With --reference sync (a calibrated YAML, which serves its own checkpoint) the reference is an engine started on A
and synced to B with nothing in flight.
Several modes (--mode keep,abort): each updated on an engine of its own, one reference engine answers them all, its
prefix cache reset between modes; RESULT{mode: result}.
With --together the abort mode's resubmissions are sent at once (one batch) to the updated engine and to the reference,
each still compared with the reference's answer to the same request: for kernels whose results do not depend on the
batch (vLLM-CPU's INT8; a GPU's BF16 GEMM tiles by the batch's rows: one after another there).
Usage: python inflight_probe.py A B --mode keep|abort|wait[,...] [--transfer [MODES]] [--clear-cache] [--floor]
       [--ipc HOW | --nccl HOW] [--engine-args JSON] [--reference fresh|sync] [--together]
"""

import argparse
import asyncio
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # functions sent to the workers

PREFIX = [1, 504, 3575, 282, 4649, 314] * 12  # 72 tokens: several full KV blocks shared by every request


def prompt(i: int) -> list[int]:
    return PREFIX + [100 + i, 200 + i]  # ids below 384: the GPU tests' models


def admitted_prompt(i: int) -> list[int]:
    """A request admitted beside the kept ones: it shares no KV block with their prompt, so that `repeat0` (their
    prompt, after the drain) can only find the blocks the old weights computed, which the weights' version in the
    cache salt must keep from it. (Blocks prefilled beside decoding requests are batch-dependent in BF16 -- the
    GEMM's tiling follows the batch -- so a shared prefix would make repeat0 differ from a fresh engine for a
    reason that is not the update.)"""
    return PREFIX[::-1] + [100 + i, 200 + i]


async def run(a: str, b: str, modes: list[str], clear_cache: bool, engine_args: dict, requests: int, tokens: int,
              pause_after: int, floor: bool = False, transfer: list[str] = (), ipc: str | None = None,
              nccl: str | None = None, reference: str = "fresh", together: bool = False) -> dict:
    """Each mode's update on an engine of its own (those in `transfer`: through the weight-transfer engine), then
    one reference engine answers every mode's requests, its prefix cache reset between modes (it holds then no
    block of an earlier mode's requests: each mode's requests find what a fresh engine's would). One mode: its
    result; several: {mode: result}."""
    from vllm import SamplingParams

    from flashrl_tools.verify.engine_job import push_checkpoint

    short = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
    runs = []
    for mode in modes:
        runs.append(await update(a, b, mode, clear_cache, engine_args, requests, tokens, pause_after,
                                 mode in transfer, ipc, nccl, together))
    engine_args = runs[-1]["engine_args"]  # (one mode: the reference is started as the updated engine was)

    phase("fresh engine")
    if reference == "sync":  # a calibrated YAML serves its own checkpoint: the reference is an engine started
        # the same way and synced to B with nothing in flight (= a fresh engine on B's calibrated checkpoint,
        # tests/gpu/test_vllm_lifecycle.py)
        fresh = start(a, engine_args)
        await fresh.collective_rpc(push_checkpoint(b))
    else:
        fresh = start(b, engine_args)
    for i, st in enumerate(runs):
        if i:
            st["res"]["reference_cache_reset"] = await fresh.reset_prefix_cache()
        await compare(fresh, st, short, together)
    fresh_scales = await kv_scales(fresh)
    fresh.shutdown()
    if floor and any(st["recomputed"] for st in runs):  # the FP8 cache's own effect: the same tokens on B with a
        # BF16 KV cache
        from flashrl_tools.runtime import apply

        os.environ.pop("FLASHRL_KV_CACHE_DTYPE", None)
        apply()  # this process serves the config without the FP8 KV cache (its engine processes read the env)
        plain = start(b, {**engine_args, "kv_cache_dtype": "auto"})
        for st in runs:
            if st["recomputed"]:
                bf16 = await teacher_forced(plain, st["finished"], st["at_pause"])
                gaps = [abs(lp - bf16[r][j]) for r, lps in st["recomputed"].items() for j, lp in lps.items()]
                st["res"]["fp8_kv_floor_mean"] = sum(gaps) / max(1, len(gaps))
        plain.shutdown()
    results = {st["res"]["mode"]: checked(st, fresh_scales) for st in runs}
    return results[modes[0]] if len(modes) == 1 else results


async def update(a: str, b: str, mode: str, clear_cache: bool, engine_args: dict, requests: int, tokens: int,
                 pause_after: int, transfer: bool, ipc: str | None, nccl: str | None, together: bool = False) -> dict:
    """One mode's in-flight update on an engine started on A: what the reference engine then answers too."""
    from vllm import SamplingParams

    from flashrl_tools.runtime.core.session import SyncIncomplete
    from flashrl_tools.verify.engine_job import push_checkpoint

    params = SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    short = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
    if transfer:  # the full push goes through vLLM's weight-transfer engine (a checkpoint-reading backend,
        # registered in the workers by the import of transfer_ext)
        here = os.path.dirname(os.path.abspath(__file__))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        engine_args = {**engine_args, "weight_transfer_config": {"backend": "flashrl_probe_checkpoint"},
                       "worker_extension_cls": "transfer_ext.Ext"}
    if ipc:  # vLLM's CUDA-IPC weight-transfer engine (the engine core in its own process)
        engine_args = {**engine_args, "weight_transfer_config": {"backend": "ipc"}}
    if nccl:  # vLLM's NCCL weight-transfer engine, this process the trainer on GPU 1 (two GPUs)
        engine_args = {**engine_args, "weight_transfer_config": {"backend": "nccl"}}
    engine = start(a, engine_args)
    group = await nccl_group(engine) if nccl else None
    if transfer or ipc:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))
    res: dict = {"mode": mode, "clear_cache": clear_cache, "push": f"CUDA IPC ({ipc})" if ipc else
                 f"NCCL from GPU 1 ({nccl})" if nccl else
                 "weight-transfer engine" if transfer else "collective_rpc + load_weights"}
    streams: dict[str, list] = {}

    async def gen(rid, ids, p=params):
        streams[rid] = []
        async for out in engine.generate({"prompt_token_ids": ids}, p, rid):
            streams[rid].append((time.perf_counter(), out))
        return completion(streams[rid][-1][1])

    kept = {f"r{i}": asyncio.create_task(gen(f"r{i}", prompt(i))) for i in range(requests)}
    while not all(len(streams.get(r, [])) >= pause_after for r in kept):
        await alive(kept.values())
        await asyncio.sleep(0.002)
    phase("pause")
    await engine.pause_generation(mode=mode, clear_cache=clear_cache)
    at_pause = {r: len(completion(streams[r][-1][1])["tokens"]) for r in kept}
    during = asyncio.create_task(gen("during", admitted_prompt(50), short))  # waits for the resume
    phase("partial push")
    await engine.collective_rpc(push_checkpoint(b, count=3))
    try:
        await engine.resume_generation()
        res["resume_mid_sync"] = "resumed"
    except SyncIncomplete as e:
        res["resume_mid_sync"] = str(e)
    await asyncio.sleep(0.05)
    res["during_waited"] = not streams.get("during")
    if ipc:
        await ipc_push(engine, a, b, ipc)
    elif nccl:
        await nccl_push(engine, group, a, b, nccl)
    elif transfer:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await engine.start_weight_update()
        await engine.update_weights(WeightTransferUpdateRequest(update_info={"path": b}))
        await engine.finish_weight_update()
    else:
        await engine.collective_rpc(push_checkpoint(b))
    phase("resume")
    t_resume = time.perf_counter()
    await engine.resume_generation()
    t_resumed = time.perf_counter()
    after = asyncio.create_task(gen("after", admitted_prompt(60), short))
    while not streams.get("after"):
        await alive([after])
        await asyncio.sleep(0.0005)
    t_first = streams["after"][0][0]
    left = sum(tokens - len(completion(s[-1][1])["tokens"]) for r, s in streams.items()
               if r in kept and not kept[r].done())
    res.update(resume_s=t_resumed - t_resume, first_token_after_resume_s=t_first - t_resumed,
               first_token_from_resume_call_s=t_first - t_resume, tokens_in_flight_at_first_token=left)
    phase("drain")
    finished = {r: await t for r, t in kept.items()}
    res["finish_reasons"] = sorted({f["finish_reason"] for f in finished.values()})
    res["kept_tokens_after_pause"] = {r: len(f["tokens"]) - at_pause[r] for r, f in finished.items()}
    admitted = {"during": await during, "after": await after}
    admitted["repeat0"] = await gen("repeat0", prompt(0), short)  # the kept requests' own prompt, after the drain
    resubmit = {}
    if mode == "abort":  # AReaL-style: prompt + the tokens the aborted request had, continued
        async def again(r, f):
            ids = prompt(int(r[1:])) + f["tokens"]
            return r, (ids, await gen(f"re-{r}", ids, SamplingParams(
                max_tokens=tokens - len(f["tokens"]), temperature=0.0, logprobs=0, ignore_eos=True)))
        resubmit = dict(await each(again, finished.items(), together))
    scales = await kv_scales(engine)
    engine.shutdown()
    return {"res": res, "engine_args": engine_args, "finished": finished, "at_pause": at_pause, "admitted": admitted,
            "resubmit": resubmit, "scales": scales, "recomputed": {}}


async def each(fn, items, together: bool) -> list:
    """`fn(*item)` for each item: one after another, or (`together`) all at once."""
    if together:
        return list(await asyncio.gather(*(fn(*item) for item in items)))
    return [await fn(*item) for item in items]


async def compare(fresh, st: dict, short, together: bool = False) -> None:
    """The reference engine's answers to one mode's requests (st: what `update` returned)."""
    from vllm import SamplingParams

    res, admitted, finished, mode = st["res"], st["admitted"], st["finished"], st["res"]["mode"]
    tag = f"{mode}-{id(st)}"
    fresh_out = {"during": admitted_prompt(50), "after": admitted_prompt(60), "repeat0": prompt(0)}
    res["admitted_equal_fresh"] = {}
    for r, ids in fresh_out.items():
        got = completion([o async for o in fresh.generate({"prompt_token_ids": ids}, short, f"f-{r}-{tag}")][-1])
        res["admitted_equal_fresh"][r] = got == admitted[r]

    async def again(r, ids_out):
        ids, out = ids_out
        p = SamplingParams(max_tokens=len(out["tokens"]), temperature=0.0, logprobs=0, ignore_eos=True)
        got = completion([o async for o in fresh.generate({"prompt_token_ids": ids}, p, f"f-{r}-{tag}")][-1])
        return r, got == out
    res["resubmitted_equal_fresh"] = dict(await each(again, st["resubmit"].items(), together))
    if mode == "keep":  # tokens after the update vs the same tokens recomputed on B
        st["recomputed"] = recomputed = await teacher_forced(fresh, finished, st["at_pause"])
        deltas = [abs(lp - finished[r]["logprobs"][j]) for r, lps in recomputed.items() for j, lp in lps.items()]
        res["kept_logprob_delta_mean"] = sum(deltas) / max(1, len(deltas))
        res["kept_logprob_delta_max"] = max(deltas, default=0.0)


def checked(st: dict, fresh_scales) -> dict:
    """One mode's result with its checks (each must be true)."""
    res, scales, mode = st["res"], st["scales"], st["res"]["mode"]
    res["scales_equal_fresh"] = None if scales is None else scales == fresh_scales
    res["checks"] = {
        "resume refused while the sync is incomplete": "incomplete" in res["resume_mid_sync"].lower()
        or "full weight sync" in res["resume_mid_sync"],
        "a request sent during the pause waits for the resume": res["during_waited"],
        "kept requests finish" if mode == "keep" else f"{mode}: requests end as vLLM says":
            res["finish_reasons"] == (["length"] if mode in ("keep", "wait") else ["abort"]),
        "a request after the drain = fresh engine": res["admitted_equal_fresh"]["repeat0"],
        "resubmitted requests = fresh engine's continuation": all(res["resubmitted_equal_fresh"].values()),
    }
    # requests that ran beside the kept ones: bit-equal where the kernels do not depend on the batch (CPU)
    res["batch_checks"] = {"requests admitted beside kept ones = fresh engine":
                           res["admitted_equal_fresh"]["during"] and res["admitted_equal_fresh"]["after"]}
    if scales is not None:
        res["checks"]["FP8 KV scales = fresh engine's"] = res["scales_equal_fresh"]
    if "reference_cache_reset" in res:  # a mode after the first: the reference's prefix cache was emptied
        res["checks"]["the reference's prefix cache reset before this mode"] = res["reference_cache_reset"]
    return res


async def ipc_push(engine, a: str, b: str, how: str) -> None:
    """B from this process's GPU through vLLM's IPC engine (`how`: bf16 | wire, packed or not: e.g. "wire-packed";
    wire = the trainer's 8-bit tensors, flashrl_tools.wire.engine_tensors)."""
    from dataclasses import asdict

    import torch
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    from flashrl_tools.safetensors_io import CheckpointReader
    from flashrl_tools.wire import engine_tensors

    tensors = [(n, t.cuda()) for n, t in CheckpointReader(b).iter_tensors()]
    if how.startswith("wire"):
        tensors = [pair for bucket in engine_tensors(tensors, a) for pair in bucket]
    torch.cuda.synchronize()
    loop = asyncio.get_running_loop()

    def send(info):
        update = WeightTransferUpdateRequest(update_info=asdict(info))
        asyncio.run_coroutine_threadsafe(engine.update_weights(update), loop).result()
    await engine.start_weight_update()
    await asyncio.to_thread(IPCWeightTransferEngine.trainer_send_weights, iter(tensors),
                            {"send_mode": send, "packed": how.endswith("packed")})
    await engine.finish_weight_update()


async def nccl_group(engine):
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

    import nccl_trainer

    info = nccl_trainer.init_info()
    _, group = await asyncio.gather(engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info)),
                                    asyncio.to_thread(nccl_trainer.trainer_group, info))
    return group


async def nccl_push(engine, group, a: str, b: str, how: str) -> None:
    """B from GPU 1 through vLLM's NCCL engine (`how` as for ipc_push)."""
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    import nccl_trainer
    from flashrl_tools.safetensors_io import CheckpointReader
    from flashrl_tools.wire import engine_tensors

    tensors = [(n, t.to(f"cuda:{nccl_trainer.TRAINER_GPU}")) for n, t in CheckpointReader(b).iter_tensors()]
    if how.startswith("wire"):
        tensors = [pair for bucket in engine_tensors(tensors, a) for pair in bucket]
    packed = how.endswith("packed")
    await engine.start_weight_update()
    await asyncio.gather(engine.update_weights(WeightTransferUpdateRequest(
        update_info=nccl_trainer.update_info(tensors, packed))), asyncio.to_thread(nccl_trainer.send, group, tensors, packed))
    await engine.finish_weight_update()


def phase(name: str) -> None:
    """Where the probe is (stderr): a run cut short by its caller's timeout says where it waited."""
    print(f"PHASE {name} {time.strftime('%T')}", file=sys.stderr, flush=True)


async def alive(tasks) -> None:
    """Raise what a request task raised (a busy wait on its outputs would spin for ever)."""
    for task in tasks:
        if task.done() and task.exception() is not None:
            raise task.exception()


async def teacher_forced(engine, finished: dict, at_pause: dict) -> dict:
    """Each kept request's tokens after the pause, recomputed by `engine` (prompt logprobs)."""
    from vllm import SamplingParams

    out = {}
    for r, f in finished.items():
        ids = prompt(int(r[1:])) + f["tokens"]
        p = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        res = [o async for o in engine.generate({"prompt_token_ids": ids}, p, f"tf-{r}-{id(engine)}")][-1]
        n = len(prompt(0))
        out[r] = {j: res.prompt_logprobs[n + j][ids[n + j]].logprob for j in range(at_pause[r], len(f["tokens"]))}
    return out


def start(model: str, engine_args: dict):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = {"max_model_len": 512, "enable_prefix_caching": True, **engine_args}
    return AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **args))


def completion(out) -> dict:
    c = out.outputs[0]
    return {"tokens": list(c.token_ids), "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])],
            "finish_reason": c.finish_reason}


async def kv_scales(engine):
    from flashrl_tools.runtime.core.kv_math import is_fp8_kv

    if not is_fp8_kv(engine.vllm_config.cache_config.cache_dtype):
        return None
    return (await engine.collective_rpc("flashrl_kv_scales"))[0]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--mode", default="keep", type=lambda v: v.split(","), help="keep | abort | wait, or several "
                    "(comma-separated: each updated on an engine of its own, one reference engine for all)")
    ap.add_argument("--clear-cache", action="store_true")
    ap.add_argument("--engine-args", type=json.loads, default={})
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--pause-after", type=int, default=6, help="streamed outputs per request before the pause")
    ap.add_argument("--floor", action="store_true", help="keep mode, FP8 KV: also recompute on a BF16-KV engine")
    ap.add_argument("--transfer", nargs="?", const="all", default="", help="the full push through vLLM's weight-transfer "
                    "engine (the CPU tests' checkpoint backend, tests/probes/sync_probe.py); MODES: those modes only")
    ap.add_argument("--ipc", choices=("bf16", "bf16-packed", "wire", "wire-packed"),
                    help="the full push from this process's GPU through vLLM's CUDA-IPC engine (multiprocess engine)")
    ap.add_argument("--nccl", choices=("bf16", "bf16-packed", "wire", "wire-packed"),
                    help="the full push from GPU 1 through vLLM's NCCL engine (two GPUs)")
    ap.add_argument("--prefix", type=json.loads, help="the shared prefix's token ids (JSON; default: 72 tokens)")
    ap.add_argument("--reference", choices=("fresh", "sync"), default="fresh", help="what the requests are compared "
                    "with: a fresh engine on B, or (a calibrated YAML) an engine on A synced to B with nothing in flight")
    ap.add_argument("--together", action="store_true", help="abort: the resubmissions sent at once (one batch) to both "
                    "engines (kernels that do not depend on the batch: vLLM-CPU's INT8)")
    x = ap.parse_args()
    if x.prefix:
        PREFIX[:] = x.prefix
    if not os.path.exists(x.b):  # in a child: torch CPU work here before AsyncLLM forks its engine core hangs
        import subprocess
        import sys

        subprocess.run([sys.executable, "-c", "import sys; from flashrl_tools.verify.perturb import perturb; "
                        "perturb(sys.argv[1], sys.argv[2])", x.a, x.b], check=True)
    transfer = x.mode if x.transfer == "all" else x.transfer.split(",")
    assert set(x.mode) <= {"keep", "abort", "wait"}, x.mode
    print("RESULT" + json.dumps(asyncio.run(run(x.a, x.b, x.mode, x.clear_cache, x.engine_args, x.requests, x.tokens,
                                                x.pause_after, x.floor, transfer, x.ipc, x.nccl,
                                                x.reference, x.together))),
          flush=True)
    from flashrl_tools.verify.engine_job import exit_engine_process

    exit_engine_process(0)
