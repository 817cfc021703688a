"""The engine's weight state as one digest: sha1 of every parameter and buffer and of every tensor
kernel objects hold. Left out: KV-cache tensors, anything over 256 MiB, the runtime's own references
(`_flashrl*` attributes, e.g. the CPU INT8 kernel's kept-alive inputs) and tensors that hold a
native object's address rather than data (vLLM-CPU's oneDNN `handler_tensor`: differs per process).
Two engines with equal digests compute with the same bits: this is how "a synced engine equals a
fresh engine" is checked where the synced engine cannot be asked afterwards (a trainer's rollout
engine is gone when the run ends). Engine-neutral: kernel objects are found by their package
(`vllm`, `sglang`), which the adapter names.

`FLASHRL_SYNC_DIGEST=DIR`: after complete weight sync n each rank writes `DIR/tp<rank>-sync<n>.json`
(`{"sync": n, "tensors": N, "digest": {name: sha1}, "small": {name: values}}` with the values of
tensors of <= 4 elements, i.e. scales; ~40 KB per file). The tensors are copied to host memory in
the sync; hashing and writing run in a thread, so the trainer's step does not wait for them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger("flashrl_tools.runtime")
_MAX_BYTES = 256 << 20
_SKIP = ("kv_cache", "._flashrl", "dnnl_handler.handler_tensor")
_writers: list[threading.Thread] = []
_MAX_DEPTH = 6
# nn.Module internals that hold no kernel state of their own (parameters, buffers and submodules
# are restored or visited separately; hooks are functions)
_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})
# The attention layers' FP8 KV-cache scales (vLLM: `_k_scale` ... and the CPU copies `_k_scale_cpu` / `_v_scale_cpu`;
# SGLang: `k_scale` / `v_scale`): an engine recalibrates them at its first rollout after a sync, so a digest written
# right after the sync and a fresh engine's are compared without them (tests/gpu/ compare the scales themselves).
KV_SCALE_NAMES = frozenset({"_k_scale", "_v_scale", "_q_scale", "_prob_scale", "k_scale", "v_scale", "q_scale",
                            "prob_scale", "_k_scale_cpu", "_v_scale_cpu"})


def is_kv_scale(name: str) -> bool:
    """Whether a digest entry (`kernel:model.layers.0.self_attn.attn._k_scale_cpu`, ...) is an FP8 KV-cache scale."""
    return name.rsplit(".", 1)[-1] in KV_SCALE_NAMES


def kernel_held_tensors(model: torch.nn.Module, engine: str, extra_roots=(),
                        device_type: str = "cuda") -> dict[str, torch.Tensor]:
    """Tensors on `device_type` reachable from the model's modules (and `extra_roots`: kernels kept
    alive for captured CUDA graphs) through the engine's objects (classes of package `engine`: quant
    methods, kernels, their lists and dicts) that share no storage with a parameter or buffer. Keyed
    by the path they were found at."""
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
        elif type(obj).__module__.startswith(engine) and hasattr(obj, "__dict__"):
            for key, value in vars(obj).items():
                visit(value, f"{path}.{key}", depth + 1)

    for name, module in model.named_modules():
        for key, value in vars(module).items():
            if key not in _MODULE_INTERNALS and not isinstance(value, torch.nn.Module):
                visit(value, f"{name}.{key}" if name else key, 1)
    for i, root in enumerate(extra_roots):
        visit(root, f"<kept kernel {i}>", 1)
    return found


def state_tensors(model: torch.nn.Module, engine: str) -> dict[str, torch.Tensor]:
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    device = next(model.parameters()).device.type
    tensors.update({f"kernel:{p}": t for p, t in kernel_held_tensors(model, engine, device_type=device).items()
                    if not any(s in p for s in _SKIP) and t.numel() * t.element_size() < _MAX_BYTES})
    return tensors


def _host_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8).to("cpu", copy=True)


def _sha1(host: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: hashlib.sha1(t.numpy().tobytes()).hexdigest()[:16] for name, t in sorted(host.items())}


def model_digest(model: torch.nn.Module, engine: str) -> dict[str, str]:
    return _sha1({name: _host_bytes(t) for name, t in state_tensors(model, engine).items()})


def small_values(model: torch.nn.Module, engine: str, most: int = 4) -> dict[str, list[float]]:
    """The values of the state's floating-point tensors of at most `most` elements (scales): a
    digest says that they differ, these say how."""
    return {name: [float(x) for x in t.detach().flatten().tolist()] for name, t in state_tensors(model, engine).items()
            if t.is_floating_point() and t.numel() <= most}


def write_after_sync(model: torch.nn.Module, sync_number: int, engine: str, rank: int) -> None:
    """Called when sync `sync_number` is complete; writes only when `FLASHRL_SYNC_DIGEST` is set."""
    from flashrl_tools.config.settings import settings

    out_dir = settings().sync_digest
    if not out_dir:
        return
    host = {name: _host_bytes(t) for name, t in state_tensors(model, engine).items()}
    small = small_values(model, engine)
    path = Path(out_dir) / f"tp{rank}-sync{sync_number}.json"

    def write():
        try:
            record = {"sync": sync_number, "tensors": len(host), "digest": _sha1(host), "small": small}
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(record))
            os.replace(tmp, path)
        except OSError as e:
            log.warning("flashrl: could not write the sync digest to %s: %s", path, e)

    while _writers and not _writers[0].is_alive():
        _writers.pop(0)
    for earlier in _writers:  # at most one write in flight
        earlier.join()
    thread = threading.Thread(target=write, name="flashrl-sync-digest", daemon=False)
    thread.start()
    _writers.append(thread)


def compare(a: dict[str, str], b: dict[str, str]) -> dict:
    """What differs between two digests: names only in one, names whose bytes differ."""
    return {"tensors": len(a), "only_first": sorted(set(a) - set(b)), "only_second": sorted(set(b) - set(a)),
            "differ": sorted(n for n in set(a) & set(b) if a[n] != b[n])}
