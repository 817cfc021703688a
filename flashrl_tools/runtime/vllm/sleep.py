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
import itertools
import logging

import torch

log = logging.getLogger("flashrl_tools.runtime")
_MAX_DEPTH = 6
# nn.Module internals that hold no kernel state of their own (parameters, buffers and submodules
# are restored or visited separately; hooks are functions)
_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})


def kernel_held_tensors(model: torch.nn.Module, extra_roots=(), device_type: str = "cuda") -> dict[str, torch.Tensor]:
    """Tensors on `device_type` reachable from the model's modules (and `extra_roots`: kernels kept alive for
    captured CUDA graphs) through vLLM objects -- quant methods, kernels, their lists and dicts --
    that share no storage with a parameter or buffer. Keyed by the path they were found at."""
    owned = {t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}
    found: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def visit(obj, path: str, depth: int) -> None:
        if depth > _MAX_DEPTH or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type == device_type and obj.untyped_storage().data_ptr() not in owned:
                found[path] = obj
        elif isinstance(obj, torch.nn.Module):
            return  # visited from the model's own tree
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                visit(value, f"{path}[{i}]", depth + 1)
        elif isinstance(obj, dict):
            for key, value in obj.items():
                visit(value, f"{path}[{key!r}]", depth + 1)
        elif type(obj).__module__.startswith("vllm") and hasattr(obj, "__dict__"):
            for key, value in vars(obj).items():
                visit(value, f"{path}.{key}", depth + 1)

    for name, module in model.named_modules():
        for key, value in vars(module).items():
            if key not in _MODULE_INTERNALS and not isinstance(value, torch.nn.Module):
                visit(value, f"{name}.{key}" if name else key, 1)
    for i, root in enumerate(extra_roots):
        visit(root, f"<kept kernel {i}>", 1)
    return found


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
        tensors = in_weights_pool({**kernel_held_tensors(model, extra_roots), **unsynced_parameters(model)})
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


def hook_sleep_mode(rc) -> None:
    """Sleep levels 1 and 2 under the runtime (the kept MoE kernels are roots of the backup)."""
    from flashrl_tools.runtime.vllm.fixes import first_moe_kernels

    install_sleep_hooks(lambda: list(first_moe_kernels.values()))


def install_sleep_hooks(kept_kernels) -> None:
    """Wrap vLLM's GPU worker `sleep` / `wake_up` (CPU workers have no sleep mode: nothing to do).
    `kept_kernels()`: the MoE kernels the runtime keeps alive for captured CUDA graphs."""
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except ImportError:
        return
    if getattr(Worker.sleep, "_flashrl", False):
        return
    sleep, wake_up = wrap_sleep(Worker.sleep, kept_kernels), wrap_wake_up(Worker.wake_up)
    sleep._flashrl = wake_up._flashrl = True
    Worker.sleep, Worker.wake_up = sleep, wake_up


def wrap_sleep(original_sleep, kept_kernels):
    """vLLM's worker `sleep` with the runtime around it: before level 2, keep what vLLM's wake
    does not restore; after it, refuse requests until a complete sync."""

    def sleep(self, level: int = 1, *args, **kwargs):
        model = self.model_runner.model
        sync = getattr(model, "flashrl_sync", None)
        backup = self.__dict__.setdefault("_flashrl_kernel_backup", KernelTensorBackup())
        if level >= 2 and sync is not None:
            backup.save(model, kept_kernels())
        try:
            result = original_sleep(self, level, *args, **kwargs)
        except AssertionError as e:
            if str(e) != SHARED_GPU_ASSERT:
                raise
            result = None  # the pools were suspended; only vLLM's device-wide accounting failed
            log.warning("flashrl: vLLM's sleep(level=%d) check failed (%s): the device's free memory fell "
                        "while the engine slept, which another process on the same GPU causes; the sleep "
                        "itself completed", level, e)
        if level >= 2 and sync is not None:
            sync.discard(f"vLLM sleep(level={level})")
        return result

    return sleep


def wrap_wake_up(original_wake_up):
    """vLLM's worker `wake_up`, then the kept tensors (weights) and the calibrated FP8 KV scales
    (kv_cache) written back."""

    def wake_up(self, tags: list[str] | None = None, *args, **kwargs):
        result = original_wake_up(self, tags, *args, **kwargs)
        model = self.model_runner.model
        backup = self.__dict__.get("_flashrl_kernel_backup")
        if backup is not None and backup.saved and (tags is None or "weights" in tags):
            backup.restore()
        kv = getattr(model, "flashrl_kv", None)
        if kv is not None and (tags is None or "kv_cache" in tags):
            kv.reapply()
        return result

    return wake_up
