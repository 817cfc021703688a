"""FP8 KV cache, vLLM side: the scales are recalibrated for the weights the engine holds after every
complete sync (the math and the calibration data: runtime/kv_calibration.py). Front end (`LLM`,
`AsyncLLM`): run the fixed calibration sequences when the workers say their scales are stale. Worker
(`KVCalibrator`): record q/k/v absmax with forward pre-hooks while armed, then write the scales where
vLLM's attention reads them."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time

import torch

log = logging.getLogger("flashrl_tools.runtime")

REFERENCE_SCALE = 1.0  # q/k/v scales during a calibration pass
calibrating = threading.local()
calibrating.active = False
calibrating_task: contextvars.ContextVar[bool] = contextvars.ContextVar("flashrl_kv_calibrating", default=False)


def calibrate_kv_if_stale(llm) -> dict | None:
    """Front end of `vllm.LLM`, before new requests are added: when the workers' KV scales are not
    those of their current weights (a sync completed since, or never calibrated), run the
    calibration sequences through the idle engine and let the workers set the scales from them
    (runtime/kv_calibration.py). One sequence per engine step, so the batches (and with them the
    kernels' results) are the same whatever the engine's API or timing. The prefix cache is reset
    before (blocks computed by the old weights are stale anyway) and after (the calibration's
    blocks hold the old scales)."""
    if not any(llm.collective_rpc("flashrl_kv_stale")):
        return None
    from vllm import SamplingParams

    t0 = time.perf_counter()
    sequences = _calibration_inputs(llm.get_tokenizer, llm.llm_engine.model_config)
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    llm.reset_prefix_cache()
    llm.collective_rpc("flashrl_kv_arm")
    calibrating.active = True
    try:
        for s in sequences:
            llm.generate([{"prompt_token_ids": s}], params, use_tqdm=False)
    finally:
        calibrating.active = False
        scales = llm.collective_rpc("flashrl_kv_finish")
        llm.reset_prefix_cache()
    log.info("flashrl: FP8 KV scales recalibrated for the current weights (%d sequences, %.2f s)",
             len(sequences), time.perf_counter() - t0)
    return scales[0]


async def calibrate_kv_if_stale_async(engine) -> dict | None:
    """`calibrate_kv_if_stale` for vLLM's AsyncLLM. Requests arriving meanwhile wait on a lock; the
    calibration starts once the requests already in flight have finished (they would otherwise
    run with the calibration's reference scales and add their q/k/v to its maxima)."""
    if not any(await engine.collective_rpc("flashrl_kv_stale")):
        return None
    lock = engine.__dict__.setdefault("_flashrl_kv_lock", asyncio.Lock())
    async with lock:
        if not any(await engine.collective_rpc("flashrl_kv_stale")):
            return None  # calibrated by the request that held the lock before this one
        from vllm import SamplingParams

        t0 = time.perf_counter()
        while engine.output_processor.get_num_unfinished_requests():
            await asyncio.sleep(0.005)
        sequences = _calibration_inputs(lambda: engine.tokenizer, engine.model_config)
        params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
        await engine.reset_prefix_cache()
        await engine.collective_rpc("flashrl_kv_arm")
        token = calibrating_task.set(True)
        try:
            for i, s in enumerate(sequences):
                async for _ in engine.generate({"prompt_token_ids": s}, params, f"flashrl-kv-calibration-{t0}-{i}"):
                    pass
        finally:
            calibrating_task.reset(token)
            scales = await engine.collective_rpc("flashrl_kv_finish")
            await engine.reset_prefix_cache()
    log.info("flashrl: FP8 KV scales recalibrated for the current weights (%d sequences, %.2f s, async engine)",
             len(sequences), time.perf_counter() - t0)
    return scales[0]


def _calibration_inputs(get_tokenizer, model_config) -> list[list[int]]:
    """The fixed calibration token ids, each short enough for the engine (prompt + 1 token)."""
    from flashrl_tools.runtime.kv_calibration import calibration_sequences

    try:
        tokenizer = get_tokenizer()
    except ValueError:  # skip_tokenizer_init=True: fixed token ids instead of the built-in prompts
        tokenizer = None
    room = model_config.max_model_len - 1
    return [s[:room] for s in calibration_sequences(tokenizer, model_config.get_vocab_size())]


class KVCalibrator:
    """Worker side of the recalibration. While armed, forward pre-hooks on the attention layers
    record q/k/v absmax and the model runs eagerly (a compiled graph or a CUDA graph would skip
    the hooks); `finish` writes the scales where vLLM's attention reads them (the tensors, read
    inside CUDA graphs, are updated in place; their float copies too)."""

    def __init__(self, model: torch.nn.Module, sync, checkpoint_scales: bool):
        self.model, self.sync = model, sync
        self.layers = _fp8_kv_layers(model)
        if not self.layers:
            from flashrl_tools.errors import FlashRLError

            raise FlashRLError("an FP8 KV cache was configured but no attention layer of the model uses one",
                               None, "this model's attention is not supported with kv_cache_dtype fp8; unset it")
        # checkpoint scales (compressed-tensors kv_cache_scheme) serve until the first sync
        self.calibrated_at: int | None = sync.completed if checkpoint_scales else None
        self.current = self.scales() if checkpoint_scales else None  # the scales the layers should hold
        self._hooks: list = []
        self._absmax = None
        self._eager: list[torch.nn.Module] = []

    def stale(self) -> bool:
        return self.calibrated_at != self.sync.completed

    def arm(self, runner) -> int:
        from flashrl_tools.runtime.kv_calibration import AbsMax

        self._absmax = AbsMax()
        # The calibration's own attention reads the FP8 cache: run it with fixed scales (vLLM's
        # default, 1.0), not whatever the last calibration left, so its outcome depends on the
        # weights alone (measured: int8 on CPU, calibrating with the old scales moved layer 1).
        for layer in self.layers.values():
            set_kv_scales(layer, *(REFERENCE_SCALE,) * 3)
        for name, layer in self.layers.items():
            def record(module, args, kwargs, name=name):
                qkv = (list(args) + [kwargs.get(x) for x in ("query", "key", "value")[len(args):]])[:3]
                n = _real_tokens(module)  # rows past it are padding (stale buffer contents)
                self._absmax.update(name, **{kind: t[:n] for kind, t in zip("qkv", qkv) if t is not None})
            self._hooks.append(layer.register_forward_pre_hook(record, with_kwargs=True))
        # torch.compile'd modules (vLLM's support_torch_compile) run their python forward for now
        self._eager = [m for m in self.model.modules() if getattr(m, "do_not_compile", True) is False]
        for m in self._eager:
            m.do_not_compile = True
        if hasattr(runner, "calculate_kv_scales"):  # vLLM <= 0.31: next step without CUDA graphs
            runner.calculate_kv_scales = True
        return len(self._hooks)

    def finish(self) -> dict[str, dict[str, float]]:
        for h in self._hooks:
            h.remove()
        for m in self._eager:
            m.do_not_compile = False
        self._hooks, self._eager = [], []
        scales = self._absmax.scales() if self._absmax is not None else {}
        self._absmax = None
        if set(scales) != set(self.layers):
            raise RuntimeError(f"KV calibration saw {len(scales)} of {len(self.layers)} attention layers")
        for name, layer in self.layers.items():
            set_kv_scales(layer, **scales[name])
        self.calibrated_at, self.current = self.sync.completed, scales
        return scales

    def reapply(self) -> None:
        """Write the current scales again (vLLM's V1 runner resets them to 1.0 when the KV cache
        wakes from sleep)."""
        if self.current is not None:
            for name, layer in self.layers.items():
                set_kv_scales(layer, **self.current[name])

    def scales(self) -> dict[str, dict[str, float]]:
        return {name: {"q": float(layer._q_scale), "k": float(layer._k_scale), "v": float(layer._v_scale)}
                for name, layer in self.layers.items()}


def _real_tokens(layer) -> int | None:
    """Tokens of this forward without padding, from the layer's attention metadata."""
    from vllm.forward_context import get_forward_context

    meta = get_forward_context().attn_metadata
    meta = meta.get(layer.layer_name) if isinstance(meta, dict) else None
    return getattr(meta, "num_actual_tokens", None)


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


def _attention_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    try:
        from vllm.model_executor.layers.attention.attention import Attention
    except ImportError:  # older layout
        from vllm.attention.layer import Attention
    return {name: m for name, m in model.named_modules() if type(m) is Attention}


def _fp8_kv_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in _attention_layers(model).items()
            if str(getattr(m, "kv_cache_dtype", "auto")).startswith("fp8")}


def default_attention_scales(model: torch.nn.Module) -> int:
    """Give every attention layer the scales a checkpoint without attention scales loads (vLLM's
    `set_default_quant_scales`: q, k, v and prob scales 1.0), in place (captured CUDA graphs keep
    the addresses). For engines started with `load_format="dummy"` (verl's rollout: it waits for
    the trainer's weights): the dummy loader fills every buffer with its seeded random values
    (-0.00075 in every layer on the H100) and no trainer pushes attention scales, so without this
    they would stay random for the engine's life (unused with a BF16 KV cache; an FP8 KV cache is
    recalibrated after the sync). Returns the number of layers set."""
    layers = _attention_layers(model)
    for layer in layers.values():
        set_kv_scales(layer, 1.0, 1.0, 1.0)
        if hasattr(layer, "_prob_scale"):
            with torch.no_grad():
                layer._prob_scale.fill_(1.0)
            layer._prob_scale_float = 1.0
    return len(layers)


def calibrator(worker) -> KVCalibrator:
    kv = getattr(worker.model_runner.model, "flashrl_kv", None)
    if kv is None:
        raise RuntimeError("flashrl: this engine has no FP8 KV cache to calibrate")
    return kv
