"""FP8 KV cache, the front end's side: when a calibration runs and what it waits for, for every engine.

Before the first rollout after a weight update (and before the first one at all; vLLM: when a paused
engine resumes) the front end runs the calibration: it takes a lock (rollouts arriving meanwhile
wait), sets the requests in flight aside where the engine can (`KVFront.aside`: they stay frozen with
their KV blocks, and their FP8 entries are re-encoded for the new scales when the calibration
finishes -- no drain), else waits for them to finish (they would add their q / k / v to the maxima,
and run with the reference scales), flushes the prefix cache (blocks computed by the old weights),
arms the model side, sends the fixed calibration sequences one prefill each (so the batches -- and
the kernels' results -- are those of a fresh engine; an engine that keeps them one per batch takes them at
once: `prefill_all`), finishes (the model side writes the scales),
and flushes again (the calibration's blocks were written with the reference scales). The adapter's
`KVFront` says how each step is done on its engine; `calibrate` is written once, as a coroutine, and `run_sync` drives it for a
synchronous front end (vLLM's `LLM`), whose steps never wait.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid

from flashrl_tools.runtime.core.adapter import KVFront

log = logging.getLogger("flashrl_tools.runtime")

_calibrating: contextvars.ContextVar[bool] = contextvars.ContextVar("flashrl_kv_calibrating", default=False)


def calibrating() -> bool:
    """Whether the caller is the calibration itself (its requests pass the request hooks untouched)."""
    return _calibrating.get()


def shared_lock(owner) -> asyncio.Lock:
    """`KVFront.lock` of an asynchronous front end: one lock per engine object (`owner`), so rollouts arriving while
    a calibration runs wait for it."""
    return owner.__dict__.setdefault("_flashrl_kv_lock", asyncio.Lock())


async def calibrate(front: KVFront) -> bool:
    """Calibrate if the scales are stale; True when they are those of the current weights."""
    from flashrl_tools.runtime.core.kv_state import calibration_rid

    if not await front.stale():
        return True
    async with front.lock():
        if not await front.stale():
            return True  # calibrated by the request that held the lock before this one
        t0 = time.perf_counter()
        took = {}  # where the calibration's time goes (the log line): the bubble it adds to an update
        async with front.aside() as kept:
            if kept is None:
                while await front.in_flight():
                    await asyncio.sleep(0.005)
            took["drain"] = time.perf_counter() - t0
            sequences = front.sequences()
            token = uuid.uuid4().hex[:12]
            marker = _calibrating.set(True)
            sent = written = False  # stay False if a step raises: the model side goes back to its scales
            try:
                t = time.perf_counter()
                if await front.flush():
                    took["flush"] = time.perf_counter() - t
                    await front.arm()
                    t = time.perf_counter()
                    items = [(ids, calibration_rid(token, i)) for i, ids in enumerate(sequences)]
                    sent = await front.prefill_all(items)
                    if sent is None:
                        sent = True
                        for ids, rid in items:
                            if not await front.prefill(ids, rid):
                                sent = False
                                break
                    took["prefills"] = time.perf_counter() - t
            finally:
                try:
                    t = time.perf_counter()
                    if sent:  # finish, or abandon: the one rule for every engine
                        written = await front.write_scales(token, bool(kept))
                    else:
                        await front.abandon(token, bool(kept))
                    took["finish"] = time.perf_counter() - t
                finally:
                    t = time.perf_counter()
                    ok = await front.flush() and sent and written
                    took["flush"] = took.get("flush", 0.0) + time.perf_counter() - t
                    _calibrating.reset(marker)
        if ok:
            front.calibrated()
            log.info("flashrl: FP8 KV calibration done (%d sequences, %s, %.2f s: %s)", len(sequences),
                     "no request in flight" if not kept else f"{kept} requests kept in flight",
                     time.perf_counter() - t0, ", ".join(f"{k} {v:.3f}" for k, v in took.items()))
        else:
            log.warning("flashrl: FP8 KV calibration did not complete (a weight sync in progress?); the next "
                        "request tries again, rollouts are refused until it completes")
        return ok


def run_sync(coroutine):
    """Run a coroutine whose awaits never suspend (a synchronous engine's steps) to its result."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("flashrl: a synchronous KV calibration step waited on an event loop")


class NoLock:
    """`KVFront.lock` of a synchronous front end (its calls never interleave), and the `aside` of a
    front end that cannot set requests aside (yields None)."""

    async def __aenter__(self):
        return None

    async def __aexit__(self, *exc):
        return False
