"""In-flight weight updates, the engine core's side: set the scheduler's requests aside while a paused
engine runs the FP8 KV calibration alone, and put them back (EngineCore utilities, called by name through
`call_utility_async` from the front end: async_front.py, which says when and why). The kept requests'
KV blocks stay allocated; every other block leaves the prefix cache (it was written with the old scales);
the model runner takes the kept requests back as requests not scheduled in the last step."""

from __future__ import annotations



def hold(core) -> dict:
    """Set the scheduler's requests aside (a paused, idle engine core) and let it schedule again: the
    next requests (the calibration's) run alone. Returns how many were set aside and their KV blocks
    (ids per KV-cache group)."""
    from vllm.v1.core.sched.interface import PauseState
    from vllm.v1.core.sched.request_queue import create_request_queue

    scheduler = core.scheduler
    if getattr(core, "_flashrl_held", None) is not None:
        raise RuntimeError("flashrl: requests are already set aside")
    if scheduler.pause_state == PauseState.UNPAUSED:
        raise RuntimeError("flashrl: requests are set aside only while the engine is paused")
    queues = {"running": scheduler.running}
    scheduler.running = []
    for name in ("waiting", "skipped_waiting"):
        if hasattr(scheduler, name):
            queues[name] = getattr(scheduler, name)
            setattr(scheduler, name, create_request_queue(scheduler.policy))
    core._flashrl_held = (queues, scheduler.pause_state)
    scheduler.set_pause_state(PauseState.UNPAUSED)
    # the prefix cache keeps only the kept requests' blocks (rescaled for the new scales): a block of a
    # finished request, written with the old scales, is never found again (vLLM would refuse to reset
    # the whole cache while blocks are in use)
    pool = scheduler.kv_cache_manager.block_pool
    pool.evict_blocks({b.block_id for b in pool.blocks if b.ref_cnt == 0})
    requests = [r for q in queues.values() for r in q]
    groups = len(scheduler.kv_cache_config.kv_cache_groups)
    blocks: list[set[int]] = [set() for _ in range(groups)]
    for request in requests:
        try:
            ids = scheduler.kv_cache_manager.get_block_ids(request.request_id)
        except KeyError:  # a waiting request without blocks
            continue
        for group, group_ids in zip(blocks, ids):
            group.update(group_ids)
    return {"kept": len(requests), "blocks": [sorted(b) for b in blocks]}


def release(core) -> None:
    """Put the requests set aside back (before anything that arrived meanwhile), paused as they were;
    the model runner takes them back as requests not scheduled in the last step."""
    held = getattr(core, "_flashrl_held", None)
    if held is None:
        return
    queues, state = held
    scheduler = core.scheduler
    scheduler.running = queues.pop("running") + scheduler.running
    for name, queue in queues.items():
        for request in getattr(scheduler, name):
            queue.add_request(request)
        setattr(scheduler, name, queue)
    scheduler.set_pause_state(state)
    core._flashrl_held = None
