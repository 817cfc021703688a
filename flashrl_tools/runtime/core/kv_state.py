"""FP8 KV-cache scales of one model (one worker / scheduler rank), kept for the weights it holds now.

After every complete sync the scales are stale. A calibration arms (fixed reference scales, forward
pre-hooks on the attention layers recording absmax, the engine's graphs set aside), runs the fixed
calibration sequences (kv_driver.py sends them), and finishes: the scales computed by kv_math.py are
written where the engine's attention reads them. Engine-neutral: where the layers keep their scales,
how a pre-hook sees q / k / v and how graphs are set aside is the adapter's `KVLayers`.
"""

from __future__ import annotations

import logging
import time

import torch

from flashrl_tools.runtime.core.adapter import KVLayers
from flashrl_tools.runtime.core.kv_math import AbsMax

log = logging.getLogger("flashrl_tools.runtime")

REFERENCE_SCALE = 1.0  # every scale while calibrating: the calibration's own attention reads the FP8 cache
CALIBRATION_RID = "flashrl-kv-calibration-"  # + token + "-" + index; the last one is FINISH (or ABANDON)
FINISH = "finish"
ABANDON = "abandon"  # a calibration that failed while requests were set aside: they go on, on the old scales


def calibration_rid(token: str, index: int | str) -> str:
    return f"{CALIBRATION_RID}{token}-{index}"


def calibration_token(rid) -> str | None:
    """The calibration a request's rid belongs to (its token), None for any other request."""
    if calibration_index(rid) is None:
        return None
    return rid[len(CALIBRATION_RID):].rsplit("-", 1)[0]


def calibration_index(rid) -> str | None:
    """'0', '1', ... or FINISH for a calibration request's rid, None for any other request."""
    if not isinstance(rid, str) or not rid.startswith(CALIBRATION_RID):
        return None
    return rid.rsplit("-", 1)[-1]


class KVScaleState:
    def __init__(self, layers: KVLayers, session, checkpoint_scales: bool):
        from flashrl_tools.errors import FlashRLError

        if not layers.layers:
            raise FlashRLError("an FP8 KV cache was configured but no attention layer of the model uses one",
                               None, "this model's attention is not supported with an FP8 KV cache; "
                               "unset FLASHRL_KV_CACHE_DTYPE / kv_cache_dtype")
        self.kv, self.session = layers, session
        # checkpoint scales (compressed-tensors kv_cache_scheme) serve until the first sync
        self.calibrated_at: int | None = session.completed if checkpoint_scales else None
        self.current = self.scales()  # the scales the layers should hold (and graphs were built with)
        self.error: str | None = None  # why the last calibration failed
        self._absmax: AbsMax | None = None
        self._hooks: list = []

    @property
    def armed(self) -> bool:
        return self._absmax is not None

    def stale(self) -> bool:
        return self.calibrated_at != self.session.completed

    def arm(self) -> int:
        self._remove_hooks()
        self._absmax = AbsMax()
        reference = dict.fromkeys(self.kv.kinds, REFERENCE_SCALE)
        for layer in self.kv.layers.values():  # fixed scales while calibrating, whatever the last ones were
            self.kv.write(layer, reference)
        for name, layer in self.kv.layers.items():
            def record(module, args, kwargs, name=name):
                self._absmax.update(name, **self.kv.inputs(module, args, kwargs))
            self._hooks.append(layer.register_forward_pre_hook(record, with_kwargs=True))
        self.kv.eager(True)
        return len(self._hooks)

    def finish(self, kept=None) -> dict[str, dict[str, float]]:
        """Write the calibrated scales; raises (scales in use restored) if a layer saw no token.
        `kept`: the blocks of requests kept across the update (the adapter's description), whose
        entries were written with the scales in use until now: they are re-encoded for the new ones."""
        t0 = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the hooks' maxima were computed on the forward stream
        scales = self._absmax.scales() if self._absmax is not None else {}
        if set(scales) != set(self.kv.layers):
            self.abandon()
            raise RuntimeError(f"KV calibration saw {len(scales)} of {len(self.kv.layers)} attention layers")
        self._disarm()
        rescale = kept is not None and len(kept) > 0  # (a tensor of slots on SGLang: no truth value)
        for name, layer in self.kv.layers.items():
            self.kv.write(layer, scales[name])
            if rescale:
                self.kv.rescale(layer, self.current[name], scales[name], kept)
        if rescale and torch.cuda.is_available():
            torch.cuda.synchronize()  # rescaled before the engine's next forward (on a stream of its own)
        changed = scales != self.current
        if changed:
            self.kv.changed()
        self.current, self.calibrated_at, self.error = scales, self.session.completed, None
        log.info("flashrl: FP8 KV scales recalibrated for the current weights (%d layers, %s%s, %.2f s)",
                 len(scales), "changed" if changed else "unchanged",
                 ", kept entries rescaled" if rescale else "",
                 time.perf_counter() - t0)
        return scales

    def abandon(self) -> None:
        """A calibration that did not complete: back to the scales in use."""
        self._disarm()
        self.reapply()

    def reapply(self) -> None:
        """Write the current scales again (after the engine reset them: vLLM's KV-cache wake)."""
        for name, layer in self.kv.layers.items():
            self.kv.write(layer, self.current[name])

    def scales(self) -> dict[str, dict[str, float]]:
        return {name: self.kv.read(layer) for name, layer in self.kv.layers.items()}

    def refusal(self) -> str | None:
        """Why a rollout must be refused here (it would read stale scales), or None."""
        if not self.stale():
            return None
        why = (f"the last calibration failed: {self.error}" if self.error else "the request did not pass "
               "the engine's front end, where the runtime calibrates them after a sync")
        return f"flashrl: the FP8 KV scales are not calibrated for the current weights ({why})"

    def _disarm(self) -> None:
        self._remove_hooks()
        self._absmax = None
        self.kv.eager(False)

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
