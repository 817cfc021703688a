"""The front end's requests and the workers' named methods. Requests are refused while any worker's
weights are incomplete (a sync in progress or failed, weights discarded by sleep(level=2)) -- in the
caller, so the engine stays up -- and the FP8 KV scales are recalibrated before the first request
after a sync. Worker methods are named (`collective_rpc("flashrl_sync_status")`): callables need
VLLM_ALLOW_INSECURE_SERIALIZATION across processes, names do not."""

from __future__ import annotations

import logging

from flashrl_tools.config.resolve import RuntimeConfig
from flashrl_tools.runtime.sync_state import SyncIncomplete
from flashrl_tools.runtime.vllm.engine_args import fp8_kv
from flashrl_tools.runtime.vllm.kv_scales import (
    calibrating,
    calibrating_task,
    calibrate_kv_if_stale,
    calibrate_kv_if_stale_async,
    calibrator,
)

log = logging.getLogger("flashrl_tools.runtime")


def worker_sync_status(worker) -> str | None:
    """Runs in each worker (collective_rpc): the sync state of its model."""
    sync = getattr(worker.model_runner.model, "flashrl_sync", None)
    return None if sync is None else sync.status()


def worker_inplace_layers(worker) -> dict[str, int]:
    """Runs in each worker: how many linear layers sync in place, per processed layout."""
    sync = getattr(worker.model_runner.model, "flashrl_sync", None)
    return {} if sync is None else dict(sync.inplace.kinds)


def hook_worker_methods(rc: RuntimeConfig) -> None:
    """A named worker method, so `collective_rpc("flashrl_sync_status")` works in every executor
    (callables need VLLM_ALLOW_INSECURE_SERIALIZATION across processes; names do not)."""
    from vllm.v1.worker.worker_base import WorkerBase

    WorkerBase.flashrl_sync_status = worker_sync_status
    WorkerBase.flashrl_inplace_layers = worker_inplace_layers
    WorkerBase.flashrl_kv_stale = lambda worker: calibrator(worker).stale()
    WorkerBase.flashrl_kv_arm = lambda worker: calibrator(worker).arm(worker.model_runner)
    WorkerBase.flashrl_kv_finish = lambda worker: calibrator(worker).finish()
    WorkerBase.flashrl_kv_scales = lambda worker: calibrator(worker).scales()


def hook_async_llm(rc: RuntimeConfig) -> None:
    """vLLM's async engine (`AsyncLLM`: `vllm serve`, verl's rollout server) takes requests one
    `generate` call each. Before a request enters: refuse it while the workers' weights are
    incomplete (a sync in progress or failed, weights discarded by sleep(level=2)) -- the model's
    own refusal would kill the engine-core process -- and recalibrate the FP8 KV scales when a
    sync has completed since the last calibration (`calibrate_kv_if_stale_async`). The workers
    are asked once per change: every `collective_rpc` (verl pushes weights through one), `sleep`
    and `wake_up` through this engine makes the front end ask again."""
    try:
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError:
        return
    original = AsyncLLM.generate
    if getattr(original, "_flashrl", False):
        return

    async def generate(self, *args, **kwargs):
        if not calibrating_task.get():
            await _check_sync_async(self)
            if fp8_kv(self.vllm_config.cache_config.cache_dtype):
                await calibrate_kv_if_stale_async(self)
        async for out in original(self, *args, **kwargs):
            yield out

    generate._flashrl = True
    AsyncLLM.generate = generate
    for name in ("collective_rpc", "sleep", "wake_up"):
        method = getattr(AsyncLLM, name, None)
        if method is None:
            continue

        async def invalidating(self, *args, _method=method, _name=name, **kwargs):
            rpc = kwargs.get("method", args[0] if args else None)
            if _name != "collective_rpc" or not (isinstance(rpc, str) and rpc.startswith("flashrl_")):
                self._flashrl_ready_epoch = None
                self._flashrl_epoch = getattr(self, "_flashrl_epoch", 0) + 1
            return await _method(self, *args, **kwargs)

        setattr(AsyncLLM, name, invalidating)


async def _check_sync_async(engine) -> None:
    """Raise SyncIncomplete while any worker lacks a complete set of weights (asked once per epoch)."""
    epoch = getattr(engine, "_flashrl_epoch", 0)
    if getattr(engine, "_flashrl_ready_epoch", None) == epoch:
        return
    problems = [p for p in await engine.collective_rpc("flashrl_sync_status") if p]
    if problems:
        raise SyncIncomplete(problems[0])
    if getattr(engine, "_flashrl_epoch", 0) == epoch:  # nothing changed while we asked
        engine._flashrl_ready_epoch = epoch


def hook_request_guard(rc: RuntimeConfig) -> None:
    """Refuse new requests in the caller while a sync is incomplete or failed; the engine stays
    alive to receive the rest of the weights. (The model's forward also refuses, as a last line,
    but an exception there kills a multiprocess engine core.) The method that adds requests is
    found on LLM's MRO: its name and defining class move between vLLM versions
    (0.26: offline_utils, 0.32: entrypoints/common/offline)."""
    from vllm import LLM

    for attr in ("_render_and_add_requests", "_validate_and_add_requests"):
        owner = next((k for k in LLM.__mro__ if attr in k.__dict__), None)
        if owner is not None:
            break
    else:
        log.warning("flashrl: no request entry point found on vllm.LLM; a generate call during an "
                    "incomplete sync will fail inside the engine instead of being refused")
        return
    original = owner.__dict__[attr]
    if getattr(original, "_flashrl", False):
        return

    def guarded(self, *args, **kwargs):
        problems = [p for p in self.collective_rpc("flashrl_sync_status") if p]
        if problems:
            raise SyncIncomplete(problems[0])
        if fp8_kv(self.llm_engine.vllm_config.cache_config.cache_dtype) and not calibrating.active:
            calibrate_kv_if_stale(self)
        return original(self, *args, **kwargs)

    guarded._flashrl = True
    setattr(owner, attr, guarded)
