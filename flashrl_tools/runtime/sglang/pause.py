"""In-flight weight updates on SGLang (asynchronous RL): `pause_generation(mode=abort | retract | in_place)`,
the weights pushed while paused, `continue_generation`.

- Prefix cache by weights' version: every request's radix-cache namespace (`Req.extra_key`, SGLang's
  cache_salt) carries the number of syncs its scheduler completed when it is (re)scheduled for prefill, so
  nothing prefilled after an update reuses KV of the old weights -- a retracted request is recomputed
  whole, a new request never shares the prefix of a request kept in place. SGLang itself can only flush the
  cache when idle and asserts after an update with requests paused in flight (`flush_cache=True`, its
  default): the flush is skipped there (the namespaces keep the versions apart).
- A `continue_generation` before the sync completed is refused (core/inflight.py `resume_refusal`, the rule of
  both engines): the front end asks the schedulers' sync state (SGLang's `get_internal_state`, which a paused
  scheduler answers) and raises before anything is sent: the engine stays paused with what the pause kept, new
  requests wait for the next continue. A scheduler that still finds its own sync incomplete at a continue (a
  rank the state query does not reach: SGLang answers it from each DP group's first rank) aborts what it kept
  with the same message rather than decode on half-updated weights.
- FP8 KV cache, no drain: at the continue (scales stale) each scheduler sets aside what the pause held --
  retracted requests (they hold no KV) and, in place, the running batch with its KV (`freeze`; a prefill
  cut into chunks mid-way is aborted through SGLang's own chunked abort) and requests not yet prefilled --
  so the front end calibrates at once on an otherwise idle engine (its batches a fresh engine's). The
  calibration's finish request writes the scales; the kept requests' FP8 entries are re-encoded from the
  old scales to the new ones first (`kept_slots`, kv_scales.rescale) and they decode on at once; retracted
  and waiting requests go on once that request has run (recomputed on the new weights and scales). A
  calibration that fails releases them on the old scales (their entries' own)."""

from __future__ import annotations

import logging

from flashrl_tools.runtime.core import process
from flashrl_tools.runtime.core.admission import refusal
from flashrl_tools.runtime.core.inflight import resume_refusal, salted, version_salt, weights_version
from flashrl_tools.runtime.core.session import SyncIncomplete
from flashrl_tools.runtime.core.kv_driver import calibrate
from flashrl_tools.runtime.core.kv_math import is_fp8_kv
from flashrl_tools.runtime.core.kv_state import calibration_index
from flashrl_tools.runtime.sglang.kv_front import HOLD, STALE, TokenizerFront

log = logging.getLogger("flashrl_tools.runtime")
MODE = "_flashrl_pause_mode"  # Scheduler / TokenizerManager attribute: the mode of the pause in force
HELD = "_flashrl_held"  # Scheduler attribute: retracted requests held for the FP8 KV calibration
FINISH_REQ = "_flashrl_finish_req"  # Scheduler attribute: the calibration's finish request, once the scales are written
SYNC_STATE = "flashrl_sync_status"  # get_internal_state's key: a scheduler's sync state (None: complete)
FROZEN = "_flashrl_frozen"  # Scheduler attribute: the running batch kept in place, set aside for the calibration


def salt(req, tree_cache=None, *args, **kwargs) -> None:
    """BEFORE `Req.init_next_round_input`: the request's radix-cache namespace is its caller's key plus the
    weights' version (a calibration request's own rid: its blocks are never shared). Only where the request
    matches its prefix afresh (`tree_cache` given): a chunked prefill's next chunk (no tree_cache) keeps the
    namespace its first chunk was cached under (SGLang's radix keys of one path must share it)."""
    if hasattr(req, "_flashrl_key") and tree_cache is None:
        return
    if not hasattr(req, "_flashrl_key"):
        req._flashrl_key = getattr(req, "extra_key", None)
    base = req._flashrl_key
    if calibration_index(req.rid) is not None:
        req.extra_key = salted(base, req.rid)
    else:
        req.extra_key = version_salt(base, weights_version(process.sessions()))


def flush_after_update(original, updater, recv_req, *args, **kwargs):
    """AROUND `SchedulerWeightUpdaterManager.flush_cache_after_weight_update`: flush when SGLang can (idle);
    with requests paused in flight SGLang's flush fails and it asserts -- skipped, the versions' namespaces
    keep old KV from new requests."""
    if not getattr(recv_req, "flush_cache", False):
        return None
    if not updater.flush_cache(empty_cache=getattr(recv_req, "torch_empty_cache", True)):
        log.info("flashrl: prefix cache not flushed after the update (requests paused in flight); requests "
                 "prefilled from now on use the new weights' namespace")
    return None


def scheduler_pause(original, scheduler, recv_req, *args, **kwargs):
    """AROUND `Scheduler.pause_generation` (retract / in_place; abort stays in the front end)."""
    setattr(scheduler, MODE, getattr(recv_req, "mode", None))
    return original(scheduler, recv_req, *args, **kwargs)


def scheduler_continue(original, scheduler, recv_req, *args, **kwargs):
    """AROUND `Scheduler.continue_generation`: with a stale FP8 KV cache after a retract or an in-place pause, set
    what the pause kept aside until the scales are written. (The front end refused a continue before the sync
    completed; a rank it did not ask that is still incomplete aborts what it kept, with the same message.)"""
    mode = getattr(scheduler, MODE, None)
    setattr(scheduler, MODE, None)
    why = resume_refusal(s.status() for s in process.sessions())
    if why is not None:
        abort_kept(scheduler, why)
    elif mode in ("retract", "in_place") and any(kv.stale() for kv in process.kv_states()):
        if mode == "in_place":
            freeze(scheduler)
        held = [r for r in scheduler.waiting_queue if calibration_index(r.rid) is None]
        if held:
            setattr(scheduler, HELD, getattr(scheduler, HELD, []) + held)
            scheduler.waiting_queue[:] = [r for r in scheduler.waiting_queue if calibration_index(r.rid) is not None]
    return original(scheduler, recv_req, *args, **kwargs)


def join_running(scheduler, batch) -> None:
    """`batch`'s requests join the running batch (SGLang's own merge of a prefill batch into it)."""
    if scheduler.running_batch.is_empty():
        scheduler.running_batch = batch
    else:
        scheduler.running_batch.merge_batch(batch)


def freeze(scheduler) -> None:
    """In place with stale FP8 KV scales: settle what the pause left (SGLang leaves it to its next step: the
    overlap loop's pending result, a prefill batch not merged yet), then set the running batch aside."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    last, chunked = scheduler.last_batch, scheduler.chunked_req
    if getattr(scheduler, "enable_overlap", False) and last is not None and scheduler.result_queue:
        batch, result = scheduler.result_queue.popleft()
        scheduler.process_batch_result(batch, result)
    if chunked is not None and not chunked.finished():  # half its prompt's KV written: SGLang's chunked abort
        log.warning("flashrl: request %s was paused mid-prefill (chunked) with an FP8 KV cache; it is aborted at "
                    "the continue (the new scales need its prompt recomputed): resubmit it", chunked.rid)
        scheduler._pending_chunked_abort_req = chunked
    if last is not None and last.forward_mode.is_extend():
        last.filter_batch(chunked_req_to_exclude=[chunked] if chunked is not None else [])
        if not last.is_empty():
            join_running(scheduler, last)
    scheduler.last_batch = None
    if not scheduler.running_batch.is_empty():
        setattr(scheduler, FROZEN, scheduler.running_batch)
        scheduler.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
        log.info("flashrl: %d requests kept in place set aside for the FP8 KV calibration",
                 len(getattr(scheduler, FROZEN).reqs))


def kept_slots(scheduler):
    """The KV-pool slots of the requests set aside in place (each slot once: kept requests may share a cached
    prefix): their entries were written with the old scales. None when nothing is set aside."""
    import torch

    batch = getattr(scheduler, FROZEN, None)
    reqs = [] if batch is None else [r for r in batch.reqs if not r.finished() and r.req_pool_idx is not None]
    if not reqs:
        return None
    table = scheduler.req_to_token_pool.req_to_token  # a decode step writes its input token's KV: the last
    rows = [table[r.req_pool_idx, :len(r.origin_input_ids) + len(r.output_ids) - 1] for r in reqs]  # has none
    return torch.unique(torch.cat(rows).long())


def busy(original, scheduler, *args, **kwargs):
    """AROUND `Scheduler.is_fully_idle`: not idle while requests are set aside (SGLang's idle check would
    count their KV and request slots as leaked)."""
    if getattr(scheduler, FROZEN, None) is not None or getattr(scheduler, HELD, None):
        return False
    return original(scheduler, *args, **kwargs)


def abort_kept(scheduler, why: str) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    running = [r for r in scheduler.running_batch.reqs if not r.finished()]
    for req in running:
        req.to_finish = FINISH_ABORT(why)
    for req in scheduler.waiting_queue:
        if getattr(req, "finished_reason", None) is None:
            req.set_finish_with_abort(why)
    log.error("%s -- on this rank the requests it kept are aborted (%d)", why,
              len(running) + len(scheduler.waiting_queue))


def sync_state(result, scheduler, *args, **kwargs) -> None:
    """AFTER `Scheduler.get_internal_state`: the scheduler's sync state (None: complete), for the front end's
    continue (`front_continue`)."""
    state = getattr(result, "internal_state", None)
    if isinstance(state, dict):
        state[SYNC_STATE] = refusal(s.status() for s in process.sessions())


def finish_queued(scheduler, req) -> None:
    """The calibration's finish request wrote the scales and re-encoded the kept entries (or its abandon request
    gave up: the old scales stay, their entries' own). The requests kept in place go on at once: held until the
    finish request had run, SGLang's overlap loop launched that request's own decode step before its result freed
    them, and their first token after the continue came one decode step late (2.1x int8's at 7B, issue 42).
    Retracted and waiting requests go on once it has run (a recompute batched as on a fresh engine, without it)."""
    frozen = getattr(scheduler, FROZEN, None)
    if frozen is not None:
        setattr(scheduler, FROZEN, None)
        join_running(scheduler, frozen)
        log.info("flashrl: %d requests kept in place released after the FP8 KV calibration", len(frozen.reqs))
    if getattr(scheduler, HELD, None):
        setattr(scheduler, FINISH_REQ, req)


def release_held(result, scheduler, *args, **kwargs):
    """AFTER `Scheduler.process_batch_result`: once the finish request ran, the retracted and waiting requests
    set aside go on."""
    req = getattr(scheduler, FINISH_REQ, None)
    if req is not None and req.finished():
        held = getattr(scheduler, HELD, [])
        setattr(scheduler, HELD, [])
        setattr(scheduler, FINISH_REQ, None)
        scheduler.waiting_queue.extend(held)
        log.info("flashrl: %d requests released after the FP8 KV calibration (waiting for a prefill)", len(held))
    return None


async def front_pause(original, manager, obj, *args, **kwargs):
    """AROUND `TokenizerManager.pause_generation`: remember the mode (the continue's FP8 KV calibration)."""
    setattr(manager, MODE, getattr(obj, "mode", None))
    return await original(manager, obj, *args, **kwargs)


async def front_continue(original, manager, obj, *args, **kwargs):
    """AROUND `TokenizerManager.continue_generation`: refused before every scheduler's sync completed (raised: the
    engine stays paused); with an FP8 KV cache whose scales are stale after a retract or an in-place pause,
    calibrate right after the continue, beside the requests the schedulers set aside (scheduler_continue)."""
    why = resume_refusal(s.get(SYNC_STATE) for s in await manager.get_internal_state() if isinstance(s, dict))
    if why is not None:
        log.error("%s", why)
        raise SyncIncomplete(why)
    mode = getattr(manager, MODE, None)
    setattr(manager, MODE, None)
    fp8 = is_fp8_kv(getattr(manager.server_args, "kv_cache_dtype", "auto"))
    hold = fp8 and mode in ("retract", "in_place") and getattr(manager, STALE, True)
    if hold:
        setattr(manager, HOLD, True)
    try:
        result = await original(manager, obj, *args, **kwargs)
        if hold:
            await calibrate(TokenizerFront(unhooked_generate, manager))
        return result
    finally:
        setattr(manager, HOLD, False)


def unhooked_generate(manager, obj, request=None):
    """The calibration's requests through `generate_request` (its hook passes calibration rids through)."""
    return type(manager).generate_request(manager, obj, request)
