"""vLLM's sleep mode (`enable_sleep_mode=True`: verl's hybrid engine, TRL colocate) under the runtime.

What vLLM 0.26 does (v1/worker/gpu_worker.py, device_allocator/cumem.py): everything allocated
while the model loads lives in the "weights" memory pool -- parameters, buffers, and the tensors
kernel objects create in `process_weights_after_loading`.
- `sleep(level=1)`: the pool is copied to host memory, and back on `wake_up`: nothing is lost.
- `sleep(level=2)`: the pool is freed. `wake_up` maps fresh (zeroed) memory at the same addresses
  and copies back `named_buffers()` only; the parameters come back with the trainer's next full
  sync. Tensors held by kernel objects outside parameters and buffers stay zeroed: CUTLASS FP8 MoE
  experts keep per-expert stride tensors (`ab_strides1`, `c_strides1`, ...) that way, so MoE `fp8`
  served garbage after a level-2 cycle; so do parameters no trainer pushes (attention scales of
  compressed-tensors models). Before a level-2 sleep the runtime copies every such tensor that lives
  in the weights pool to host memory and writes it back on `wake_up(["weights"])`.
- Until a complete sync arrives after a level-2 sleep the engine refuses requests (`SyncState.
  discard`): a wake without a push would serve zeroed weights without an error.
- `wake_up(["kv_cache"])`: vLLM's V1 model runner resets FP8 KV scales to 1.0
  (`init_fp8_kv_scales`); the runtime writes the scales it calibrated back.
"""

from __future__ import annotations

import bisect
import logging

import torch

from flashrl_tools.runtime.core.digest import kernel_held_tensors

log = logging.getLogger("flashrl_tools.runtime")
# Parameters no trainer pushes: attention's q/k/v (and prob) scales. vLLM 0.26's compressed-tensors
# KV-cache method makes them parameters (not buffers), so a level-2 wake does not restore them.
ATTENTION_SCALES = frozenset({"_q_scale", "_k_scale", "_v_scale", "_prob_scale", "q_scale", "k_scale", "v_scale",
                              "prob_scale"})


def unsynced_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if name.rsplit(".", 1)[-1] in ATTENTION_SCALES}


def in_weights_pool(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Those of `tensors` whose memory a level-2 sleep frees: allocations vLLM's CuMem allocator
    tagged "weights" (made while the model loaded). Empty when no such allocator is in use."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except ImportError:
        return {}
    allocator = CuMemAllocator.instance
    if allocator is None:
        return {}
    segments = sorted((ptr, data.handle[1]) for ptr, data in allocator.pointer_to_data.items()
                      if data.tag == "weights")
    starts = [s for s, _ in segments]

    def pooled(t: torch.Tensor) -> bool:
        ptr = t.untyped_storage().data_ptr()
        i = bisect.bisect_right(starts, ptr) - 1
        return i >= 0 and ptr < segments[i][0] + segments[i][1]

    return {path: t for path, t in tensors.items() if pooled(t)}


class KernelTensorBackup:
    """Host copies of the kernel-held tensors a level-2 sleep would lose, written back on wake."""

    def __init__(self) -> None:
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def save(self, model: torch.nn.Module, extra_roots=()) -> int:
        tensors = in_weights_pool({**kernel_held_tensors(model, "vllm", extra_roots), **unsynced_parameters(model)})
        self.saved = [(t, t.detach().to("cpu", copy=True)) for t in tensors.values()]
        if tensors:
            log.info("flashrl: sleep(level=2): %d kernel-held tensors (%s%s) kept on the host (vLLM restores "
                     "buffers only)", len(tensors), ", ".join(sorted({p.rsplit(".", 1)[-1] for p in tensors})[:6]),
                     ", ..." if len(tensors) > 6 else "")
        return len(self.saved)

    def restore(self) -> int:
        with torch.no_grad():
            for tensor, copy in self.saved:
                tensor.data.copy_(copy)
        restored, self.saved = len(self.saved), []
        return restored


# vLLM 0.26 (v1/worker/gpu_worker.py `sleep`) asserts, after it has suspended the pools, that the
# device-wide free memory grew. Another process allocating on the same GPU meanwhile (several
# colocated runs on one GPU) makes it fail after a complete sleep; verl's step then dies.
SHARED_GPU_ASSERT = "Memory usage increased after sleeping."


def sleep(original, worker, level: int = 1, *args, **kwargs):
    """AROUND vLLM's GPU worker `sleep`: before level 2, keep what vLLM's wake does not restore (the
    kept MoE kernels are roots of the backup); after it, the session refuses requests until a
    complete sync."""
    from flashrl_tools.runtime.vllm.fixes import first_moe_kernels

    model = worker.model_runner.model
    session = getattr(model, "flashrl_sync", None)
    backup = worker.__dict__.setdefault("_flashrl_kernel_backup", KernelTensorBackup())
    if level >= 2 and session is not None:
        backup.save(model, list(first_moe_kernels.values()))
    try:
        result = original(worker, level, *args, **kwargs)
    except AssertionError as e:
        if str(e) != SHARED_GPU_ASSERT:
            raise
        result = None  # the pools were suspended; only vLLM's device-wide accounting failed
        log.warning("flashrl: vLLM's sleep(level=%d) check failed (%s): the device's free memory fell "
                    "while the engine slept, which another process on the same GPU causes; the sleep "
                    "itself completed", level, e)
    if level >= 2 and session is not None:
        session.discard(f"vLLM sleep(level={level})")
    return result


def wake_up(result, worker, tags: list[str] | None = None, *args, **kwargs):
    """AFTER vLLM's GPU worker `wake_up`: the kept tensors (weights) and the calibrated FP8 KV scales
    (kv_cache) written back."""
    model = worker.model_runner.model
    backup = worker.__dict__.get("_flashrl_kernel_backup")
    if backup is not None and backup.saved and (tags is None or "weights" in tags):
        backup.restore()
    kv = getattr(model, "flashrl_kv", None)
    if kv is not None and (tags is None or "kv_cache" in tags):
        kv.reapply()
    return result
