"""SGLang's schedulers (one process per TP rank): where requests reach the model's process (admission,
core/admission.py), SGLang's sleep (`release_memory_occupation`), the update paths the runtime cannot
take, and the scales RPC."""

from __future__ import annotations

import json
import logging

from flashrl_tools.runtime.core import process
from flashrl_tools.runtime.core.admission import refusal
from flashrl_tools.runtime.core.kv_state import ABANDON, FINISH, calibration_index, calibration_token
from flashrl_tools.runtime.core.logs import stall_watch, step_line, stepping
from flashrl_tools.runtime.sglang.capabilities import tp_rank

log = logging.getLogger("flashrl_tools.runtime")
_warned: set[str] = set()


def add_request(scheduler, req, is_retracted=False, *args, **kwargs):
    """BEFORE `Scheduler._add_request_to_queue`: abort a request while the weights are incomplete or the
    FP8 KV scales are stale (the calibration's own requests are routed to the scales' state)."""
    if is_retracted or getattr(req, "finished_reason", None) is not None:
        return
    from flashrl_tools.runtime.sglang import pause

    index = calibration_index(req.rid)
    last = index in (FINISH, ABANDON)
    problem = (refusal(s.status() for s in process.sessions())
               or refusal(route(kv, req.rid, pause.kept_slots(scheduler) if last else None)
                          for kv in process.kv_states()))
    if last:  # the scales are written (or the calibration gave up): what was set aside for it goes on
        pause.finish_queued(scheduler, req)
    if index is not None:
        sample_like_running(scheduler, req)
    if problem is not None:
        req.set_finish_with_abort(problem)
    elif getattr(req, "return_logprob", False) and "truncation" not in _warned and _truncates(req):
        _warned.add("truncation")
        log.warning("flashrl: SGLang returns log softmax(logits / T) before top-p / top-k truncation: with top_p < 1 "
                    "or top_k set these are not the logprobs of the distribution sampled from (vLLM's "
                    "processed_logprobs are); importance weights computed from them are off. Sample with top_p=1, "
                    "top_k=-1, or ask return_sampling_mask=True (with a finite top_k) and read "
                    "meta_info['output_token_sampling_logprobs'] (renormalised over the sampled support)")


def route(kv, rid, kept=None) -> str | None:
    """SGLang's transport of the core's FP8 KV calibration (core/kv_driver.py; vLLM's is its workers' RPCs): the
    calibration's requests reach the scheduler by rid -- its first sequence arms the scales' state, FINISH writes
    the scales (`kept`: the slots of requests set aside in place, re-encoded), ABANDON goes back to the scales in
    use -- and any other request is refused while the scales are stale (`KVScaleState.refusal`)."""
    index = calibration_index(rid)
    if index is None:
        if kv.armed:  # the front end gave up on a calibration
            kv.abandon()
        return kv.refusal()
    if index == "0" and kv.stale():
        kv.arm()
    elif index == ABANDON and kv.armed:
        kv.abandon()
    elif index == FINISH and kv.armed:
        try:
            kv.finish(kept)
        except Exception as e:  # raised here, it would end the scheduler's process: rollouts are refused
            kv.error = f"{type(e).__name__}: {e}"
            log.exception("flashrl: FP8 KV calibration failed; rollouts are refused until one succeeds")
    return None


SAMPLING_PATH = ("temperature", "top_p", "top_k", "min_p")  # what SGLang picks a batch's sampler by


def sample_like_running(scheduler, req) -> None:
    """A calibration request samples as the requests running beside it. Its one token is thrown away, but the
    overlap scheduler merges a prefilled request into the running decode batch before that token's result is
    processed, and SGLang picks a batch's sampler from the union of its requests' settings: a greedy request
    (top_k=1) beside requests sampled at T=1 moves the batch onto FlashInfer's top-k / top-p kernel, which
    FlashInfer JIT-builds on its first use on a host -- the finish request, merged with the requests released
    from the continue, stalled them 94-127 s while it compiled (issue 42's stall, 2026-11-26). With a running
    request's settings the batch keeps its own sampler. With nothing running it stays greedy, as sent."""
    running = getattr(getattr(scheduler, "running_batch", None), "reqs", None) or []
    like = next((r for r in running if calibration_index(getattr(r, "rid", None)) is None
                 and getattr(r, "sampling_params", None) is not None), None)
    params = getattr(req, "sampling_params", None)
    if like is None or params is None:
        return
    for name in SAMPLING_PATH:
        if hasattr(like.sampling_params, name):
            setattr(params, name, getattr(like.sampling_params, name))


CALIBRATING = "_flashrl_calibrating"  # Scheduler attribute: the calibration request being prefilled
QUEUED = "_flashrl_calibration_queue"  # Scheduler attribute: the calibration's next sequences, in order


def one_calibration_per_batch(original, scheduler, req, *args, **kwargs):
    """AROUND `Scheduler._add_request_to_queue`: the front end sends the FP8 KV calibration's sequences at once
    (kv_front.prefill_all); they reach the waiting queue one at a time, each once the one before is in the batch
    about to run (`next_calibration`), so each is prefilled in a batch of its own -- the batches, and the
    kernels' results, of a fresh engine (SGLang would batch them together). Sequences still queued when another
    calibration, the finish or the abandon request arrives are aborted (they would add to the new maxima); a new
    calibration's first sequence waits for the request in progress (it runs before the new one arms)."""
    index = calibration_index(getattr(req, "rid", None))
    retracted = bool(kwargs.get("is_retracted", args[0] if args else False))
    if index is None or retracted or req is getattr(scheduler, CALIBRATING, None):
        return original(scheduler, req, *args, **kwargs)
    token, sequence = calibration_token(req.rid), index.isdigit()
    queued = scheduler.__dict__.setdefault(QUEUED, [])
    stale = [r for r in queued if not sequence or calibration_token(r.rid) != token]
    if stale:
        queued[:] = [r for r in queued if r not in stale]
        for r in stale:  # through SGLang's own path for a refused request: the front end gets the abort
            r.set_finish_with_abort("flashrl: FP8 KV calibration superseded")
            original(scheduler, r)
    current = getattr(scheduler, CALIBRATING, None)
    if sequence and current is not None and not current.finished() and not _dropped(scheduler, current):
        queued.append(req)
        return None
    setattr(scheduler, CALIBRATING, req if sequence else None)
    return original(scheduler, req, *args, **kwargs)


def next_calibration(result, scheduler, *args, **kwargs):
    """AFTER `Scheduler.get_next_batch_to_run` (every loop iteration): once the calibration request is in the batch
    about to run -- a prefill of its own: the next sequence can only join a later batch -- or has finished (an abort),
    the next one goes to the queue. Released at launch, the sequences run in consecutive iterations; released at
    their result (2026-11-26), each cost two (the overlap loop merges a prefilled request into a decode step
    before its result is processed): 8 sequences took 0.43 s at 7B."""
    current = getattr(scheduler, CALIBRATING, None)
    if current is None:
        return None
    batch = getattr(result, "batch_to_run", None)
    launched = batch is not None and any(r is current for r in batch.reqs) and getattr(scheduler, "chunked_req",
                                                                                          None) is not current
    if not launched and not current.finished() and not _dropped(scheduler, current):
        return None
    setattr(scheduler, CALIBRATING, None)
    queued = getattr(scheduler, QUEUED, None)
    if queued:
        scheduler._add_request_to_queue(queued.pop(0))  # through the hooks: admission, then this one's turn
    return None


def _dropped(scheduler, req) -> bool:
    """A calibration request SGLang let go of without finishing it: its abort of a queued request pops it from the
    waiting queue and marks nothing (`Scheduler.abort_request`, "abort method 1") -- what the front end's abort of a
    failed calibration batch's other sequences does. Held as the request in progress it would keep every later
    calibration's sequences queued for good (issue 42, 2026-11-27: after a continue while the weights were
    incomplete, the next rollout's calibration waited with the scheduler idle)."""
    queue = getattr(scheduler, "waiting_queue", None)
    if queue is None or req.finished() or any(r is req for r in queue) or getattr(scheduler, "chunked_req", None) is req:
        return False
    log.info("flashrl: FP8 KV calibration request %s left SGLang's queue unfinished (aborted); the next one goes on",
             req.rid)
    return True


def _truncates(req) -> bool:
    params = getattr(req, "sampling_params", None)
    top_p, top_k = getattr(params, "top_p", 1.0), getattr(params, "top_k", -1)
    return top_p < 1.0 or 0 < top_k < (1 << 30)  # SGLang's TOP_K_ALL = 1 << 30: the whole vocabulary


def release_weights(result, manager, recv_req=None, *args, **kwargs):
    """AFTER `release_memory_occupation(tags)` (SGLang's sleep): with "weights" (or no tags) it frees the
    weights' memory and restores only buffers on resume (`_export_static_state`): refuse until a full
    sync. With `enable_weights_cpu_backup` (verl's hybrid engine sets it) the memory saver copies the
    weights' memory to the CPU and back on resume, synced 8-bit weights included: nothing is lost."""
    tags = getattr(recv_req, "tags", None)
    runner = getattr(getattr(manager, "tp_worker", None), "model_runner", None)
    if getattr(getattr(runner, "server_args", None), "enable_weights_cpu_backup", False):
        return result
    if not tags or "weights" in tags:
        for session in process.sessions():
            session.discard("SGLang release_memory_occupation(weights)")
    return result


def direct_updates(updater, named_tensors=None, load_format=None, *args, **kwargs):
    """BEFORE `WeightUpdater.update_weights_from_tensor`: loads that bypass `load_weights` are refused."""
    if load_format not in (None, "flattened_bucket"):
        raise RuntimeError(f"flashrl: update_weights_from_tensor(load_format={load_format!r}) writes parameters "
                           "without re-quantizing them; push with load_format=None or 'flattened_bucket'")


def progress(result, scheduler, batch=None, *args, **kwargs):
    """AFTER `Scheduler.process_batch_result`: a batch's result was processed. FLASHRL_DEBUG_STACKS: the stall dump
    moves on (core/logs.py stall_watch). FLASHRL_STEP_LOG: TP rank 0 logs the step (`step_line`): decode, its
    requests and the requests waiting; extend (prefill), the requests running or in it (the overlap scheduler has
    merged it into the running batch already, the normal one not yet) and the waiting ones."""
    stall_watch()
    batch = kwargs.get("batch", batch)
    if batch is None or tp_rank(scheduler) != 0 or not stepping():
        return None
    mode, reqs = batch.forward_mode, batch.reqs
    waiting = len(getattr(scheduler, "waiting_queue", None) or ())
    if mode.is_decode():
        step_line("d", len(reqs), len(reqs) + waiting)
    elif mode.is_extend():
        running = getattr(getattr(scheduler, "running_batch", None), "reqs", None) or []
        step_line("e", len(reqs), len({id(r) for r in running} | {id(r) for r in reqs}) + waiting)
    else:
        step_line("o", len(reqs), waiting)
    return None


def dump_kv_scales(scheduler, path: str) -> None:
    """`Engine.collective_rpc("flashrl_kv_scales", path=...)`: each rank's current FP8 KV scales as JSON, rank 0's
    at `path`, rank R's at `path.rankR` (TP > 1: each rank calibrates the heads it holds)."""
    from flashrl_tools.fsutil import atomic_write_text

    rank = tp_rank(scheduler)
    if process.kv_states():
        kv = process.kv_states()[0]
        atomic_write_text(path if rank == 0 else f"{path}.rank{rank}",
                          json.dumps({"scales": kv.current, "stale": kv.stale()}))
