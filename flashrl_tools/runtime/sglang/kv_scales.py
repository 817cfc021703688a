"""FP8 KV cache, SGLang scheduler side: where SGLang's attention keeps its scales (the core's
`KVScaleState` decides when and what to write: core/kv_state.py).

Where SGLang 0.5.17 reads the scales (`RadixAttention`, Triton backend): the cache write divides k / v
by the tensors `layer.k_scale` / `v_scale` (read from memory, also inside CUDA graphs), the attention
kernels multiply by the Python floats `layer.k_scale_float` / `v_scale_float` -- kernel arguments,
baked into a captured decode graph (flashinfer's too). So new scales are written in place into the
tensors, the floats are set, and the decode CUDA graphs are captured again (SGLang's own
`init_decode_cuda_graph`, which its `update_weights_from_disk(recapture_cuda_graph=True)` uses) when the
scales changed -- except where the decode backend reads the scale tensors themselves (`fa3`:
`layer.k_scale.expand(...)` as the kernel's descale, a view the captured graph reads at replay). A model
without a KV-cache quant method (BF16 checkpoints) gets its scale tensors here (1.0, SGLang's
default). q is not scaled by SGLang's FP8 KV cache: only k and v are calibrated. While calibrating,
prefills run without the prefill CUDA graph (a replayed graph would skip the hooks). Requests kept in
place across an update hold entries of the old scales in the token-indexed pool (`token_to_kv_pool`,
FP8 stored as bytes): their slots are re-encoded for the new scales (kv_math.rescale_fp8_)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flashrl_tools.runtime.core.kv_math import is_fp8_kv, rescale_fp8_
from flashrl_tools.runtime.core.kv_state import REFERENCE_SCALE

if TYPE_CHECKING:  # the engine objects read here (by their attributes: nothing of SGLang is imported at run time)
    from sglang.srt.model_executor.model_runner import ModelRunner


def uses_fp8_kv(runner: ModelRunner) -> bool:
    return is_fp8_kv(getattr(getattr(runner, "server_args", None), "kv_cache_dtype", "auto"))


class RadixAttentionScales:
    """`KVLayers` of one SGLang model runner (one TP rank)."""

    kinds = ("k", "v")

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.layers = {name: m for name, m in runner.model.named_modules() if type(m).__name__ == "RadixAttention"}
        device = next(runner.model.parameters()).device
        for layer in self.layers.values():
            if getattr(layer, "k_scale", None) is None:  # no KV-cache quant method: the write would not scale
                layer.k_scale = torch.full((), REFERENCE_SCALE, dtype=torch.float32, device=device)
                layer.v_scale = torch.full((), REFERENCE_SCALE, dtype=torch.float32, device=device)
                layer.k_scale_float = layer.v_scale_float = REFERENCE_SCALE
        self._prefill_graphs = None

    def read(self, layer) -> dict[str, float]:
        return {"k": float(layer.k_scale_float), "v": float(layer.v_scale_float)}

    def write(self, layer, scales: dict[str, float]) -> None:
        """In place (captured graphs keep the tensors' addresses), and the floats the kernels take."""
        with torch.no_grad():
            layer.k_scale.fill_(scales["k"])
            layer.v_scale.fill_(scales["v"])
        layer.k_scale_float, layer.v_scale_float = float(scales["k"]), float(scales["v"])

    def inputs(self, layer, args, kwargs) -> dict[str, torch.Tensor]:
        _, k, v, batch = (list(args) + [kwargs.get(x) for x in ("q", "k", "v", "forward_batch")[len(args):]])[:4]
        loc = getattr(batch, "out_cache_loc", None)  # one KV slot per real token: rows past it are padding
        n = None if loc is None else int(loc.shape[0])
        return {kind: t[:n] for kind, t in (("k", k), ("v", v)) if t is not None}

    def eager(self, on: bool) -> None:
        if on and self._prefill_graphs is None:
            self._prefill_graphs = getattr(self.runner, "prefill_cuda_graph_runner", None)
            self.runner.prefill_cuda_graph_runner = None
        elif not on and self._prefill_graphs is not None:
            self.runner.prefill_cuda_graph_runner, self._prefill_graphs = self._prefill_graphs, None

    def rescale(self, layer, old: dict[str, float], new: dict[str, float], kept) -> None:
        """`kept`: the KV-pool slots (token rows) of the requests kept in place (pause.kept_slots)."""
        pool = self.runner.token_to_kv_pool
        rescale_fp8_(pool.get_key_buffer(layer.layer_id), old["k"], new["k"], rows=kept)
        rescale_fp8_(pool.get_value_buffer(layer.layer_id), old["v"], new["v"], rows=kept)

    def changed(self) -> None:
        """The decode CUDA graphs hold the old floats as kernel arguments: capture them again (not where the
        decode kernels read the scale tensors, written in place)."""
        if getattr(self.runner, "decode_cuda_graph_runner", None) is None:
            return
        if decode_backend(self.runner) in TENSOR_SCALE_BACKENDS:
            return
        self.runner.init_decode_cuda_graph()


TENSOR_SCALE_BACKENDS = frozenset({"fa3"})  # SGLang 0.5.17 decode backends that read layer.k_scale / v_scale


def decode_backend(runner: ModelRunner) -> str | None:
    """The attention backend SGLang decodes with (its own rule: decode_attention_backend, else attention_backend)."""
    args = getattr(runner, "server_args", None)
    if hasattr(args, "get_attention_backends"):
        return args.get_attention_backends()[1]
    return getattr(args, "decode_attention_backend", None) or getattr(args, "attention_backend", None)
