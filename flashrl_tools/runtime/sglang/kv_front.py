"""FP8 KV cache, SGLang front end: SGLang's `TokenizerManager` (in the offline Engine's process, or the
HTTP server's, which verl and slime use) sees every request and every weight update. After an update
(and before the first request) it runs the calibration before the next rollout: it waits for the
requests in flight, flushes the prefix cache, sends the fixed calibration sequences one at a time
(one prefill each, so the batches -- and the kernels' results -- are the same in a fresh engine),
then a last request that makes the schedulers write the scales (kv_scales.py), and flushes again
(the calibration's cache entries were written with the reference scales). Rollouts arriving
meanwhile wait on a lock. The schedulers decide whether their scales are stale: a calibration after
an update that did not complete a sync changes nothing, and a rollout that reaches a scheduler with
stale scales is aborted there, never served."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from flashrl_tools.runtime.sglang.kv_scales import CALIBRATION_RID, FINISH, calibration_index

log = logging.getLogger("flashrl_tools.runtime")

STALE = "_flashrl_kv_stale"  # TokenizerManager attribute: scales may be stale (unset: never calibrated)
FLUSH_TRIES = 200  # x 10 ms: the schedulers flush only when idle


def fp8_kv(manager) -> bool:
    return str(getattr(manager.server_args, "kv_cache_dtype", "auto")).startswith("fp8")


async def generate_request(original, manager, obj, request=None):
    """AROUND `TokenizerManager.generate_request` (an async generator)."""
    if fp8_kv(manager) and getattr(manager, STALE, True) and calibration_index(getattr(obj, "rid", None)) is None:
        await calibrate(original, manager)
    async for out in original(manager, obj, request):
        yield out


async def weights_changed(original, manager, *args, **kwargs):
    """AROUND the TokenizerManager's weight updates: the next rollout calibrates first."""
    try:
        return await original(manager, *args, **kwargs)
    finally:
        setattr(manager, STALE, True)


async def calibrate(original, manager) -> bool:
    lock = manager.__dict__.setdefault("_flashrl_kv_lock", asyncio.Lock())
    async with lock:
        if not getattr(manager, STALE, True):
            return True  # calibrated by the request that held the lock before this one
        t0 = time.perf_counter()
        while manager.rid_to_state:  # requests already in flight would add their k / v to the maxima
            await asyncio.sleep(0.005)
        sequences = calibration_inputs(manager)
        token = uuid.uuid4().hex[:12]
        ok = await flush(manager)
        try:
            for i, ids in enumerate(sequences + [sequences[0][:2]]):
                index = FINISH if i == len(sequences) else str(i)
                if not ok or not await _prefill(original, manager, ids, f"{CALIBRATION_RID}{token}-{index}"):
                    ok = False
                    break
        finally:
            ok = await flush(manager) and ok
        if ok:
            setattr(manager, STALE, False)
            log.info("flashrl: FP8 KV calibration sent (%d sequences, %.2f s)", len(sequences),
                     time.perf_counter() - t0)
        else:
            log.warning("flashrl: FP8 KV calibration did not complete (a weight sync in progress?); the next "
                        "request tries again, rollouts are refused by the engine until it completes")
        return ok


async def _prefill(original, manager, ids: list[int], rid: str) -> bool:
    from sglang.srt.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(input_ids=ids, rid=rid, sampling_params={"max_new_tokens": 1, "temperature": 0.0})
    last = None
    try:
        async for last in original(manager, obj, None):
            pass
    except Exception as e:  # SGLang raises for an aborted request (RequestAbortedError)
        log.warning("flashrl: FP8 KV calibration request %s failed: %s", rid, e)
        return False
    reason = ((last or {}).get("meta_info") or {}).get("finish_reason") or {}
    return reason.get("type") != "abort"


async def flush(manager) -> bool:
    for _ in range(FLUSH_TRIES):
        result = await manager.flush_cache()
        if getattr(result, "success", True):
            return True
        await asyncio.sleep(0.01)
    log.warning("flashrl: SGLang did not flush its prefix cache around the FP8 KV calibration")
    return False


def calibration_inputs(manager) -> list[list[int]]:
    """The fixed calibration token ids (the built-in prompts with the engine's tokenizer; seeded ids
    without one), each short enough for the engine (prompt + 1 token)."""
    from flashrl_tools.runtime.kv_calibration import calibration_sequences

    room = int(manager.context_len) - 1
    return [s[:room] for s in calibration_sequences(getattr(manager, "tokenizer", None),
                                                    manager.model_config.vocab_size)]
