"""FP8 KV cache, SGLang scheduler side: the k / v scales are recalibrated for the weights the engine
holds after every complete sync (the math and the calibration data: runtime/kv_calibration.py; the
front end that sends the calibration requests: kv_front.py).

Where SGLang 0.5.17 reads the scales (`RadixAttention`, Triton backend): the cache write divides k / v
by the tensors `layer.k_scale` / `v_scale` (read from memory, also inside CUDA graphs), the attention
kernels multiply by the Python floats `layer.k_scale_float` / `v_scale_float` -- kernel arguments,
baked into a captured decode graph. So new scales are written in place into the tensors, the floats
are set, and the decode CUDA graphs are captured again (SGLang's own `init_decode_cuda_graph`, which
its `update_weights_from_disk(recapture_cuda_graph=True)` uses) when the scales changed. A model
without a KV-cache quant method (BF16 checkpoints) gets its scale tensors here (1.0, SGLang's
default). q is not scaled by SGLang's FP8 KV cache: only k and v are calibrated.

The calibration requests are prefills of fixed sequences (rids marked by kv_front.py): while armed,
forward pre-hooks on the attention layers record the absmax of k and v over their tokens, and
prefills run without the prefill CUDA graph (a replayed graph would skip the hooks). A fresh engine
on the same weights runs the same sequences through the same kernels, so it gets the same scales.
"""

from __future__ import annotations

import logging
import time

import torch

from flashrl_tools.errors import FlashRLError

log = logging.getLogger("flashrl_tools.runtime")

REFERENCE_SCALE = 1.0  # k / v scales while calibrating (SGLang's default)
CALIBRATION_RID = "flashrl-kv-calibration-"  # + token + "-" + index; the last one is FINISH
FINISH = "finish"


def calibration_index(rid) -> str | None:
    """'0', '1', ... or FINISH for a calibration request's rid, None for any other request."""
    if not isinstance(rid, str) or not rid.startswith(CALIBRATION_RID):
        return None
    return rid.rsplit("-", 1)[-1]


def attention_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if type(m).__name__ == "RadixAttention"}


def uses_fp8_kv(runner) -> bool:
    return str(getattr(getattr(runner, "server_args", None), "kv_cache_dtype", "auto")).startswith("fp8")


class KVScales:
    """The scales of one scheduler process's model (one TP rank), kept for its current weights."""

    def __init__(self, runner, sync, checkpoint_scales: bool):
        self.runner, self.sync = runner, sync
        self.layers = attention_layers(runner.model)
        if not self.layers:
            raise FlashRLError("an FP8 KV cache was configured but the model has no SGLang RadixAttention layer",
                               None, "unset FLASHRL_KV_CACHE_DTYPE / kv_cache_dtype for this model")
        device = next(runner.model.parameters()).device
        for layer in self.layers.values():
            if getattr(layer, "k_scale", None) is None:  # no KV-cache quant method: the write would not scale
                layer.k_scale = torch.full((), REFERENCE_SCALE, dtype=torch.float32, device=device)
                layer.v_scale = torch.full((), REFERENCE_SCALE, dtype=torch.float32, device=device)
                layer.k_scale_float = layer.v_scale_float = REFERENCE_SCALE
        # checkpoint scales (compressed-tensors kv_cache_scheme) serve until the first sync
        self.calibrated_at: int | None = sync.state.completed if checkpoint_scales else None
        self.current = self.scales()  # the scales the captured graphs were built with
        self._absmax = None
        self._hooks: list = []
        self._prefill_graphs = None
        self.error: str | None = None  # why the last calibration failed

    @property
    def armed(self) -> bool:
        return self._absmax is not None

    def stale(self) -> bool:
        return self.calibrated_at != self.sync.state.completed

    def on_request(self, rid) -> str | None:
        """Called for every request the scheduler queues. Arms on a calibration's first sequence,
        finishes on its last; returns a reason to abort a rollout that would read stale scales."""
        index = calibration_index(rid)
        if index is None:
            if self.armed:  # the front end gave up on a calibration: back to the scales in use
                self.abandon()
            if self.stale():
                why = (f"the last calibration failed: {self.error}" if self.error else "the request did not pass "
                       "SGLang's TokenizerManager, where the runtime calibrates them after a sync")
                return f"flashrl: the FP8 KV scales are not calibrated for the current weights ({why})"
            return None
        if index == "0" and self.stale():
            self.arm()
        elif index == FINISH and self.armed:
            try:
                self.finish()
                self.error = None
            except Exception as e:  # raised here, it would end the scheduler: rollouts are refused instead
                self.error = f"{type(e).__name__}: {e}"
                log.exception("flashrl: FP8 KV calibration failed; rollouts are refused until one succeeds")
        return None

    def arm(self) -> None:
        from flashrl_tools.runtime.kv_calibration import AbsMax

        self._remove_hooks()
        self._absmax = AbsMax()
        for layer in self.layers.values():  # fixed scales while calibrating, whatever the last ones were
            set_kv_scales(layer, REFERENCE_SCALE, REFERENCE_SCALE)
        for name, layer in self.layers.items():
            def record(module, args, kwargs, name=name):
                q, k, v, batch = (list(args) + [kwargs.get(x) for x in ("q", "k", "v", "forward_batch")[len(args):]])[:4]
                n = _real_tokens(batch)  # rows past it are padding
                self._absmax.update(name, **{kind: t[:n] for kind, t in (("k", k), ("v", v)) if t is not None})
            self._hooks.append(layer.register_forward_pre_hook(record, with_kwargs=True))
        self._prefill_graphs, self.runner.prefill_cuda_graph_runner = \
            getattr(self.runner, "prefill_cuda_graph_runner", None), None

    def finish(self) -> dict[str, dict[str, float]]:
        t0 = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the hooks' maxima were computed on the forward stream
        scales = self._absmax.scales()
        self._disarm()
        if set(scales) != set(self.layers):
            self.abandon()
            raise RuntimeError(f"KV calibration saw {len(scales)} of {len(self.layers)} attention layers")
        for name, layer in self.layers.items():
            set_kv_scales(layer, **scales[name])
        recaptured = scales != self.current
        if recaptured:
            self._recapture()
        self.current, self.calibrated_at = scales, self.sync.state.completed
        log.info("flashrl: FP8 KV scales recalibrated for the current weights (%d layers, decode graphs %s, %.2f s)",
                 len(scales), "captured again" if recaptured else "unchanged", time.perf_counter() - t0)
        return scales

    def abandon(self) -> None:
        self._disarm()
        for name, layer in self.layers.items():
            set_kv_scales(layer, **self.current[name])

    def scales(self) -> dict[str, dict[str, float]]:
        return {name: {"k": float(layer.k_scale_float), "v": float(layer.v_scale_float)}
                for name, layer in self.layers.items()}

    def _disarm(self) -> None:
        self._remove_hooks()
        self._absmax = None
        if self._prefill_graphs is not None:
            self.runner.prefill_cuda_graph_runner, self._prefill_graphs = self._prefill_graphs, None

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _recapture(self) -> None:
        """The decode CUDA graphs hold the old floats as kernel arguments: capture them again."""
        if getattr(self.runner, "decode_cuda_graph_runner", None) is not None:
            self.runner.init_decode_cuda_graph()


def _real_tokens(batch) -> int | None:
    loc = getattr(batch, "out_cache_loc", None)  # one KV slot per real token
    return None if loc is None else int(loc.shape[0])


def set_kv_scales(layer, k: float, v: float) -> None:
    """In place (captured graphs keep the tensors' addresses), and the floats the kernels take."""
    with torch.no_grad():
        layer.k_scale.fill_(k)
        layer.v_scale.fill_(v)
    layer.k_scale_float, layer.v_scale_float = float(k), float(v)
