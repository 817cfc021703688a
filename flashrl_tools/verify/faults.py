"""Deliberate weight-sync defects, for proving that `flashrl verify reload` catches them.

Injected into one engine process (an in-process engine: VLLM_ENABLE_V1_MULTIPROCESSING=0) by
`engine_job` when its request names a fault; never active otherwise.
"""

from __future__ import annotations

from pathlib import Path

FAULTS = {
    "noop": "the sync accepts the tensors and loads nothing",
    "wrong_layer": "layer 0's and layer 1's mlp.down_proj land in each other's place",
    "stale_scales": "new INT8 weights are loaded with the scales the engine started with",
    "no_norm_rescale": "norm weights are loaded without dividing by the SmoothQuant factors",
    "skip_kv_recalibration": "FP8 KV scales stay those of the first calibration after syncs",
    "keep_caller_views": "tensors waiting for the rest of their layer stay views of the trainer's reused buffer",
}


def inject(fault: str) -> None:
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
    from flashrl_tools.runtime.core.convert import WeightConverter
    from flashrl_tools.runtime.core.kv_state import KVScaleState
    from flashrl_tools.runtime.core.session import SyncSession
    from flashrl_tools.runtime.vllm.weight_sync import LayerwiseWriter

    if fault == "skip_kv_recalibration":
        KVScaleState.stale = lambda self: self.calibrated_at is None
        return
    if fault == "keep_caller_views":
        LayerwiseWriter._own = lambda self, tensor, callers: tensor
        return

    if fault == "noop":
        def load_weights(self, weights, *args, **kwargs):
            for _ in weights:
                pass
            return set()

        SyncSession.load_weights = load_weights
        return

    convert = WeightConverter.convert
    for_checkpoint = WeightConverter.for_checkpoint.__func__

    def for_checkpoint_recording(cls, fn, loaded_dir: Path, profile_path):
        from flashrl_tools.safetensors_io import CheckpointReader

        converter = for_checkpoint(cls, fn, loaded_dir, profile_path)
        converter._fault_start = CheckpointReader(loaded_dir)
        return converter

    def faulty(self, name, tensor):
        if fault == "wrong_layer" and name.endswith("mlp.down_proj.weight"):
            swap = {".layers.0.": ".layers.1.", ".layers.1.": ".layers.0."}
            for a, b in swap.items():
                if a in name:
                    name = name.replace(a, b)
                    break
        if fault == "no_norm_rescale" and self.profile is not None and self.profile.norm_divisor(name) is not None:
            return [(name, tensor)]
        out = convert(self, name, tensor)
        if fault == "stale_scales":
            start = self._fault_start
            out = [(n, start.get(n).to(t.device) if n.endswith("_scale") and n in start else t) for n, t in out]
        return out

    WeightConverter.for_checkpoint = classmethod(for_checkpoint_recording)
    WeightConverter.convert = faulty
    WeightConverter.batch_devices = frozenset()  # every tensor through `convert` (CUDA stacks experts)
