"""The SGLang coupling's pure parts (issue 32; SGLang has no CPU backend installable here: the engine
checks run on the GPU). What is tested: the plugin registers its hooks (or only the one that raises
an invalid config where SGLang does not swallow it), the server args a config sets and refuses, and
the weight sync on a stand-in of SGLang's layers -- a compressed-tensors W8A8 layer whose processing
replaces `weight` by its transpose and `weight_scale` by a new Parameter over the same storage, and a
`load_weights` that, like SGLang's models, maps checkpoint names onto fused parameters and needs each
parameter's `weight_loader` (a second load crashes without the runtime)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flashrl_tools.config.resolve import resolve
from flashrl_tools.config.schema import ConfigFn
from flashrl_tools.errors import FlashRLError
from flashrl_tools.quantizer import QuantFn, quantize_weight
from flashrl_tools.runtime.convert import WeightConverter
from flashrl_tools.runtime.sglang import plugin
from flashrl_tools.runtime.sglang.server_args import apply_overrides
from flashrl_tools.runtime.sglang.weight_sync import LoadedParams, WeightSync


class Registry:
    def __init__(self):
        self.hooks = []

    def register(self, target, hook, kind):
        self.hooks.append((target, hook, kind))


Kinds = SimpleNamespace(BEFORE="before", AFTER="after", AROUND="around", REPLACE="replace")


@pytest.fixture(autouse=True)
def _fresh_plugin_state():
    plugin._state.clear()
    yield
    plugin._state.clear()


def test_plugin_changes_nothing_without_a_config(monkeypatch):
    monkeypatch.delenv("FLASHRL_CONFIG", raising=False)
    monkeypatch.delenv("FLASHRL_KV_CACHE_DTYPE", raising=False)
    reg = Registry()
    plugin.register(reg, Kinds)
    assert [t for t, _, _ in reg.hooks] == [plugin.HOOKS[0][1], plugin.HOOKS[1][1]]  # the server-args hooks only
    args = _args("some/model")
    reg.hooks[0][1](args)
    assert vars(args) == vars(_args("some/model"))


def test_an_engine_whose_config_changed_after_the_plugins_loaded_is_refused(monkeypatch):
    """SGLang loads plugins once per process: a second engine started there after FLASHRL_CONFIG changed
    would run with the first one's state (on the H100 it hung): it is refused at start instead."""
    monkeypatch.delenv("FLASHRL_CONFIG", raising=False)
    monkeypatch.delenv("FLASHRL_KV_CACHE_DTYPE", raising=False)
    reg = Registry()
    plugin.register(reg, Kinds)
    monkeypatch.setenv("FLASHRL_CONFIG", "int8")
    with pytest.raises(RuntimeError, match="were \\(None, None\\) when SGLang loaded its plugins"):
        reg.hooks[0][1](_args("some/model"))


def test_plugin_registers_its_hook_table(monkeypatch):
    monkeypatch.setenv("FLASHRL_CONFIG", "int8")
    reg = Registry()
    plugin.register(reg, Kinds)
    assert [(t, k) for t, _, k in reg.hooks] == [(t, getattr(Kinds, k)) for _, t, _, k in plugin.HOOKS]
    assert all(t.startswith("sglang.srt.") for t, _, _ in reg.hooks)


def test_an_invalid_config_is_raised_by_the_server_args_hook(monkeypatch):
    """SGLang only logs a plugin's exception: the engine must still refuse to start."""
    monkeypatch.setenv("FLASHRL_CONFIG", "int9")
    reg = Registry()
    plugin.register(reg, Kinds)  # does not raise
    assert [t for t, _, _ in reg.hooks] == [plugin.HOOKS[0][1], plugin.HOOKS[1][1]]
    with pytest.raises(RuntimeError, match="flashrl: .*int9"):
        reg.hooks[0][1](SimpleNamespace(model_path="x", tokenizer_path=None, quantization=None, load_format="auto"))


def _args(model, **kw):
    return SimpleNamespace(**{"model_path": str(model), "tokenizer_path": None, "quantization": None,
                              "load_format": "auto", **kw})


class ResolvedArgs(SimpleNamespace):
    """SGLang 0.5.17's ServerArgs after __post_init__ (server_args.py `__setattr__` / `override`): a bare
    assignment to a field raises, `override(source, **fields)` is the one way to change it."""

    def __setattr__(self, name, value):
        frozen = vars(self).get("_declarations_materialized") and not vars(self).get("_in_override")
        if frozen and not name.startswith("_"):
            raise AttributeError(f"server_args.{name} assigned after resolution; server_args is read-only")
        super().__setattr__(name, value)

    def override(self, source, **fields):
        object.__setattr__(self, "_in_override", True)
        try:
            for name, value in fields.items():
                setattr(self, name, value)
        finally:
            object.__setattr__(self, "_in_override", False)


@pytest.mark.parametrize("config, fmt", [("int8", QuantFn.int8), ("fp8", QuantFn.fp8_channel)])
def test_server_args_serve_the_configs_checkpoint(default_model, monkeypatch, tmp_path, config, fmt):
    from flashrl_tools.runtime.convert import served_format

    monkeypatch.setenv("FLASHRL_HOME", str(tmp_path))
    args = _args(default_model)
    changed = apply_overrides(resolve(config), args)
    assert args.tokenizer_path == str(default_model) and args.model_path != str(default_model)
    assert set(changed) == {"model_path", "tokenizer_path"}
    assert served_format(__import__("pathlib").Path(args.model_path)) is fmt
    bf16 = _args(default_model)
    assert apply_overrides(resolve("bf16"), bf16) == {} and bf16.model_path == str(default_model)


def test_server_args_built_before_the_plugins_loaded_are_changed_once(default_model, monkeypatch, tmp_path):
    """verl's SGLang server builds ServerArgs itself, then SGLang loads the plugins (in
    Engine._launch_subprocesses) and calls check_server_args: the config applies there, and only once
    (an Engine's ServerArgs already changed before __post_init__ is left alone)."""
    monkeypatch.setenv("FLASHRL_HOME", str(tmp_path))
    monkeypatch.setenv("FLASHRL_CONFIG", "int8")
    plugin._state.clear()
    plugin.register(Registry(), Kinds)
    late = dict((name, hook) for name, _, hook, _ in plugin.HOOKS)["late_server_args"]
    # after __post_init__: tokenizer set, fields read-only (a bare assignment raised on the H100)
    args = ResolvedArgs(**vars(_args(default_model, tokenizer_path=str(default_model))))
    object.__setattr__(args, "_declarations_materialized", True)
    late(args)
    served = args.model_path
    assert served != str(default_model) and args.tokenizer_path == str(default_model)
    late(args)
    plugin.server_args(args)
    assert args.model_path == served


@pytest.mark.parametrize("config, setup, match", [
    ("fp8_tensor.yaml", {}, "not served on SGLang"),
    ("int8", {"quantization": "fp8"}, "conflicts with FLASHRL_CONFIG"),
    ("int8", {"load_format": "flash_rl"}, "would both quantize"),
])
def test_server_args_refusals(default_model, tmp_path, config, setup, match):
    if config.endswith(".yaml"):
        (tmp_path / config).write_text(f"version: 1\nconfigs:\n- fn: {config.removesuffix('.yaml')}\n")
        config = str(tmp_path / config)
    with pytest.raises(FlashRLError, match=match):
        apply_overrides(resolve(config), _args(default_model, **setup))


def test_int8_moe_is_refused_and_fp8_moe_served(tmp_path, monkeypatch):
    """SGLang 0.5.17's compressed-tensors INT8 MoE scheme is NPU-only; per-channel FP8 experts load
    (and keep their storage: no processing on CUDA without aiter)."""
    from conftest import run_cli

    moe = tmp_path / "moe"
    assert run_cli("models", "tiny", "--arch", "qwen3_moe", "-o", moe).returncode == 0
    with pytest.raises(FlashRLError, match="INT8 MoE experts on NPU only"):
        apply_overrides(resolve("int8"), _args(moe))
    monkeypatch.setenv("FLASHRL_HOME", str(tmp_path / "home"))
    args = _args(moe)
    apply_overrides(resolve("fp8"), args)
    assert args.model_path != str(moe) and args.tokenizer_path == str(moe)


def test_fp8_kv_cache_server_args(default_model, monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHRL_HOME", str(tmp_path))
    monkeypatch.setenv("FLASHRL_KV_CACHE_DTYPE", "fp8")
    args = _args(default_model, kv_cache_dtype="auto")
    assert set(apply_overrides(resolve("int8"), args)) == {"model_path", "tokenizer_path", "kv_cache_dtype"}
    assert args.kv_cache_dtype == "fp8_e4m3" and args.model_path != str(default_model)
    bf16 = _args(default_model, kv_cache_dtype="fp8_e4m3")  # the caller's own matching choice is fine
    assert apply_overrides(resolve("bf16"), bf16) == {"kv_cache_dtype": "fp8_e4m3"}
    with pytest.raises(FlashRLError, match="kv_cache_dtype='fp8_e5m2' passed to SGLang conflicts"):
        apply_overrides(resolve("int8"), _args(default_model, kv_cache_dtype="fp8_e5m2"))


# -- a stand-in of SGLang's compressed-tensors W8A8 linear layers and model loader ----------------

def _loader(shard_offsets):
    """SGLang-style weight_loader: writes a checkpoint shard into rows of the fused parameter."""
    def weight_loader(param, loaded, shard=None):
        start, rows = shard_offsets[shard] if shard is not None else (0, param.shape[0])
        param.data[start:start + rows].copy_(loaded)
    return weight_loader


class W8A8Layer(torch.nn.Module):
    def __init__(self, shards: dict[str, int], cols: int):
        super().__init__()
        offsets, at = {}, 0
        for name, rows in shards.items():
            offsets[name], at = (at, rows), at + rows
        self.weight = torch.nn.Parameter(torch.zeros(at, cols, dtype=torch.int8), requires_grad=False)
        self.weight_scale = torch.nn.Parameter(torch.zeros(at, 1), requires_grad=False)
        for p in (self.weight, self.weight_scale):
            p.weight_loader = _loader(offsets)


class ChannelMethod:
    """compressed_tensors_w8a8_int8.py, CHANNEL strategy: transposed view, scale over its storage."""

    def process_weights_after_loading(self, layer):
        weight, scale = layer.weight, layer.weight_scale.data
        layer.weight = torch.nn.Parameter(weight.t(), requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)


class CopyingMethod:
    def process_weights_after_loading(self, layer):
        layer.weight = torch.nn.Parameter(layer.weight.t().contiguous(), requires_grad=False)


class Model(torch.nn.Module):
    MAPPING = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k")}

    def __init__(self):
        super().__init__()
        self.qkv_proj = W8A8Layer({"q": 6, "k": 2}, 4)
        self.o_proj = W8A8Layer({None: 4}, 6)
        self.norm = torch.nn.Parameter(torch.ones(4), requires_grad=False)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, tensor in weights:
            module, _, suffix = name.partition(".")
            fused, shard = self.MAPPING.get(module, (module, None))
            param = params[f"{fused}.{suffix}" if suffix else name]
            if not hasattr(param, "weight_loader"):  # SGLang's default loader: shapes must agree
                if param.shape != tensor.shape:
                    raise AssertionError(f"{name}: {tuple(param.shape)} vs {tuple(tensor.shape)}")
                param.data.copy_(tensor)
            else:
                param.weight_loader(param, tensor, shard)


def _weights(seed):
    g = torch.Generator().manual_seed(seed)
    return [("q_proj.weight", torch.randn(6, 4, generator=g, dtype=torch.bfloat16)),
            ("k_proj.weight", torch.randn(2, 4, generator=g, dtype=torch.bfloat16)),
            ("o_proj.weight", torch.randn(4, 6, generator=g, dtype=torch.bfloat16)),
            ("norm", torch.rand(4, generator=g) + 0.5)]


def _converter():
    quantized = {"q_proj.weight", "k_proj.weight", "o_proj.weight"}
    return WeightConverter(ConfigFn.int8, quantized, expected=quantized | {"norm"}, served=QuantFn.int8)


def _served(weights):
    """What a fresh engine on these BF16 weights would hold: the checkpoint, then SGLang's processing."""
    model, loaded = Model(), LoadedParams()
    model.load_weights([pair for name, t in weights for pair in _converter().convert(name, t)])
    for layer in (model.qkv_proj, model.o_proj):
        loaded.around_processing(lambda m, l: m.process_weights_after_loading(l), ChannelMethod(), layer)
    return model, loaded


def test_sglang_layers_crash_on_a_second_load_without_the_runtime():
    model, _ = _served(_weights(0))
    converted = [pair for name, t in _weights(1) for pair in _converter().convert(name, t)]
    with pytest.raises(AssertionError, match=r"q_proj.weight: \(4, 8\) vs \(6, 4\)"):
        model.load_weights(converted)


def test_sync_writes_into_the_storage_the_kernel_reads_and_equals_a_fresh_engine():
    model, loaded = _served(_weights(0))
    kernel_weight = model.qkv_proj.weight  # the processed parameter (a transposed view)
    sync = WeightSync(model, _converter(), loaded.of(model))
    model.load_weights = sync.load_weights
    new = _weights(1)
    for pair in new[:2]:  # one tensor per call (verl / TRL), a view into a buffer poisoned after the call
        buf = pair[1].clone()
        model.load_weights([(pair[0], buf)])
        buf.fill_(float("nan"))
    assert sync.status() is not None and "not received" in sync.status()  # mid-sync: refused
    model.load_weights(new[2:])
    assert sync.status() is None and sync.state.completed == 1
    fresh, _ = _served(new)
    assert model.qkv_proj.weight is kernel_weight  # the processed parameters are back
    for name in ("qkv_proj.weight", "qkv_proj.weight_scale", "o_proj.weight", "o_proj.weight_scale", "norm"):
        assert torch.equal(dict(model.named_parameters())[name], dict(fresh.named_parameters())[name]), name
    q = quantize_weight(QuantFn.int8, new[0][1])  # the q shard: rows 0-5 of the fused weight, transposed
    assert torch.equal(model.qkv_proj.weight[:, :6], q.weight.t())


def test_a_layout_in_new_memory_is_refused_at_start():
    model = Model()
    with pytest.raises(FlashRLError, match="re-lays out `weight`"):
        LoadedParams().around_processing(lambda m, l: m.process_weights_after_loading(l), CopyingMethod(),
                                         model.qkv_proj)


def test_requests_are_aborted_while_a_sync_is_incomplete(monkeypatch):
    model, loaded = _served(_weights(0))
    sync = WeightSync(model, _converter(), loaded.of(model))
    plugin._state["syncs"] = [sync]
    aborted = []
    req = SimpleNamespace(finished_reason=None, set_finish_with_abort=aborted.append)
    plugin.request_guard(None, req)
    assert aborted == []  # the engine holds a complete set of weights
    sync.load_weights(_weights(1)[:1])
    plugin.request_guard(None, req)
    assert len(aborted) == 1 and "weight sync incomplete" in aborted[0]
    sync.discard("SGLang released the weights' memory")
    plugin.request_guard(None, req, True)  # a retracted request is not re-judged
    assert len(aborted) == 1


def test_truncated_sampling_with_logprobs_is_warned_once(caplog):
    """SGLang's logprobs are the untruncated tempered distribution: exact for top_p=1, top_k=-1 only."""
    plugin._state["syncs"] = []
    req = lambda **sp: SimpleNamespace(finished_reason=None, return_logprob=True,  # noqa: E731
                                       sampling_params=SimpleNamespace(**{"top_p": 1.0, "top_k": 1 << 30, **sp}))
    with caplog.at_level("WARNING", logger="flashrl_tools.runtime"):
        plugin.request_guard(None, req())
        assert not caplog.records
        plugin.request_guard(None, req(top_p=0.9))
        plugin.request_guard(None, req(top_k=20))
    assert len(caplog.records) == 1 and "before top-p / top-k truncation" in caplog.records[0].message


def test_released_weights_are_refused_until_a_full_sync():
    """verl / slime put SGLang to sleep with release_memory_occupation(tags=["weights", ...]): the memory
    comes back without the parameters (SGLang restores buffers only)."""
    model, loaded = _served(_weights(0))
    sync = WeightSync(model, _converter(), loaded.of(model))
    plugin._state["syncs"] = [sync]
    plugin.release_weights(None, None, SimpleNamespace(tags=["kv_cache"]))
    assert sync.status() is None  # the KV cache alone: weights untouched
    plugin.release_weights(None, None, SimpleNamespace(tags=["weights", "kv_cache"]))
    assert "release_memory_occupation" in sync.status()
    sync.load_weights(_weights(1)[:3])
    assert "discarded" in sync.status()  # a partial push does not bring them back
    sync.load_weights(_weights(1)[3:])
    assert sync.status() is None and sync.state.completed == 1
    plugin.release_weights(None, None, SimpleNamespace(tags=None))  # no tags: everything
    assert sync.status() is not None


def test_released_weights_with_cpu_backup_stay_served():
    """verl's hybrid engine starts SGLang with enable_weights_cpu_backup: the memory saver copies the
    weights' memory (synced 8-bit weights included) to the CPU and back, so nothing is discarded."""
    model, loaded = _served(_weights(0))
    sync = WeightSync(model, _converter(), loaded.of(model))
    plugin._state["syncs"] = [sync]
    manager = lambda backup: SimpleNamespace(tp_worker=SimpleNamespace(model_runner=SimpleNamespace(  # noqa: E731
        server_args=SimpleNamespace(enable_weights_cpu_backup=backup))))
    plugin.release_weights(None, manager(True), SimpleNamespace(tags=["weights", "kv_cache"]))
    assert sync.status() is None
    plugin.release_weights(None, manager(False), SimpleNamespace(tags=["weights", "kv_cache"]))
    assert "release_memory_occupation" in sync.status()


def test_direct_loads_are_refused():
    plugin.direct_updates(None, [], None)
    plugin.direct_updates(None, [], "flattened_bucket")
    with pytest.raises(RuntimeError, match="load_format='direct'"):
        plugin.direct_updates(None, [], load_format="direct")


# -- FP8 KV cache: stand-ins of SGLang's RadixAttention, model runner and TokenizerManager -------------

class RadixAttention(torch.nn.Module):
    """SGLang's attention layer as the runtime sees it: forward(q, k, v, forward_batch); k_scale None
    without a KV-cache quant method (a BF16 checkpoint)."""

    def __init__(self):
        super().__init__()
        self.k_scale = self.v_scale = self.k_scale_float = self.v_scale_float = None

    def forward(self, q, k, v, forward_batch):
        return q


class KVRunner:
    def __init__(self):
        self.model = torch.nn.Sequential(torch.nn.Linear(2, 2), RadixAttention(), RadixAttention())
        self.server_args = SimpleNamespace(kv_cache_dtype="fp8_e4m3")
        self.prefill_cuda_graph_runner = self.decode_cuda_graph_runner = "graphs"
        self.captures = 0

    def init_decode_cuda_graph(self):
        assert self.prefill_cuda_graph_runner == "graphs"  # calibration over before capturing
        self.captures += 1


def _prefill(runner, k_max: float, v_max: float, tokens: int = 3):
    """One forward of every attention layer; rows past the batch's real tokens are padding (huge)."""
    for i, layer in enumerate(m for m in runner.model if isinstance(m, RadixAttention)):
        k = torch.full((tokens + 2, 4), k_max * (i + 1))
        k[tokens:] = 1e6
        v = torch.full((tokens + 2, 4), -v_max * (i + 1))
        v[tokens:] = 1e6
        layer(torch.zeros(tokens + 2, 4), k, v, SimpleNamespace(out_cache_loc=torch.arange(tokens)))


def _calibrate(kv, runner, k_max, v_max, token="t"):
    from flashrl_tools.runtime.sglang.kv_scales import CALIBRATION_RID

    for index, k in (("0", k_max), ("1", k_max / 2)):
        assert kv.on_request(f"{CALIBRATION_RID}{token}-{index}") is None
        _prefill(runner, k, v_max)
    kv.on_request(f"{CALIBRATION_RID}{token}-finish")


def test_kv_scales_are_calibrated_after_every_sync_and_graphs_captured_when_they_change():
    from flashrl_tools.runtime.kv_calibration import scale_for
    from flashrl_tools.runtime.sglang.kv_scales import KVScales

    runner, sync = KVRunner(), SimpleNamespace(state=SimpleNamespace(completed=0))
    kv = KVScales(runner, sync, checkpoint_scales=False)
    layers = list(kv.layers.values())
    assert all(float(l.k_scale) == 1.0 and l.k_scale_float == 1.0 for l in layers)  # SGLang's default
    assert "not calibrated" in kv.on_request("rollout-1")  # never calibrated: refused, not served
    _prefill(runner, 1e3, 1e3)  # not armed: nothing recorded
    _calibrate(kv, runner, 40.0, 10.0)
    assert kv.on_request("rollout-1") is None and runner.captures == 1
    assert runner.prefill_cuda_graph_runner == "graphs" and not kv.armed
    for i, layer in enumerate(layers):  # absmax over the real tokens of both sequences, per layer
        assert layer.k_scale_float == scale_for("k", 40.0 * (i + 1)) == float(layer.k_scale)
        assert layer.v_scale_float == scale_for("v", 10.0 * (i + 1)) == float(layer.v_scale)
    first = kv.scales()
    sync.state.completed = 1  # a sync: stale until calibrated
    assert "not calibrated" in kv.on_request("rollout-2")
    _calibrate(kv, runner, 40.0, 10.0)  # same weights -> bit-equal scales, graphs kept
    assert kv.scales() == first and runner.captures == 1
    sync.state.completed = 2
    _calibrate(kv, runner, 80.0, 10.0)
    assert runner.captures == 2 and layers[0].k_scale_float == scale_for("k", 80.0)


def test_an_abandoned_kv_calibration_restores_the_scales_in_use():
    from flashrl_tools.runtime.sglang.kv_scales import CALIBRATION_RID, KVScales

    runner, sync = KVRunner(), SimpleNamespace(state=SimpleNamespace(completed=0))
    kv = KVScales(runner, sync, checkpoint_scales=False)
    _calibrate(kv, runner, 40.0, 10.0)
    in_use = kv.scales()
    sync.state.completed = 1
    kv.on_request(f"{CALIBRATION_RID}u-0")
    assert kv.armed and runner.prefill_cuda_graph_runner is None and kv.scales() != in_use  # reference 1.0
    assert "not calibrated" in kv.on_request("rollout")  # the front end gave up: still refused
    assert not kv.armed and kv.scales() == in_use and runner.prefill_cuda_graph_runner == "graphs"
    assert not any(l._forward_pre_hooks for l in kv.layers.values())
    kv.on_request(f"{CALIBRATION_RID}v-0")  # a calibration that saw no attention layer fails, refused with why
    kv.on_request(f"{CALIBRATION_RID}v-finish")
    assert kv.stale() and kv.scales() == in_use and "calibration saw 0 of 2" in kv.on_request("rollout")


def test_checkpoint_kv_scales_serve_until_the_first_sync():
    from flashrl_tools.runtime.sglang.kv_scales import KVScales

    runner, sync = KVRunner(), SimpleNamespace(state=SimpleNamespace(completed=0))
    for layer in (m for m in runner.model if isinstance(m, RadixAttention)):  # loaded by SGLang's KV method
        layer.k_scale, layer.v_scale = torch.nn.Parameter(torch.tensor(0.5), requires_grad=False), torch.tensor(0.25)
        layer.k_scale_float, layer.v_scale_float = 0.5, 0.25
    kv = KVScales(runner, sync, checkpoint_scales=True)
    assert kv.on_request("rollout") is None and set(kv.scales()["1"].values()) == {0.5, 0.25}
    sync.state.completed = 1
    assert kv.on_request("rollout") is not None


class Manager:
    """SGLang's TokenizerManager as the FP8 KV front end uses it."""

    def __init__(self, kv="fp8_e4m3", abort=False):
        self.server_args = SimpleNamespace(kv_cache_dtype=kv)
        self.rid_to_state, self.tokenizer, self.context_len = {}, None, 64
        self.model_config = SimpleNamespace(vocab_size=100)
        self.sent, self.flushes, self.abort = [], 0, abort

    async def flush_cache(self):
        self.flushes += 1
        return SimpleNamespace(success=True)


async def _original_generate(manager, obj, request=None):
    manager.sent.append((obj.rid, list(obj.input_ids)))
    aborted = manager.abort and obj.rid.startswith("flashrl-kv-calibration-")
    yield {"meta_info": {"finish_reason": {"type": "abort" if aborted else "length"}}}


def _generate(manager, rid):
    import asyncio

    from flashrl_tools.runtime.sglang import kv_front

    async def run():
        obj = SimpleNamespace(rid=rid, input_ids=[1, 2])
        return [out async for out in kv_front.generate_request(_original_generate, manager, obj)]
    return asyncio.run(run())


def test_the_front_end_calibrates_before_the_first_rollout_and_after_each_weight_update(monkeypatch):
    import asyncio
    import sys

    from flashrl_tools.runtime.kv_calibration import CALIBRATION_PROMPTS, calibration_sequences
    from flashrl_tools.runtime.sglang import kv_front

    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct",
                        SimpleNamespace(GenerateReqInput=lambda **kw: SimpleNamespace(**kw)))
    m = Manager()
    _generate(m, "a")
    rids = [rid for rid, _ in m.sent]
    assert len(rids) == CALIBRATION_PROMPTS + 2 and rids[-1] == "a" and rids[-2].endswith("-finish")
    assert [rid.rsplit("-", 1)[1] for rid in rids[:-2]] == [str(i) for i in range(CALIBRATION_PROMPTS)]
    assert [ids for _, ids in m.sent[:-2]] == [s[:63] for s in calibration_sequences(None, 100)]  # fixed
    assert m.flushes == 2
    _generate(m, "b")
    assert [rid for rid, _ in m.sent[-1:]] == ["b"] and len(m.sent) == len(rids) + 1  # calibrated: no rerun

    async def update(manager):
        return True, "ok"
    assert asyncio.run(kv_front.weights_changed(update, m)) == (True, "ok")
    _generate(m, "c")
    assert len(m.sent) == 2 * len(rids) + 1 and m.sent[-1][0] == "c"
    plain = Manager(kv="auto")
    _generate(plain, "a")
    assert [rid for rid, _ in plain.sent] == ["a"]


def test_an_aborted_calibration_is_tried_again(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct",
                        SimpleNamespace(GenerateReqInput=lambda **kw: SimpleNamespace(**kw)))
    m = Manager(abort=True)  # the schedulers abort it: a sync is in progress
    _generate(m, "a")
    assert [rid for rid, _ in m.sent][-1] == "a" and len(m.sent) == 2  # stopped at the first abort
    m.abort = False
    _generate(m, "b")
    assert len(m.sent) > 4 and m.sent[-1][0] == "b"


def test_a_stale_rollout_is_aborted_by_the_request_guard():
    from flashrl_tools.runtime.sglang.kv_scales import KVScales

    plugin._state.update(syncs=[], kvs=[KVScales(KVRunner(), SimpleNamespace(state=SimpleNamespace(completed=0)),
                                                 checkpoint_scales=False)])
    aborted = []
    plugin.request_guard(None, SimpleNamespace(rid="r", finished_reason=None, set_finish_with_abort=aborted.append))
    assert len(aborted) == 1 and "FP8 KV scales are not calibrated" in aborted[0]
