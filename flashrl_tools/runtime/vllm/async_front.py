"""vLLM's asynchronous front end, `AsyncLLM` (verl's rollout server, `vllm serve`, the asynchronous RL
trainers' engines): request admission, the FP8 KV calibration, and in-flight weight updates --
`pause_generation` (abort / wait / keep, either `clear_cache`), the trainer's push, `resume_generation`.

- Every request is salted with the weights' version (vLLM's `cache_salt`): after an update no request
  reuses prefix-cache blocks computed by the old weights, while requests kept in flight keep theirs.
- While the engine is paused a new request waits for the resume (vLLM would queue it); a resume before
  every worker's sync completed is refused (core/inflight.py `resume_refusal`: the engine stays paused with
  the requests it kept, the trainer pushes the rest).
- With an FP8 KV cache the resume calibrates the new weights' scales before any request runs, with the
  requests kept in flight set aside in the engine core (pause.py `hold`): the calibration's prefills run
  alone -- the batches of a fresh engine --, the workers write the scales and re-encode the kept
  requests' FP8 blocks for them (core/kv_math.py `rescale_fp8_`), and `release` puts them back. No
  drain: a request sent right after the resume runs at once, beside the kept ones. A sync that arrived
  without a pause gets the same at the next request (the front end pauses in keep mode for it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from flashrl_tools.runtime.core.admission import admit
from flashrl_tools.runtime.core.inflight import resume_refusal, version_salt
from flashrl_tools.runtime.core.session import SyncIncomplete
from flashrl_tools.runtime.core.adapter import KVFront
from flashrl_tools.runtime.core.kv_driver import calibrate, calibrating, shared_lock
from flashrl_tools.runtime.core.kv_math import calibration_inputs, is_fp8_kv
from flashrl_tools.runtime.vllm.requests import calibration_prompt

log = logging.getLogger("flashrl_tools.runtime")
RESUMED = "_flashrl_resumed"  # AsyncLLM attribute while paused: an asyncio.Event set by the resume


class AsyncLLMFront(KVFront):
    """`KVFront` of `AsyncLLM`: requests arriving meanwhile wait on its lock."""

    def __init__(self, engine):
        self.engine = engine
        self.kept: int | None = None  # requests set aside while calibrating
        self.kept_blocks: list[list[int]] | None = None  # their KV blocks, per KV-cache group

    def lock(self):
        return shared_lock(self.engine)

    def aside(self):
        return aside(self)

    async def stale(self) -> bool:
        return any(await self.engine.collective_rpc("flashrl_kv_stale"))

    async def in_flight(self) -> int:
        return self.engine.output_processor.get_num_unfinished_requests()

    async def flush(self) -> bool:
        if not self.kept:  # kept requests hold blocks (vLLM would refuse): the salts keep them apart
            await self.engine.reset_prefix_cache()
        return True

    def sequences(self) -> list[list[int]]:
        config = self.engine.model_config
        return calibration_inputs(self.engine.tokenizer, config.get_vocab_size(), config.max_model_len)

    async def arm(self) -> None:
        await self.engine.collective_rpc("flashrl_kv_arm")

    async def prefill(self, ids: list[int], rid: str) -> bool:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
        async for _ in self.engine.generate(calibration_prompt(ids, rid), params, rid):
            pass
        return True

    async def write_scales(self, token: str, rescale: bool) -> bool:
        await self.engine.collective_rpc("flashrl_kv_finish", args=(self.kept_blocks if rescale else None,))
        return True

    async def abandon(self, token: str, rescale: bool) -> None:
        await self.engine.collective_rpc("flashrl_kv_abandon")

    def calibrated(self) -> None:
        pass


def salted(prompt, version: int):
    """The request's prompt with the weights' version in its `cache_salt` (core/inflight.py)."""
    if isinstance(prompt, str):
        return {"prompt": prompt, "cache_salt": version_salt(None, version)}
    if isinstance(prompt, dict) and ("prompt" in prompt or "prompt_token_ids" in prompt):
        return {**prompt, "cache_salt": version_salt(prompt.get("cache_salt"), version)}
    return prompt  # an engine-core request or a stream: the caller's salt as it is


async def generate(original, engine, *args, **kwargs):
    """AROUND `AsyncLLM.generate`: while the engine is paused, a request waits for the resume (which
    calibrates: pause.py); before it enters, it is refused while the workers' weights are incomplete
    (asked once per change: see `changed`), FP8 KV scales are calibrated, and its prompt is salted."""
    if not calibrating():
        await resumed(engine)
        await _admit_async(engine)
        if is_fp8_kv(engine.vllm_config.cache_config.cache_dtype):
            await calibrate(AsyncLLMFront(engine))
        version = getattr(engine, "_flashrl_version", 0)
        if args:
            args = (salted(args[0], version), *args[1:])
        elif "prompt" in kwargs:
            kwargs["prompt"] = salted(kwargs["prompt"], version)
    async for out in original(engine, *args, **kwargs):
        yield out


def changed(engine, *args, **kwargs) -> None:
    """BEFORE `AsyncLLM.collective_rpc` / `sleep` / `wake_up`: the workers' state may change (verl
    pushes weights through collective_rpc), so the next request asks them again (not after the
    runtime's own flashrl_* RPCs, which read the state, except flashrl_discard)."""
    rpc = kwargs.get("method", args[0] if args else None)
    if not (isinstance(rpc, str) and rpc.startswith("flashrl_")) or rpc == "flashrl_discard":
        engine._flashrl_ready_epoch = None
        engine._flashrl_epoch = getattr(engine, "_flashrl_epoch", 0) + 1


async def _admit_async(engine) -> None:
    epoch = getattr(engine, "_flashrl_epoch", 0)
    if getattr(engine, "_flashrl_ready_epoch", None) == epoch:
        return
    admit(await engine.collective_rpc("flashrl_sync_status"))
    engine._flashrl_version = max(await engine.collective_rpc("flashrl_version"))
    if getattr(engine, "_flashrl_epoch", 0) == epoch:  # nothing changed while we asked
        engine._flashrl_ready_epoch = epoch


# -- in-flight updates ---------------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def aside(front):
    """`KVFront.aside` of `AsyncLLM` (AsyncLLMFront)."""
    engine = front.engine
    why = next((w for w in await engine.collective_rpc("flashrl_kv_rescalable") if w), None)
    if why is None and engine.vllm_config.parallel_config.data_parallel_size > 1:
        why = "data parallel engine cores each hold their own requests (one hold would not reach them all)"
    if why is not None:
        if not getattr(engine, "_flashrl_told_drain", False):
            log.warning("flashrl: FP8 KV calibrations wait for the requests in flight on this engine: %s", why)
            engine._flashrl_told_drain = True
        yield None
        return
    core = engine.engine_core
    ours = not await core.is_scheduler_paused_async()
    if ours and not engine.output_processor.get_num_unfinished_requests():
        yield 0  # nothing in flight, and requests arriving wait for the calibration's lock
        return
    if ours:  # a sync arrived without a pause: freeze the requests in flight at a step boundary
        await core.pause_scheduler_async(mode="keep", clear_cache=False)
    try:
        held = await core.call_utility_async("flashrl_hold")
        front.kept, front.kept_blocks = held["kept"], held["blocks"]
        try:
            yield front.kept
        finally:
            await core.call_utility_async("flashrl_release")
            front.kept = front.kept_blocks = None
    finally:
        if ours:
            await core.resume_scheduler_async()


async def resumed(engine) -> None:
    """Wait while the engine is paused by `pause_generation` (returns at once otherwise)."""
    event = engine.__dict__.get(RESUMED)
    if event is not None:
        await event.wait()


async def pause_generation(original, engine, *args, **kwargs):
    """AROUND `AsyncLLM.pause_generation`: from now on new requests wait for the resume."""
    engine.__dict__.setdefault(RESUMED, asyncio.Event())
    try:
        return await original(engine, *args, **kwargs)
    except BaseException:
        _resume_waiters(engine)
        raise


async def resume_generation(original, engine, *args, **kwargs):
    """AROUND `AsyncLLM.resume_generation`: refused while any worker's weights are incomplete; with an
    FP8 KV cache, the scales of the new weights are calibrated (kept requests set aside, their entries
    rescaled) before the engine resumes."""
    why = resume_refusal(await engine.collective_rpc("flashrl_sync_status"))
    if why is not None:
        raise SyncIncomplete(why)
    engine._flashrl_ready_epoch = None  # the next request asks the workers again (and reads the version)
    if is_fp8_kv(engine.vllm_config.cache_config.cache_dtype):
        await calibrate(AsyncLLMFront(engine))
    result = await original(engine, *args, **kwargs)
    _resume_waiters(engine)
    return result


def _resume_waiters(engine) -> None:
    event = engine.__dict__.pop(RESUMED, None)
    if event is not None:
        event.set()
