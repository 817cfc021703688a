"""FLASHRL_TEST_RELOAD=1: at start, push the policy's own BF16 weights through the sync session and log
whether any parameter of the engine changed (a debugging aid for a new format); `push_policy` is also the
start-up self-check's push on an untested engine version (versions.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from flashrl_tools.config.resolve import RuntimeConfig

log = logging.getLogger("flashrl_tools.runtime")


def policy_source(loaded_dir: Path, rc: RuntimeConfig) -> Path:
    """Where the BF16 policy the engine serves lives (for FLASHRL_TEST_RELOAD)."""
    marker = loaded_dir / "flashrl_source.json"  # online-quantized cache
    if marker.is_file():
        return Path(json.loads(marker.read_text())["bf16_model"])
    if rc.entry.profile:  # calibrated checkpoint: the profile names its BF16 model
        from flashrl_tools.profile.format import load_profile

        ref = load_profile(Path(rc.entry.profile)).meta.bf16_model
        if ref is not None:
            return Path(ref.path)
    return loaded_dir


def push_policy(sync, source: Path) -> None:
    """The BF16 checkpoint at `source` through the sync session, one tensor per call (as verl pushes)."""
    from flashrl_tools.safetensors_io import CheckpointReader

    for name, tensor in CheckpointReader(source).iter_tensors():
        sync.load_weights([(name, tensor)])


def reload_check(sync, source: Path) -> bool:
    """Push the policy's own BF16 weights through the sync path; log whether any parameter of
    the engine changed (it must not, up to a calibrated profile's inexact entries)."""
    before = {n: p.detach().clone() for n, p in sync.model.named_parameters()}
    push_policy(sync, source)
    changed = {n: int((p.detach() != before[n]).sum()) for n, p in sync.model.named_parameters()
               if n in before and p.shape == before[n].shape and not torch.equal(p.detach(), before[n])}
    if changed:
        log.warning("FLASHRL_TEST_RELOAD: %d parameters changed after reloading %s (%d entries); first: %s",
                    len(changed), source, sum(changed.values()), next(iter(changed)))
    else:
        log.info("FLASHRL_TEST_RELOAD: reloading %s through the sync path left all %d parameters unchanged",
                 source, len(before))
    return not changed
