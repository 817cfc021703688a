"""vLLM's front end: where requests enter (`LLM`, `AsyncLLM`), and the workers' named methods the front
end asks through `collective_rpc` (names, not callables: those need VLLM_ALLOW_INSECURE_SERIALIZATION
across processes). Admission (core/admission.py): refused in the caller while any worker's weights are
incomplete -- the model's own refusal would kill a multiprocess engine core. FP8 KV cache: the core's
calibration driver (core/kv_driver.py) runs before the first request after a sync, through `LLMFront`
below (`AsyncLLM`'s front end, pause and resume: async_front.py)."""

from __future__ import annotations

from flashrl_tools.runtime.core.admission import admit
from flashrl_tools.runtime.core.adapter import KVFront
from flashrl_tools.runtime.core.kv_driver import NoLock, calibrate, calibrating, run_sync
from flashrl_tools.runtime.core.kv_math import calibration_inputs, is_fp8_kv


# -- worker methods (collective_rpc by name) ----------------------------------------------------

def _model(worker):
    return worker.model_runner.model


def _kv(worker):
    kv = getattr(_model(worker), "flashrl_kv", None)
    if kv is None:
        raise RuntimeError("flashrl: this engine has no FP8 KV cache to calibrate")
    return kv


def sync_status(worker) -> str | None:
    """The sync state of the worker's model (None: one complete set of weights)."""
    session = getattr(_model(worker), "flashrl_sync", None)
    return None if session is None else session.status()


def inplace_layers(worker) -> dict[str, int]:
    """How many linear layers sync in place, per processed layout."""
    session = getattr(_model(worker), "flashrl_sync", None)
    return {} if session is None else dict(session.writer.inplace.kinds)


def kv_stale(worker) -> bool:
    return _kv(worker).stale()


def kv_arm(worker) -> int:
    kv = _kv(worker)
    kv.kv.runner = worker.model_runner
    return kv.arm()


def kv_finish(worker, kept: list[list[int]] | None = None) -> dict:
    """Write the calibrated scales; `kept`: block ids (per KV-cache group) of requests kept in flight."""
    kv = _kv(worker)
    kv.kv.runner = worker.model_runner
    return kv.finish(kept)


def kv_rescalable(worker) -> str | None:
    """Why kept FP8 KV entries cannot be rescaled on this worker (None: they can)."""
    return _kv(worker).kv.rescalable()


def version(worker) -> int:
    """How many syncs the worker's model completed (the prefix-cache salt of new requests)."""
    from flashrl_tools.runtime.core.inflight import weights_version

    session = getattr(_model(worker), "flashrl_sync", None)
    return weights_version([] if session is None else [session])


def kv_abandon(worker) -> None:
    _kv(worker).abandon()


def kv_scales(worker) -> dict:
    return _kv(worker).scales()


def digest(worker) -> dict[str, str]:
    """The worker's weight digest (core/digest.py): compare a synced engine with a fresh one."""
    from flashrl_tools.runtime.core.digest import model_digest

    return model_digest(_model(worker), "vllm")


def small_values(worker) -> dict[str, list[float]]:
    from flashrl_tools.runtime.core.digest import small_values as values

    return values(_model(worker), "vllm")


def discard(worker, reason: str = "discarded by the caller") -> None:
    """What vLLM's sleep(level=2) does to the weights, for engines without sleep mode (CPU tests)."""
    _model(worker).flashrl_sync.discard(reason)


WORKER_METHODS = {f"flashrl_{f.__name__}": f for f in (sync_status, inplace_layers, kv_stale, kv_arm, kv_finish,
                                                       kv_rescalable, kv_abandon, kv_scales, version, digest,
                                                       small_values, discard)}


# -- the synchronous front end: vllm.LLM ------------------------------------------------------

class LLMFront(KVFront):
    """`KVFront` of `vllm.LLM` (no request runs while one is added: no step ever waits)."""

    def __init__(self, llm):
        self.llm = llm

    def lock(self):
        return NoLock()

    def aside(self):
        return NoLock()  # no request is in flight while `LLM` adds requests

    async def stale(self) -> bool:
        return any(self.llm.collective_rpc("flashrl_kv_stale"))

    async def in_flight(self) -> int:
        return 0

    async def flush(self) -> bool:
        self.llm.reset_prefix_cache()  # blocks of the old weights / the reference scales
        return True

    def sequences(self) -> list[list[int]]:
        try:
            tokenizer = self.llm.get_tokenizer()
        except ValueError:  # skip_tokenizer_init=True: seeded token ids instead of the built-in prompts
            tokenizer = None
        config = self.llm.llm_engine.model_config
        return calibration_inputs(tokenizer, config.get_vocab_size(), config.max_model_len)

    async def arm(self) -> None:
        self.llm.collective_rpc("flashrl_kv_arm")

    async def prefill(self, ids: list[int], rid: str) -> bool:
        from vllm import SamplingParams

        self.llm.generate([calibration_prompt(ids, rid)], SamplingParams(temperature=0.0, max_tokens=1,
                                                                           detokenize=False), use_tqdm=False)
        return True

    async def write_scales(self, token: str, rescale: bool) -> bool:
        self.llm.collective_rpc("flashrl_kv_finish")
        return True

    async def abandon(self, token: str, rescale: bool) -> None:
        self.llm.collective_rpc("flashrl_kv_abandon")

    def calibrated(self) -> None:
        pass


def add_requests(llm, *args, **kwargs) -> None:
    """BEFORE the method `LLM` adds requests with (0.26: `_render_and_add_requests`, 0.32:
    `_validate_and_add_requests`): refuse while a sync is incomplete; calibrate stale FP8 KV scales."""
    if calibrating():
        return
    admit(llm.collective_rpc("flashrl_sync_status"))
    if is_fp8_kv(llm.llm_engine.vllm_config.cache_config.cache_dtype):
        run_sync(calibrate(LLMFront(llm)))


def calibration_prompt(ids: list[int], rid: str) -> dict:
    """A calibration sequence with a salt of its own: it never reuses a cached block (an earlier
    calibration's, or a kept request's), as on a fresh engine."""
    return {"prompt_token_ids": ids, "cache_salt": f"flashrl-{rid}"}
