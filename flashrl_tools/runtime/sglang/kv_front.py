"""FP8 KV cache, SGLang front end: SGLang's `TokenizerManager` (in the offline Engine's process, or the
HTTP server's, which verl and slime use) sees every request and every weight update, so the core's
calibration driver (core/kv_driver.py) runs there; it sends the calibration sequences as one batched request.
The schedulers (scheduler.py) route the calibration's requests by rid: they prefill them one per batch, arm on
its first sequence and write the scales on its `finish` request, and they
decide whether their scales are stale -- a calibration after an update that did not complete a sync
changes nothing, and a rollout reaching a scheduler with stale scales is aborted there, never served."""

from __future__ import annotations

import asyncio
import logging

from flashrl_tools.runtime.core.adapter import KVFront
from flashrl_tools.runtime.core.kv_driver import NoLock, calibrate, calibrating, shared_lock
from flashrl_tools.runtime.core.kv_math import calibration_inputs, is_fp8_kv
from flashrl_tools.runtime.core.kv_state import ABANDON, FINISH, calibration_index, calibration_rid

log = logging.getLogger("flashrl_tools.runtime")

HOLD = "_flashrl_hold"  # TokenizerManager attribute: a continue's calibration runs beside held requests (pause.py)
STALE = "_flashrl_kv_stale"  # TokenizerManager attribute: scales may be stale (unset: never calibrated)
FLUSH_TRIES = 200  # x 10 ms: the schedulers flush only when idle


_ONE_TOKEN = {"max_new_tokens": 1, "temperature": 0.0}  # a calibration request: its prefill, one greedy token


def _served(out) -> bool:
    """A calibration request's output: not aborted by the schedulers."""
    return (((out or {}).get("meta_info") or {}).get("finish_reason") or {}).get("type") != "abort"


class TokenizerFront(KVFront):
    """`KVFront` of SGLang's TokenizerManager. `original`: the unhooked `generate_request`."""

    def __init__(self, original, manager):
        self.original, self.manager = original, manager
        self._first: list[int] = []

    def lock(self):
        return shared_lock(self.manager)

    def aside(self):
        """Requests in flight are set aside by the schedulers at a continue after a retract or an in-place
        pause (pause.py); at any other time the calibration waits for them."""
        return Held(len(self.manager.rid_to_state)) if getattr(self.manager, HOLD, False) else NoLock()

    async def stale(self) -> bool:
        return getattr(self.manager, STALE, True)

    async def in_flight(self) -> int:
        return len(self.manager.rid_to_state)

    async def flush(self) -> bool:
        if getattr(self.manager, HOLD, False):  # held requests wait in the schedulers (never idle): the
            return True  # versioned radix-cache namespaces (pause.salt) keep old blocks from new requests
        for _ in range(FLUSH_TRIES):
            result = await self.manager.flush_cache()
            if getattr(result, "success", True):
                return True
            await asyncio.sleep(0.01)
        log.warning("flashrl: SGLang did not flush its prefix cache around the FP8 KV calibration")
        return False

    def sequences(self) -> list[list[int]]:
        limit = int(self.manager.context_len)
        cap = getattr(self.manager, "max_req_input_len", None)  # SGLang's schedulers abort prompts this long or
        if cap:  # longer (its context length - 6): a calibration clipped to the context alone never ran there
            limit = min(limit, int(cap))
        out = calibration_inputs(getattr(self.manager, "tokenizer", None), self.manager.model_config.vocab_size, limit)
        self._first = out[0][:2]
        return out

    async def arm(self) -> None:
        """The schedulers arm on the first calibration sequence (its rid)."""

    async def prefill(self, ids: list[int], rid: str) -> bool:
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(input_ids=ids, rid=rid, sampling_params=dict(_ONE_TOKEN))
        failed, out = await self._last_output(obj, rid)
        return not failed and _served(out)

    async def prefill_all(self, items: list[tuple[list[int], str]]) -> bool:
        """Every calibration sequence in one batched request (one message to the schedulers, no round trip per
        sequence); the schedulers still prefill them one per batch, in order (scheduler.one_calibration_per_batch):
        a fresh engine's batches."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(input_ids=[ids for ids, _ in items], rid=[rid for _, rid in items],
                               sampling_params=[dict(_ONE_TOKEN) for _ in items])
        failed, outs = await self._last_output(obj, f"{len(items)} requests")  # a batch: the list of their outputs
        return not failed and isinstance(outs, list) and len(outs) == len(items) and all(_served(o) for o in outs)

    async def _last_output(self, obj, what: str):
        """(whether SGLang raised, the request's -- or batch's -- last output) through the unhooked `generate_request`."""
        out = None
        try:
            async for item in self.original(self.manager, obj, None):
                out = item
        except Exception as e:  # SGLang raises for an aborted request (RequestAbortedError)
            log.warning("flashrl: FP8 KV calibration %s failed: %s", what, e)
            return True, None
        return False, out

    async def write_scales(self, token: str, rescale: bool) -> bool:
        """A last request makes the schedulers write the scales (and rescale the entries of requests set aside)."""
        return await self.prefill(self._first, calibration_rid(token, FINISH))

    async def abandon(self, token: str, rescale: bool) -> None:
        """A failed calibration sends no request -- the schedulers go back to the scales in use at the next
        request --, or, with requests set aside (`rescale`), ABANDON: they go on at once, on those scales."""
        if rescale:
            await self.prefill(self._first, calibration_rid(token, ABANDON))

    def calibrated(self) -> None:
        setattr(self.manager, STALE, False)


class Held(NoLock):
    """`aside` while the schedulers hold retracted requests: yields how many requests are in flight."""

    def __init__(self, count: int):
        self.count = count

    async def __aenter__(self):
        return self.count


async def generate_request(original, manager, obj, request=None):
    """AROUND `TokenizerManager.generate_request` (an async generator)."""
    fp8 = is_fp8_kv(getattr(manager.server_args, "kv_cache_dtype", "auto"))
    if fp8 and not calibrating() and calibration_index(getattr(obj, "rid", None)) is None:
        if getattr(manager, "is_pause", False):  # sent during a pause: the update comes first (SGLang would
            async with manager.is_pause_cond:  # wait inside, then the schedulers refuse it: stale scales)
                await manager.is_pause_cond.wait_for(lambda: not manager.is_pause)
        await calibrate(TokenizerFront(original, manager))
    async for out in original(manager, obj, request):
        yield out


async def weights_changed(original, manager, *args, **kwargs):
    """AROUND the TokenizerManager's weight updates: the next rollout calibrates first."""
    try:
        return await original(manager, *args, **kwargs)
    finally:
        setattr(manager, STALE, True)
