"""FP8 KV cache, vLLM worker side: where vLLM's attention layers keep their scales (the core's
`KVScaleState` decides when and what to write: core/kv_state.py). vLLM's FP8 cache scales q, k and v:
the tensors `_q_scale` / `_k_scale` / `_v_scale` (read inside CUDA graphs: written in place), their
float copies (`_k_scale_float`, ...) and, on CPU, `_k_scale_cpu` / `_v_scale_cpu`. Requests kept across
an update: `kv_halves` says where each attention backend keeps K and V in its cache tensor, and
`rescale` re-encodes them (core/kv_math.py `rescale_fp8_`)."""

from __future__ import annotations

import torch


def attention_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    try:
        from vllm.model_executor.layers.attention.attention import Attention
    except ImportError:  # older layout
        from vllm.attention.layer import Attention
    return {name: m for name, m in model.named_modules() if type(m) is Attention}


class AttentionScales:
    """`KVLayers` of a vLLM model: its attention layers with an FP8 KV cache."""

    kinds = ("q", "k", "v")

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.layers = {name: m for name, m in attention_layers(model).items()
                       if str(getattr(m, "kv_cache_dtype", "auto")).startswith("fp8")}
        self.runner = None  # the worker's model runner (set by the arm RPC)
        self._compiled: list[torch.nn.Module] = []

    def read(self, layer) -> dict[str, float]:
        return {"q": float(layer._q_scale), "k": float(layer._k_scale), "v": float(layer._v_scale)}

    def write(self, layer, scales: dict[str, float]) -> None:
        set_kv_scales(layer, scales["q"], scales["k"], scales["v"])

    def inputs(self, layer, args, kwargs) -> dict[str, torch.Tensor]:
        from vllm.forward_context import get_forward_context

        qkv = (list(args) + [kwargs.get(x) for x in ("query", "key", "value")[len(args):]])[:3]
        meta = get_forward_context().attn_metadata
        meta = meta.get(layer.layer_name) if isinstance(meta, dict) else None
        n = getattr(meta, "num_actual_tokens", None)  # rows past it are padding (stale buffer contents)
        return {kind: t[:n] for kind, t in zip("qkv", qkv) if t is not None}

    def eager(self, on: bool) -> None:
        """torch.compile'd modules (vLLM's support_torch_compile) run their python forward; vLLM <= 0.31
        runs the next step without CUDA graphs (`calculate_kv_scales`)."""
        if on:
            self._compiled = [m for m in self.model.modules() if getattr(m, "do_not_compile", True) is False]
            for m in self._compiled:
                m.do_not_compile = True
            if self.runner is not None and hasattr(self.runner, "calculate_kv_scales"):
                self.runner.calculate_kv_scales = True
        else:
            for m in self._compiled:
                m.do_not_compile = False
            self._compiled = []

    def changed(self) -> None:
        """Nothing to do: vLLM's kernels read the scale tensors, also inside captured graphs."""

    def rescalable(self) -> str | None:
        """Why the kept entries cannot be rescaled on this engine (None: they can)."""
        for layer in self.layers.values():
            try:
                kv_halves(layer)
            except NotImplementedError as e:
                return str(e)
        return None

    def rescale(self, layer, old: dict[str, float], new: dict[str, float], kept: list[list[int]]) -> None:
        """`kept`: block ids per KV-cache group (the engine core's `hold`); this layer's group's."""
        from flashrl_tools.runtime.core.kv_math import rescale_fp8_

        groups = self.runner.kv_cache_config.kv_cache_groups
        group = next(i for i, g in enumerate(groups) if layer.layer_name in g.layer_names)
        if kept[group]:
            for kind, half in zip("kv", kv_halves(layer)):
                rescale_fp8_(half, old[kind], new[kind], kept[group])


def kv_halves(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V entries of an attention layer's FP8 cache, as FP8 views of the engine's tensor.
    vLLM 0.26's GPU backends (FLASH_ATTN, FLASHINFER, TRITON_ATTN) pack K and V in the content dim,
    (blocks, heads, block size, 2 x head size): K is the first head size. vLLM-CPU's CPU_ATTN has the
    same shape but packs per block and head: the first block size x head size values are K. Older
    layouts keep K and V on a dim of their own, (2, blocks, ...) or (blocks, 2, ...)."""
    cache = layer.kv_cache
    cache = cache[0] if isinstance(cache, (list, tuple)) else cache
    name = layer.attn_backend.get_name() if hasattr(layer, "attn_backend") else "?"
    if cache.numel() == 0:
        raise NotImplementedError(f"flashrl: attention backend {name} has no KV cache tensor bound to the layer")
    if cache.dtype == torch.uint8:  # vLLM allocates FP8 caches as bytes; its kernels view them
        e5m2 = str(getattr(layer, "kv_cache_dtype", "fp8")).endswith("e5m2")
        cache = cache.view(torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn)
    d = layer.head_size
    if name == "CPU_ATTN" and cache.dim() == 4:
        return tuple(cache.view(cache.shape[0], cache.shape[1], 2, -1).unbind(2))
    if cache.dim() == 4 and cache.shape[-1] == 2 * d and name in PACKED_BACKENDS:
        return cache[..., :d], cache[..., d:]
    if cache.dim() == 5 and 2 in cache.shape[:2]:
        return tuple(cache.unbind(cache.shape[:2].index(2)))
    raise NotImplementedError(f"flashrl: the KV-cache layout of attention backend {name} {tuple(cache.shape)} is "
                              "not known to the runtime's rescale")


PACKED_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")


def set_kv_scales(layer, q: float, k: float, v: float) -> None:
    """What vLLM's own `Attention.calc_kv_scales` sets (0.26), with our values. Under no_grad:
    vLLM 0.26's compressed-tensors KV method makes the scales `nn.Parameter`s that require grad
    (shape [1]), which an in-place copy outside no_grad refuses (measured on the H100)."""
    with torch.no_grad():
        layer._q_scale.copy_(q)
        layer._k_scale.copy_(k)
        layer._v_scale.copy_(v)
        for attr, value in (("_k_scale_cpu", k), ("_v_scale_cpu", v)):
            if hasattr(layer, attr):
                getattr(layer, attr).fill_(value)
    layer._q_scale_float, layer._k_scale_float, layer._v_scale_float = q, k, v


def default_attention_scales(model: torch.nn.Module) -> int:
    """Give every attention layer the scales a checkpoint without attention scales loads (vLLM's
    `set_default_quant_scales`: q, k, v and prob scales 1.0), in place (captured CUDA graphs keep
    the addresses). For engines started with `load_format="dummy"` (verl's rollout: it waits for
    the trainer's weights): the dummy loader fills every buffer with its seeded random values
    (-0.00075 in every layer on the H100) and no trainer pushes attention scales, so without this
    they would stay random for the engine's life (unused with a BF16 KV cache; an FP8 KV cache is
    recalibrated after the sync). Returns the number of layers set."""
    layers = attention_layers(model)
    for layer in layers.values():
        set_kv_scales(layer, 1.0, 1.0, 1.0)
        if hasattr(layer, "_prob_scale"):
            with torch.no_grad():
                layer._prob_scale.fill_(1.0)
            layer._prob_scale_float = 1.0
    return len(layers)
