"""What only the SGLang adapter does (what both adapters do: tests/test_runtime_contract.py; the engine
itself: tests/gpu/). On the stand-ins of tests/sglang_standins.py: the plugin registers its hook table
(or only the start-up hooks that refuse what SGLang would swallow), ServerArgs frozen after
__post_init__, the layers' processed views that the sync writes through, the refusals and SGLang's
FP8 KV specifics (decode graphs captured again only when the scales change, checkpoint scales)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from flashrl_tools.config.resolve import resolve
from flashrl_tools.errors import FlashRLError
from flashrl_tools.quant.formats import QuantFn
from flashrl_tools.quant.quantizer import quantize_weight
from flashrl_tools.runtime.core.kv_state import CALIBRATION_RID, KVScaleState
from flashrl_tools.runtime.core.session import SyncSession
from flashrl_tools.runtime.core import process
from flashrl_tools.runtime.sglang import adapter, plugin, scheduler
from flashrl_tools.runtime.sglang.kv_scales import RadixAttentionScales
from flashrl_tools.runtime.sglang.server_args import apply_plan, server_args
from flashrl_tools.runtime.core import loader_slots as inplace
from flashrl_tools.runtime.sglang.weight_sync import LoadedParams, LoaderWriter, loaders_back
from sglang_standins import (QUANTIZED, ChannelMethod, CopyingMethod, KVRunner, Kinds, Manager, Model, RadixAttention, Registry,
                             ResolvedArgs, converter, generate, original_generate, prefill, served,
                             weights)
from sglang_standins import server_args as _args


@pytest.fixture(autouse=True)
def _fresh_plugin_state():
    process.reset()
    scheduler._warned.clear()
    yield
    process.reset()


# -- the plugin and ServerArgs ----------------------------------------------------------------------

def test_plugin_changes_nothing_without_a_config(monkeypatch):
    monkeypatch.delenv("FLASHRL_CONFIG", raising=False)
    monkeypatch.delenv("FLASHRL_KV_CACHE_DTYPE", raising=False)
    reg = Registry()
    plugin.register(reg, Kinds)
    assert [t for t, _, _ in reg.hooks] == [h.target for h in adapter.HOOKS if h.always]  # the server-args hooks
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
    wrapping = [h for h in adapter.HOOKS if h.kind.name != "ADD"]  # (ADD hooks: core/hooks.py, on import)
    assert [(t, k) for t, _, k in reg.hooks] == [(h.target, getattr(Kinds, h.kind.name)) for h in wrapping]
    assert all(h.target.startswith("sglang.srt.") for h in adapter.HOOKS)


def test_an_invalid_config_is_raised_by_the_server_args_hook(monkeypatch):
    """SGLang only logs a plugin's exception: the engine must still refuse to start."""
    monkeypatch.setenv("FLASHRL_CONFIG", "int9")
    reg = Registry()
    plugin.register(reg, Kinds)  # does not raise
    assert [t for t, _, _ in reg.hooks] == [h.target for h in adapter.HOOKS if h.always]
    with pytest.raises(RuntimeError, match="flashrl: .*int9"):
        reg.hooks[0][1](_args("x"))


@pytest.mark.parametrize("config, fmt", [("int8", QuantFn.int8), ("fp8", QuantFn.fp8_channel)])
def test_server_args_serve_the_configs_checkpoint(default_model, monkeypatch, tmp_path, config, fmt):
    from pathlib import Path

    from flashrl_tools.runtime.core.convert import served_format

    monkeypatch.setenv("FLASHRL_HOME", str(tmp_path))
    args = _args(default_model)
    changed = apply_plan(resolve(config), args)
    assert args.tokenizer_path == str(default_model) and args.model_path != str(default_model)
    assert set(changed) == {"model_path", "tokenizer_path"}
    assert served_format(Path(args.model_path)) is fmt
    bf16 = _args(default_model)
    assert apply_plan(resolve("bf16"), bf16) == {} and bf16.model_path == str(default_model)


def test_server_args_built_before_the_plugins_loaded_are_changed_once(default_model, monkeypatch, tmp_path):
    """verl's SGLang server builds ServerArgs itself, then SGLang loads the plugins (in
    Engine._launch_subprocesses) and calls check_server_args: the config applies there, and only once
    (an Engine's ServerArgs already changed before __post_init__ is left alone)."""
    monkeypatch.setenv("FLASHRL_HOME", str(tmp_path))
    monkeypatch.setenv("FLASHRL_CONFIG", "int8")
    plugin.register(Registry(), Kinds)
    late = next(h.fn for h in adapter.HOOKS if h.name == "late_server_args")
    # after __post_init__: tokenizer set, fields read-only (a bare assignment raised on the H100)
    args = ResolvedArgs(**vars(_args(default_model, tokenizer_path=str(default_model))))
    object.__setattr__(args, "_declarations_materialized", True)
    late(args)
    served_path = args.model_path
    assert served_path != str(default_model) and args.tokenizer_path == str(default_model)
    late(args)
    server_args(args)
    assert args.model_path == served_path


@pytest.mark.parametrize("config, setup, match", [
    ("fp8_tensor.yaml", {}, "SGLang does not serve fp8_tensor checkpoints"),
    ("int8", {"load_format": "flash_rl"}, "would both quantize"),
])
def test_server_args_refusals(default_model, tmp_path, config, setup, match):
    if config.endswith(".yaml"):
        (tmp_path / config).write_text(f"version: 1\nconfigs:\n- fn: {config.removesuffix('.yaml')}\n")
        config = str(tmp_path / config)
    with pytest.raises(FlashRLError, match=match):
        apply_plan(resolve(config), _args(default_model, **setup))


@pytest.mark.parametrize("setup, env, expect", [
    ({"attention_backend": "fa3", "page_size": None}, {}, 16),  # FP8 cache, fa3, the caller's page_size unset
    ({"attention_backend": "fa3", "page_size": 1}, {}, 1),  # the caller's own page_size stays
    ({"attention_backend": None, "page_size": None}, {}, None),  # SGLang's own choice of backend: left alone
    ({"attention_backend": "triton", "page_size": None}, {}, None),  # flashrl's kernel does not serve triton
    ({"attention_backend": "fa3", "page_size": None}, {"FLASHRL_DECODE_ATTN": "0"}, None),  # SGLang's fa3 decode
    ({"attention_backend": "fa3", "page_size": None}, {"FLASHRL_KV_CACHE_DTYPE": None}, None),  # a BF16 cache
])
def test_the_fp8_pool_under_flashrls_decode_kernel_takes_16_token_pages(default_model, monkeypatch, tmp_path,
                                                                       setup, env, expect):
    """SGLang's pool by 16-token pages where flashrl's FP8 decode kernel reads it (2.7 % off the 14B step: it
    reads contiguous pages instead of one slot a token); everything else keeps the caller's page_size."""
    monkeypatch.setenv("FLASHRL_HOME", str(tmp_path))
    monkeypatch.setenv("FLASHRL_KV_CACHE_DTYPE", "fp8")
    monkeypatch.delenv("FLASHRL_DECODE_ATTN", raising=False)
    for key, value in env.items():
        if value is None:
            monkeypatch.delenv(key)
        else:
            monkeypatch.setenv(key, value)
    args = _args(default_model, **setup)
    changed = apply_plan(resolve("int8"), args)
    assert args.page_size == expect and ("page_size" in changed) == (expect == 16 and setup["page_size"] is None)
    assert args.kv_cache_dtype == ("auto" if "FLASHRL_KV_CACHE_DTYPE" in env else "fp8_e4m3")


def test_int8_moe_is_refused_and_fp8_moe_served(tmp_path, monkeypatch):
    """SGLang 0.5.17's compressed-tensors INT8 MoE scheme is NPU-only; per-channel FP8 experts load
    (and keep their storage: no processing on CUDA without aiter)."""
    from conftest import run_cli

    moe = tmp_path / "moe"
    assert run_cli("models", "tiny", "--arch", "qwen3_moe", "-o", moe).returncode == 0
    with pytest.raises(FlashRLError, match="INT8 MoE experts on NPU only"):
        apply_plan(resolve("int8"), _args(moe))
    monkeypatch.setenv("FLASHRL_HOME", str(tmp_path / "home"))
    args = _args(moe)
    apply_plan(resolve("fp8"), args)
    assert args.model_path != str(moe) and args.tokenizer_path == str(moe)


# -- the sync: SGLang's loader through its processed views ---------------------------------------------

def test_sglang_layers_crash_on_a_second_load_without_the_runtime():
    model, _ = served(weights(0))
    converted = [pair for name, t in weights(1) for pair in converter().convert(name, t)]
    with pytest.raises(AssertionError, match=r"q_proj.weight: \(4, 8\) vs \(6, 4\)"):
        model.load_weights(converted)


def _session(model, loaded):
    session = SyncSession(model, converter(), LoaderWriter(model, loaded.of(model)), "sglang")
    model.load_weights = session.load_weights
    return session


def test_sync_writes_into_the_storage_the_kernel_reads_and_equals_a_fresh_engine():
    model, loaded = served(weights(0))
    kernel_weight = model.qkv_proj.weight  # the processed parameter (a transposed view)
    session = _session(model, loaded)
    new = weights(1)
    model.load_weights(new)
    assert session.status() is None and session.completed == 1
    fresh, _ = served(new)
    assert model.qkv_proj.weight is kernel_weight  # the processed parameters are back
    for name in ("qkv_proj.weight", "qkv_proj.weight_scale", "o_proj.weight", "o_proj.weight_scale", "norm"):
        assert torch.equal(dict(model.named_parameters())[name], dict(fresh.named_parameters())[name]), name
    q = quantize_weight(QuantFn.int8, new[0][1])  # the q shard: rows 0-5 of the fused weight, transposed
    assert torch.equal(model.qkv_proj.weight[:, :6], q.weight.t())


def test_every_tp_rank_reports_its_fp8_kv_scales(monkeypatch):
    """The scales RPC at TP > 1 (issue 76): each scheduler writes its own rank's scales (rank 0 at the path, rank R
    beside it) and `sglang_job.kv_scales` returns every rank's in rank order (one rank: its scales as before); a
    stale rank fails the read."""
    from types import SimpleNamespace

    from flashrl_tools.verify import sglang_job

    ranks = {0: {"0": {"k": 0.5, "v": 0.25}}, 1: {"0": {"k": 0.75, "v": 0.125}}}
    stale = {0: False, 1: False}

    class Engine:
        def __init__(self, tp):
            self.server_args = SimpleNamespace(tp_size=tp)

        def collective_rpc(self, name, path):
            assert name == "flashrl_kv_scales"
            for rank in range(self.server_args.tp_size):  # every scheduler answers, each from its own state
                kv = SimpleNamespace(current=ranks[rank], stale=lambda r=rank: stale[r])
                monkeypatch.setattr(process, "kv_states", lambda kv=kv: [kv])
                scheduler.dump_kv_scales(SimpleNamespace(ps=SimpleNamespace(tp_rank=rank)), path)  # 0.5.17

    assert sglang_job.kv_scales(Engine(1)) == ranks[0]
    assert sglang_job.kv_scales(Engine(2)) == [ranks[0], ranks[1]]
    stale[1] = True
    with pytest.raises(RuntimeError, match="stale"):
        sglang_job.kv_scales(Engine(2))


def test_the_job_observes_one_sequence_a_request_when_asked():
    """`observe` with `one_per_call` sends each sequence as a request of its own, one after another (a probe that
    observes so is compared with engines that batch as it does: Marlin's W4A16 GEMM tiles by the batch's rows);
    the results are laid out as a batched call's."""
    from types import SimpleNamespace

    from flashrl_tools.verify import sglang_job

    class Engine:
        server_args = SimpleNamespace(kv_cache_dtype="auto")

        def __init__(self):
            self.batches = []

        def generate(self, input_ids, **kw):
            self.batches.append([list(s) for s in input_ids])
            return [{"output_ids": [len(s)], "meta_info": {
                "input_token_logprobs": [(None, s[0], "")] + [(-t / 10, t, "") for t in s[1:]],
                "output_token_logprobs": [(-0.5, len(s), "")]}} for s in input_ids]

    seqs = [[5, 6, 7], [8, 9]]
    batched, alone = Engine(), Engine()
    want = sglang_job.observe(batched, {"sequences": seqs})
    assert sglang_job.observe(alone, {"sequences": seqs, "one_per_call": True}) == want
    assert batched.batches == [seqs] and alone.batches == [[s] for s in seqs]
    assert want == {"tokens": [[3], [2]], "logprobs": [[-0.6, -0.7, -0.5], [-0.9, -0.5]]}


def test_the_tp_rank_and_size_are_read_where_each_sglang_release_keeps_them():
    """SGLang 0.5.17's Scheduler and ModelRunner keep the rank in their parallel state (`ps.tp_rank`) and have no
    `tp_rank`: read as `tp_rank` it was 0 on every rank, so at TP = 2 both schedulers wrote their FP8 KV scales
    over rank 0's file and rank 1's was never written (2 x H200, 2026-11-30); older releases: `tp_rank`."""
    from types import SimpleNamespace

    from flashrl_tools.runtime.sglang.capabilities import tp_rank, tp_size

    assert tp_rank(SimpleNamespace(ps=SimpleNamespace(tp_rank=1))) == 1
    assert tp_size(SimpleNamespace(ps=SimpleNamespace(tp_size=2))) == 2 and tp_size(SimpleNamespace()) == 1
    assert tp_rank(SimpleNamespace(ps=SimpleNamespace(tp_rank=0), tp_rank=1)) == 0
    assert tp_rank(SimpleNamespace(tp_rank=1)) == 1
    assert tp_rank(SimpleNamespace()) == 0


def test_a_reload_from_disk_does_not_process_the_synced_layers_again():
    """SGLang's update_weights_from_disk loads (a sync through the runtime's `load_weights`), then runs every
    layer's `process_weights_after_loading` again. Processing a W8A8 layer twice would transpose its transposed
    view back (the kernel would read the loaded layout: a crash, or wrong logits for a square weight); the runtime
    skips a layer it saw processed, so the engine equals a fresh one on the new weights and keeps syncing."""
    model, loaded = served(weights(0))
    kernel = {n: p for n, p in model.named_parameters()}
    session = _session(model, loaded)
    new = weights(1)
    model.load_weights(new)  # update_weights_from_disk's load
    for layer in (model.qkv_proj, model.o_proj):  # then its processing of every layer
        loaded.around_processing(lambda m, lay: m.process_weights_after_loading(lay), ChannelMethod(), layer)
    fresh, _ = served(new)
    for name, param in model.named_parameters():
        assert param is kernel[name], name  # the processed Parameters, not new transposes
        assert torch.equal(param, dict(fresh.named_parameters())[name]), name
    assert len(loaded.of(model)) == 2  # one entry a layer: its loaders as loaded at start
    model.load_weights(weights(2))  # and the next sync still goes through the loaders into the kernel's storage
    assert session.completed == 2
    assert torch.equal(model.o_proj.weight, dict(served(weights(2))[0].named_parameters())["o_proj.weight"])
    twice = ChannelMethod()  # without the runtime: the second processing hands back the loaded layout
    plain = served(weights(0))[0]
    twice.process_weights_after_loading(plain.o_proj)
    assert plain.o_proj.weight.shape != kernel["o_proj.weight"].shape


def _shapes():
    return {n: tuple(t.shape) for name, w in weights(0) if name in QUANTIZED
            for n, t in converter().convert(name, w)}


def _probed(model, loaded):
    with loaders_back(loaded.of(model)):
        return inplace.probe(model, model.load_weights, _shapes())


def test_in_place_slots_are_learned_from_the_loaders_without_touching_the_served_weights():
    model, loaded = served(weights(0))
    before = {n: p.clone() for n, p in model.named_parameters()}
    storage = {n: p.data_ptr() for n, p in model.named_parameters()}
    slots, slow = _probed(model, loaded)
    assert not slow and set(slots) == set(_shapes())
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == storage  # the kernels' views intact
    assert all(torch.equal(p, before[n]) and p.dtype == before[n].dtype for n, p in model.named_parameters())
    k = slots["k_proj.weight"]  # rows 6-7 of the fused qkv weight (the loaded, checkpoint-layout Parameter)
    assert (k.rows, k.cols, k.src_rows, k.src_cols) == (slice(6, 8), slice(0, 4), slice(0, 2), slice(0, 4))
    assert k.param is loaded.of(model)[0][1]["weight"]


def _calls(model):
    calls = []
    load = model.load_weights

    def spy(batch, *a, **kw):
        batch = list(batch)
        calls.append([n for n, _ in batch])
        return load(batch, *a, **kw)
    model.load_weights = spy
    return calls


def test_in_place_sync_starts_after_a_sync_through_the_loaders_showed_the_same_bits():
    model, loaded = served(weights(0))
    slots, _ = _probed(model, loaded)
    calls = _calls(model)
    writer = LoaderWriter(model, loaded.of(model), slots)
    session = SyncSession(model, converter(), writer, "sglang")
    model.load_weights = session.load_weights
    model.load_weights(weights(1))  # the first sync: the loaders, every slot checked against them
    assert writer.trusted and "q_proj.weight" in calls[0]
    calls.clear()
    for seed in (2, 3):  # then the slots: only the norm goes through SGLang's load_weights
        model.load_weights(weights(seed))
        fresh, _ = served(weights(seed))
        for name, param in fresh.named_parameters():
            assert torch.equal(dict(model.named_parameters())[name], param), (seed, name)
    assert calls == [["norm"], ["norm"]] and session.completed == 3


def test_a_slot_the_loaders_contradict_is_dropped_and_the_loaders_keep_every_sync(caplog):
    model, loaded = served(weights(0))
    slots, _ = _probed(model, loaded)
    q = slots["q_proj.weight"]  # a wrong guess: rows shifted by one
    slots["q_proj.weight"] = inplace.ProbedSlot(q.param, slice(1, 7), q.cols, q.src_rows, q.src_cols)
    writer = LoaderWriter(model, loaded.of(model), slots)
    session = SyncSession(model, converter(), writer, "sglang")
    model.load_weights = session.load_weights
    with caplog.at_level("WARNING", logger="flashrl_tools.runtime"):
        model.load_weights(weights(1))
    assert not writer.trusted and not writer.slots and "elsewhere than its in-place slot" in caplog.text
    model.load_weights(weights(2))
    fresh, _ = served(weights(2))
    assert all(torch.equal(dict(model.named_parameters())[n], p) for n, p in fresh.named_parameters())


class _Rank1Of2(torch.nn.Module):
    """A column-parallel layer on TP rank 1 of 2 (its loader narrows the source's rows), and a loader that
    writes its source transposed (no rectangle of rows in order)."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Module()
        self.up.weight = torch.nn.Parameter(torch.zeros(3, 4, dtype=torch.int8), requires_grad=False)
        self.sq = torch.nn.Module()
        self.sq.weight = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.int8), requires_grad=False)

    def load_weights(self, batch):
        for name, t in batch:
            if name == "up.weight":
                self.up.weight.data.copy_(t[3:6])
            elif name == "sq.weight":
                self.sq.weight.data.copy_(t.t())


def test_probes_follow_tensor_parallel_narrowing_and_refuse_what_is_no_rectangle():
    model = _Rank1Of2()
    slots, slow = inplace.probe(model, model.load_weights, {"up.weight": (6, 4), "sq.weight": (4, 4)})
    up = slots["up.weight"]
    assert (up.rows, up.cols, up.src_rows, up.src_cols) == (slice(0, 3), slice(0, 4), slice(3, 6), slice(0, 4))
    assert "sq.weight" in slow and "in order" in slow["sq.weight"]
    src = torch.arange(24, dtype=torch.int8).reshape(6, 4)
    up.write(src)
    assert torch.equal(model.up.weight, src[3:6]) and up.holds(src)


def test_a_layout_in_new_memory_is_refused_at_start():
    model = Model()
    with pytest.raises(FlashRLError, match="re-lays out `weight`"):
        LoadedParams().around_processing(lambda m, lay: m.process_weights_after_loading(lay), CopyingMethod(),
                                         model.qkv_proj)


def test_truncated_sampling_with_logprobs_is_warned_once(caplog):
    """SGLang's logprobs are the untruncated tempered distribution: exact for top_p=1, top_k=-1 only."""
    req = lambda **sp: SimpleNamespace(rid="r", finished_reason=None, return_logprob=True,  # noqa: E731
                                       sampling_params=SimpleNamespace(**{"top_p": 1.0, "top_k": 1 << 30, **sp}))
    with caplog.at_level("WARNING", logger="flashrl_tools.runtime"):
        scheduler.add_request(None, req())
        assert not caplog.records
        scheduler.add_request(None, req(top_p=0.9))
        scheduler.add_request(None, req(top_k=20))
    assert len(caplog.records) == 1 and "before top-p / top-k truncation" in caplog.records[0].message


def test_released_weights_with_cpu_backup_stay_served():
    """verl's hybrid engine starts SGLang with enable_weights_cpu_backup: the memory saver copies the
    weights' memory (synced 8-bit weights included) to the CPU and back, so nothing is discarded; a
    release of the KV cache alone leaves the weights too."""
    model, loaded = served(weights(0))
    session = _session(model, loaded)
    process.sessions().append(session)
    manager = lambda backup: SimpleNamespace(tp_worker=SimpleNamespace(model_runner=SimpleNamespace(  # noqa: E731
        server_args=SimpleNamespace(enable_weights_cpu_backup=backup))))
    scheduler.release_weights(None, manager(True), SimpleNamespace(tags=["weights", "kv_cache"]))
    scheduler.release_weights(None, None, SimpleNamespace(tags=["kv_cache"]))
    assert session.status() is None
    scheduler.release_weights(None, manager(False), SimpleNamespace(tags=None))  # no tags: everything
    assert "release_memory_occupation" in session.status()


def test_direct_loads_are_refused():
    scheduler.direct_updates(None, [], None)
    scheduler.direct_updates(None, [], "flattened_bucket")
    with pytest.raises(RuntimeError, match="load_format='direct'"):
        scheduler.direct_updates(None, [], load_format="direct")


# -- FP8 KV cache: SGLang's decode graphs, its checkpoint scales, its rid routing ---------------------------

def _calibrate(kv, runner, k_max, v_max, token="t"):
    for index, k in (("0", k_max), ("1", k_max / 2)):
        assert scheduler.route(kv, f"{CALIBRATION_RID}{token}-{index}") is None
        prefill(runner, k, v_max)
    scheduler.route(kv, f"{CALIBRATION_RID}{token}-finish")


def test_decode_graphs_that_read_the_scale_tensors_are_not_captured_again():
    """SGLang's fa3 decode passes `layer.k_scale` (a view of the tensor written in place) to the kernel: new scales
    need no capture; a decode backend set apart from the prefill one decides (SGLang's rule)."""
    for backends, captures in (({"attention_backend": "fa3"}, 0), ({"attention_backend": "triton"}, 1),
                               ({"attention_backend": "triton", "decode_attention_backend": "fa3"}, 0),
                               ({"attention_backend": "fa3", "decode_attention_backend": "flashinfer"}, 1)):
        runner, session = KVRunner(), SimpleNamespace(completed=0)
        runner.server_args = SimpleNamespace(kv_cache_dtype="fp8_e4m3", **backends)
        kv = KVScaleState(RadixAttentionScales(runner), session, checkpoint_scales=False)
        _calibrate(kv, runner, 40.0, 10.0)
        assert runner.captures == captures, backends
        assert all(float(layer.k_scale) == layer.k_scale_float for layer in kv.kv.layers.values())


def test_decode_graphs_are_captured_again_only_when_the_scales_change():
    """SGLang's kernels take the scales as floats baked into captured decode graphs; prefills run
    without the prefill graph while calibrating (a replayed graph would skip the hooks)."""
    runner, session = KVRunner(), SimpleNamespace(completed=0)
    kv = KVScaleState(RadixAttentionScales(runner), session, checkpoint_scales=False)
    assert all(float(layer.k_scale) == 1.0 for layer in kv.kv.layers.values())  # SGLang's default
    assert "not calibrated" in scheduler.route(kv, "rollout-1")  # never calibrated: refused, not served
    scheduler.route(kv, f"{CALIBRATION_RID}t-0")
    assert runner.prefill_cuda_graph_runner is None
    prefill(runner, 40.0, 10.0)
    scheduler.route(kv, f"{CALIBRATION_RID}t-finish")
    assert runner.prefill_cuda_graph_runner == "graphs" and runner.captures == 1
    first = kv.scales()
    session.completed = 1
    _calibrate(kv, runner, 40.0, 10.0)  # same weights -> bit-equal scales, graphs kept
    assert kv.scales() == first and runner.captures == 1
    session.completed = 2
    _calibrate(kv, runner, 80.0, 10.0)
    assert runner.captures == 2


def test_an_abandoned_calibration_is_refused_with_its_reason():
    runner, session = KVRunner(), SimpleNamespace(completed=0)
    kv = KVScaleState(RadixAttentionScales(runner), session, checkpoint_scales=False)
    _calibrate(kv, runner, 40.0, 10.0)
    in_use = kv.scales()
    session.completed = 1
    scheduler.route(kv, f"{CALIBRATION_RID}u-0")
    assert "not calibrated" in scheduler.route(kv, "rollout")  # the front end gave up: still refused
    assert not kv.armed and kv.scales() == in_use and runner.prefill_cuda_graph_runner == "graphs"
    scheduler.route(kv, f"{CALIBRATION_RID}v-0")  # a calibration that saw no attention layer fails, refused with why
    scheduler.route(kv, f"{CALIBRATION_RID}v-finish")
    assert kv.stale() and kv.scales() == in_use and "calibration saw 0 of 2" in scheduler.route(kv, "rollout")


def test_checkpoint_kv_scales_serve_until_the_first_sync():
    runner, session = KVRunner(), SimpleNamespace(completed=0)
    for layer in (m for m in runner.model if isinstance(m, RadixAttention)):  # loaded by SGLang's KV method
        layer.k_scale, layer.v_scale = torch.nn.Parameter(torch.tensor(0.5), requires_grad=False), torch.tensor(0.25)
        layer.k_scale_float, layer.v_scale_float = 0.5, 0.25
    kv = KVScaleState(RadixAttentionScales(runner), session, checkpoint_scales=True)
    assert scheduler.route(kv, "rollout") is None and set(kv.scales()["1"].values()) == {0.5, 0.25}
    session.completed = 1
    assert scheduler.route(kv, "rollout") is not None


def test_a_stale_rollout_is_aborted_by_the_request_guard():
    kv = KVScaleState(RadixAttentionScales(KVRunner()), SimpleNamespace(completed=0), checkpoint_scales=False)
    process.kv_states().append(kv)
    aborted = []
    scheduler.add_request(None, SimpleNamespace(rid="r", finished_reason=None, set_finish_with_abort=aborted.append))
    assert len(aborted) == 1 and "FP8 KV scales are not calibrated" in aborted[0]


def test_an_aborted_calibration_is_tried_again(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct",
                        SimpleNamespace(GenerateReqInput=lambda **kw: SimpleNamespace(**kw)))
    m = Manager(abort=True)  # the schedulers abort them: a sync is in progress
    generate(m, "a")
    rids = [rid for rid, _ in m.sent if rid != "<flush>"]
    # the sequences went as one batched request, every one aborted: no finish request, the rollout goes on to be
    # refused by the schedulers
    assert rids[-1] == "a" and len(rids) == 9 and not any(r.endswith("-finish") for r in rids)
    m.abort = False
    with caplog.at_level("INFO", logger="flashrl_tools.runtime"):
        generate(m, "b")
    assert len([rid for rid, _ in m.sent if rid != "<flush>"]) > 4 and m.sent[-1][0] == "b"
    done = next(r.getMessage() for r in caplog.records if "calibration done" in r.getMessage())
    assert all(f"{step} 0." in done for step in ("drain", "flush", "prefills", "finish"))  # where its time goes
    plain = Manager(kv="auto")
    generate(plain, "a")
    assert [rid for rid, _ in plain.sent] == ["a"]  # no FP8 KV cache: nothing to calibrate


def test_the_calibration_fits_the_schedulers_prompt_limit(monkeypatch):
    """SGLang's schedulers abort a prompt of max_req_input_len tokens or more (its context length - 6): on an engine
    with a short context the calibration's sequences stay under that limit, not just under the context (a
    136-token engine had every calibration aborted and its rollouts refused, GPU 2026-11-28)."""
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct",
                        SimpleNamespace(GenerateReqInput=lambda **kw: SimpleNamespace(**kw)))
    m = Manager()
    m.context_len, m.max_req_input_len = 136, 130
    generate(m, "a")
    sent = [ids for rid, ids in m.sent if rid not in ("<flush>", "a")]
    assert sent and max(len(ids) for ids in sent) < 130 and max(len(ids) for ids in sent) == 129
    assert m.sent[-1][0] == "a"


def test_the_calibration_sent_at_once_is_prefilled_one_sequence_per_batch():
    """kv_front.prefill_all sends every calibration sequence in one request; the schedulers let them into the
    waiting queue one at a time, each once the one before has been prefilled or is in the batch about to run (a
    fresh engine's batches), in order.
    A new calibration aborts what is left of the old one and waits for the request in progress; its finish request
    clears the queue; other requests, and a retracted calibration request, pass straight through."""
    from flashrl_tools.runtime.core.kv_state import calibration_rid

    sched = SimpleNamespace(waiting=[])

    def original(s, req, *args, **kwargs):
        s.waiting.append(req.rid)

    def add(req, *args, **kwargs):
        return scheduler.one_calibration_per_batch(original, sched, req, *args, **kwargs)
    sched._add_request_to_queue = add

    def req(rid):
        r = SimpleNamespace(rid=rid, done=False, aborted=None)
        r.finished = lambda: r.done or r.aborted is not None
        r.set_finish_with_abort = lambda why: setattr(r, "aborted", why)
        return r

    def ran(r):  # its prefill's result processed
        r.done = True
        scheduler.next_calibration(None, sched)
    t = [req(calibration_rid("t", i)) for i in range(3)]
    for r in t:
        add(r)
    assert sched.waiting == [t[0].rid]  # one at a time
    add(req("rollout"))  # not a calibration request: straight in
    ran(t[0])
    assert sched.waiting == [t[0].rid, "rollout", t[1].rid]
    add(t[1], True)  # retracted (SGLang re-adds it): straight in, not queued behind itself
    assert sched.waiting[-1] == t[1].rid
    u = req(calibration_rid("u", 0))  # another calibration while t's second sequence runs
    add(u)
    assert t[2].aborted and sched.waiting[-1] == t[2].rid  # aborted through SGLang's path: the front end hears it
    assert u.rid not in sched.waiting  # behind the request in progress (it runs before u arms)
    ran(t[1])
    assert sched.waiting[-1] == u.rid
    v = req(calibration_rid("u", 1))
    add(v)
    finish = req(calibration_rid("u", "finish"))
    add(finish)  # (the front end sends it after every sequence: nothing should be queued; if so, aborted)
    assert v.aborted and sched.waiting[-2:] == [v.rid, finish.rid]
    assert getattr(sched, scheduler.CALIBRATING) is None and getattr(sched, scheduler.QUEUED) == []
    # the next sequence is queued once the one before is in the batch about to run (consecutive prefills), not
    # after its result; not while that batch holds only a chunk of it; an idle iteration releases nothing
    w = [req(calibration_rid("w", i)) for i in range(3)]
    for r in w:
        add(r)

    def plan(*reqs):
        return SimpleNamespace(batch_to_run=SimpleNamespace(reqs=list(reqs)) if reqs else None)
    scheduler.next_calibration(plan(), sched)
    assert sched.waiting[-1] == w[0].rid
    scheduler.next_calibration(plan(w[0]), sched)
    assert sched.waiting[-1] == w[1].rid and not w[0].finished()
    sched.chunked_req = w[1]
    scheduler.next_calibration(plan(w[1]), sched)
    assert sched.waiting[-1] == w[1].rid
    sched.chunked_req = None
    scheduler.next_calibration(plan(w[1]), sched)
    assert sched.waiting[-1] == w[2].rid


def test_a_calibration_request_samples_as_the_requests_running_beside_it():
    """The calibration's finish request joins the released requests' decode batch for one step (SGLang's overlap
    loop merges it before its token is processed): greedy beside T=1 would move that batch onto FlashInfer's
    top-k / top-p sampler, JIT-built on first use (issue 42's stall). It takes a running request's sampling
    settings; with nothing running it stays greedy; rollout requests keep their own."""
    from flashrl_tools.runtime.core.kv_state import FINISH, calibration_rid

    def greedy():  # SGLang's normalised temperature 0
        return SimpleNamespace(temperature=1.0, top_p=1.0, top_k=1, min_p=0.0, max_new_tokens=1)

    def req(rid, params):
        return SimpleNamespace(rid=rid, finished_reason=None, sampling_params=params,
                               set_finish_with_abort=lambda why: None)
    sampled = req("rollout", SimpleNamespace(temperature=0.7, top_p=1.0, top_k=1 << 30, min_p=0.0, max_new_tokens=500))
    sched = SimpleNamespace(running_batch=SimpleNamespace(reqs=[req(calibration_rid("t", 0), greedy()), sampled]))
    finish = req(calibration_rid("t", FINISH), greedy())
    scheduler.add_request(sched, finish)
    p = finish.sampling_params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_new_tokens) == (0.7, 1.0, 1 << 30, 0.0, 1)
    alone = req(calibration_rid("u", 0), greedy())
    scheduler.add_request(SimpleNamespace(running_batch=SimpleNamespace(reqs=[])), alone)
    assert alone.sampling_params.top_k == 1 and alone.sampling_params.temperature == 1.0
    rollout = req("r2", greedy())
    scheduler.add_request(sched, rollout)
    assert rollout.sampling_params.top_k == 1


# -- in-flight updates (pause.py) ------------------------------------------------------------------

def _req(rid, key=None):
    return SimpleNamespace(rid=rid, extra_key=key, finished_reason=None, to_finish=None, finished=lambda: False,
                           set_finish_with_abort=lambda why, s=None: None)


def test_requests_prefilled_after_an_update_never_share_old_prefix_blocks():
    """The radix-cache namespace carries the weights' version when the request is (re)scheduled: a retracted
    request recomputes on the new weights, a new one never shares the prefix of a request kept in place."""
    from flashrl_tools.runtime.sglang import pause

    session = SimpleNamespace(completed=3)
    process.sessions().append(session)
    tree = object()  # SGLang's tree cache: the request matches its prefix afresh
    kept, lora, calib, chunked = _req("a"), _req("b", key="lora7"), _req(f"{CALIBRATION_RID}t-0"), _req("d")
    for r in (kept, lora, calib, chunked):
        pause.salt(r, tree)
    assert kept.extra_key == "flashrl-weights-3" and lora.extra_key == "lora7|flashrl-weights-3"
    assert calib.extra_key == calib.rid  # the calibration's blocks are its own
    session.completed = 4
    new = _req("c")
    pause.salt(new, tree)
    pause.salt(lora, tree)  # retracted: scheduled again
    pause.salt(chunked)  # a chunked prefill's next chunk (no tree cache): stays in its first chunk's namespace
    assert new.extra_key == "flashrl-weights-4" != kept.extra_key and lora.extra_key == "lora7|flashrl-weights-4"
    assert chunked.extra_key == "flashrl-weights-3"


def test_an_update_with_requests_paused_in_flight_keeps_the_cache_instead_of_asserting():
    from flashrl_tools.runtime.sglang import pause

    flushes = []
    updater = SimpleNamespace(flush_cache=lambda empty_cache=True: flushes.append(empty_cache) or False)
    assert pause.flush_after_update(None, updater, SimpleNamespace(flush_cache=True, torch_empty_cache=False)) is None
    assert flushes == [False]  # tried (SGLang would assert on the False)
    pause.flush_after_update(None, updater, SimpleNamespace(flush_cache=False))
    assert flushes == [False]


def _scheduler(waiting, running=()):
    return SimpleNamespace(waiting_queue=list(waiting), running_batch=SimpleNamespace(reqs=list(running)))


def test_a_rank_still_incomplete_at_a_continue_aborts_what_it_kept(monkeypatch):
    from flashrl_tools.runtime.sglang import pause

    monkeypatch.setitem(sys.modules, "sglang.srt.managers.schedule_batch",
                        SimpleNamespace(FINISH_ABORT=lambda message: SimpleNamespace(message=message)))
    session = SimpleNamespace(completed=1, status=lambda: "a weight sync is in progress (3 of 10 tensors)")
    process.sessions().append(session)
    aborted = []
    waiting = _req("w")
    waiting.set_finish_with_abort = aborted.append
    running = _req("r")
    s = _scheduler([waiting], [running])
    calls = []
    pause.scheduler_pause(lambda *a: calls.append("pause"), s, SimpleNamespace(mode="in_place"))
    pause.scheduler_continue(lambda *a: calls.append("continue"), s, SimpleNamespace())
    assert calls == ["pause", "continue"]  # the engine continues (new requests are refused by admission)
    assert "before the weight sync completed" in running.to_finish.message and "3 of 10" in aborted[0]
    session.status = lambda: None  # complete: nothing is aborted
    kept = _req("k")
    s = _scheduler([], [kept])
    pause.scheduler_continue(lambda *a: None, s, SimpleNamespace())
    assert kept.to_finish is None


def test_a_continue_before_the_sync_completed_is_refused_at_the_front_end():
    """core/inflight.resume_refusal, the rule of both engines: the front end asks the schedulers' sync state
    (get_internal_state, answered by a paused scheduler through the sync_state hook) and raises before the continue
    reaches them -- the engine stays paused with what it kept; complete: the continue goes on."""
    import asyncio

    from flashrl_tools.runtime.core.session import SyncIncomplete
    from flashrl_tools.runtime.sglang import pause

    session = SimpleNamespace(completed=1, status=lambda: "a weight sync is in progress (3 of 10 tensors)")
    process.sessions().append(session)
    state = SimpleNamespace(internal_state={"load_format": "auto"})
    assert pause.sync_state(state, object()) is None
    assert state.internal_state[pause.SYNC_STATE] == "a weight sync is in progress (3 of 10 tensors)"

    async def internal_state():
        out = SimpleNamespace(internal_state={})
        pause.sync_state(out, None)
        return [out.internal_state]

    calls = []

    async def original(manager, obj):
        calls.append("continue")

    manager = SimpleNamespace(get_internal_state=internal_state, server_args=SimpleNamespace(kv_cache_dtype="auto"))
    with pytest.raises(SyncIncomplete, match=r"before the weight sync completed \(a weight sync is in progress"):
        asyncio.run(pause.front_continue(original, manager, SimpleNamespace()))
    assert calls == []  # nothing reached the schedulers: still paused
    session.status = lambda: None
    asyncio.run(pause.front_continue(original, manager, SimpleNamespace()))
    assert calls == ["continue"]


def test_retracted_requests_wait_for_the_fp8_kv_scales_of_the_new_weights():
    """FP8 KV cache, retract mode: at the continue the scheduler holds the retracted requests (stale scales),
    the front end calibrates beside them (no drain: they hold no KV), and once the calibration's finish
    request (which writes the scales) has run they join the queue."""
    from flashrl_tools.runtime.sglang import pause

    runner, session = KVRunner(), SimpleNamespace(completed=0, status=lambda: None)
    kv = KVScaleState(RadixAttentionScales(runner), session, checkpoint_scales=False)
    _calibrate(kv, runner, 40.0, 10.0)
    process.sessions().append(session)
    process.kv_states().append(kv)
    s = _scheduler([_req("x"), _req("y")])
    pause.scheduler_pause(lambda *a: None, s, SimpleNamespace(mode="retract"))
    session.completed = 1  # the update
    pause.scheduler_continue(lambda *a: None, s, SimpleNamespace())
    assert s.waiting_queue == [] and [r.rid for r in s._flashrl_held] == ["x", "y"]
    for i in ("0", "1"):
        scheduler.add_request(s, _req(f"{CALIBRATION_RID}u-{i}"))
        prefill(runner, 80.0, 10.0)
    assert s._flashrl_held
    finish = _req(f"{CALIBRATION_RID}u-finish")
    scheduler.add_request(s, finish)
    assert not kv.stale() and s.waiting_queue == []  # written; the held requests wait for the finish request
    pause.release_held(None, s)
    assert s.waiting_queue == []
    finish.finished = lambda: True  # it ran (not batched with them)
    pause.release_held(None, s)
    assert [r.rid for r in s.waiting_queue] == ["x", "y"] and s._flashrl_held == []
    s = _scheduler([_req("z")])  # the scales are current (no update since): nothing is held
    pause.scheduler_pause(lambda *a: None, s, SimpleNamespace(mode="retract"))
    pause.scheduler_continue(lambda *a: None, s, SimpleNamespace())
    assert [r.rid for r in s.waiting_queue] == ["z"]


def test_the_continue_calibrates_beside_held_requests_without_waiting_for_them(monkeypatch):
    import asyncio

    from flashrl_tools.runtime.sglang import kv_front, pause

    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct",
                        SimpleNamespace(GenerateReqInput=lambda **kw: SimpleNamespace(**kw)))
    m = Manager()
    m.rid_to_state = {"x": 1, "y": 2}  # retracted requests the schedulers hold: never finish before the scales
    setattr(m, kv_front.STALE, True)
    monkeypatch.setattr(pause, "unhooked_generate", original_generate)

    async def original(manager, obj):
        return "continued"

    async def run():
        await pause.front_pause(lambda *a: asyncio.sleep(0), m, SimpleNamespace(mode="retract"))
        return await asyncio.wait_for(pause.front_continue(original, m, SimpleNamespace()), 5)
    assert asyncio.run(run()) == "continued"
    rids = [rid for rid, _ in m.sent]
    assert "<flush>" not in rids and rids[-1].endswith("-finish") and len(rids) > 2
    assert getattr(m, kv_front.STALE) is False and not getattr(m, pause.HOLD)
    m2 = Manager()  # in place: the schedulers set the running batch aside, the continue calibrates beside it
    m2.rid_to_state = {"k": 1}
    setattr(m2, kv_front.STALE, True)

    async def run2(mode):
        await pause.front_pause(lambda *a: asyncio.sleep(0), m2, SimpleNamespace(mode=mode))
        return await asyncio.wait_for(pause.front_continue(original, m2, SimpleNamespace()), 5)
    asyncio.run(run2("in_place"))
    assert m2.sent[-1][0].endswith("-finish") and getattr(m2, kv_front.STALE) is False
    m2.sent = []
    asyncio.run(run2("in_place"))  # scales current: nothing to calibrate
    assert m2.sent == []
    m3 = Manager(abort=True)  # a calibration that fails with requests set aside: they go on (ABANDON)
    m3.rid_to_state, m2 = {"k": 1}, m3
    setattr(m3, kv_front.STALE, True)
    asyncio.run(run2("retract"))
    assert m3.sent[-1][0].endswith("-abandon") and getattr(m3, kv_front.STALE) is True


def _kept(rid, slot_row, prompt, outputs):
    r = _req(rid)
    r.req_pool_idx, r.origin_input_ids, r.output_ids = slot_row, list(range(prompt)), list(range(outputs))
    return r


def test_requests_kept_in_place_are_set_aside_and_their_fp8_entries_rescaled(monkeypatch):
    """FP8 KV cache, in place: at the continue the scheduler sets the running batch aside (and what waits
    for a prefill), so the calibration runs alone; its finish request writes the new scales and re-encodes
    the kept requests' entries -- each slot once (a shared cached prefix), only slots holding their KV --;
    they go on once that request ran. A calibration that gives up (ABANDON) releases them on the old scales."""
    from flashrl_tools.runtime.sglang import pause
    from sglang_standins import Batch, schedule_batch_module

    monkeypatch.setitem(sys.modules, "sglang.srt.managers.schedule_batch", schedule_batch_module())
    runner, session = KVRunner(), SimpleNamespace(completed=0, status=lambda: None)
    kv = KVScaleState(RadixAttentionScales(runner), session, checkpoint_scales=False)
    _calibrate(kv, runner, 40.0, 10.0)
    process.sessions().append(session)
    process.kv_states().append(kv)
    old = {name: dict(v) for name, v in kv.current.items()}
    pool, fp8 = runner.token_to_kv_pool, torch.float8_e4m3fn
    x = torch.arange(1, 17, dtype=torch.float32).view(16, 1, 1).expand(16, 1, 4)  # the values each slot holds
    layers = list(kv.kv.layers.values())
    for layer in layers:
        for buf, kind in ((pool.get_key_buffer(layer.layer_id), "k"), (pool.get_value_buffer(layer.layer_id), "v")):
            buf.copy_((x / old[layer_name(kv, layer)][kind]).to(fp8))
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    # a: slots 0 1 2 3 hold KV (prompt 3 + 2 outputs, the last without KV); b shares the prefix 0 1, then 4;
    # 9: entries past a request's KV (a table row's stale tail) -- another request's slot, never touched
    table = torch.tensor([[0, 1, 2, 3, 9, 9], [0, 1, 4, 9, 9, 9]])
    a, b, waiting = _kept("a", 0, 3, 2), _kept("b", 1, 2, 2), _req("w")
    s = SimpleNamespace(waiting_queue=[waiting], running_batch=Batch([a, b]), last_batch=Batch([b]), chunked_req=None,
                        enable_overlap=False, req_to_token_pool=SimpleNamespace(req_to_token=table))
    pause.scheduler_pause(lambda *a: None, s, SimpleNamespace(mode="in_place"))
    session.completed = 1  # the update
    pause.scheduler_continue(lambda *a: None, s, SimpleNamespace())
    assert s.running_batch.is_empty() and s.last_batch is None  # the calibration runs on an idle engine
    assert getattr(s, pause.FROZEN).reqs == [a, b] and getattr(s, pause.HELD) == [waiting]
    assert pause.busy(lambda sch: True, s) is False  # SGLang's idle leak check would count their slots
    for i in ("0", "1"):
        scheduler.add_request(s, _req(f"{CALIBRATION_RID}u-{i}"))
        prefill(runner, 80.0, 10.0)
    finish = _req(f"{CALIBRATION_RID}u-finish")
    scheduler.add_request(s, finish)
    assert not kv.stale() and kv.current != old
    after = pool.k_buffer + pool.v_buffer
    kept = [0, 1, 2, 3, 4]
    for i, (buf, was) in enumerate(zip(after, before)):
        layer, kind = layers[i % 2], "kv"[i // 2]
        new = kv.current[layer_name(kv, layer)][kind]
        untouched = [j for j in range(16) if j not in kept]
        assert torch.equal(buf[untouched], was[untouched])  # other slots: byte for byte
        got = buf[kept].view(fp8).float() * new  # read with the new scales: the values written (FP8 rounding)
        assert torch.allclose(got, x[kept], rtol=0.13), (i, got.flatten(), x[kept].flatten())
        if new != old[layer_name(kv, layer)][kind]:
            assert not torch.equal(buf[kept], was[kept])  # re-encoded once (a shared slot twice would be off)
    # kept in place: decode on at once (their entries match the new scales); waiting: once the finish request ran
    assert s.running_batch.reqs == [a, b] and getattr(s, pause.FROZEN) is None and s.waiting_queue == []
    pause.release_held(None, s)
    assert s.waiting_queue == [] and getattr(s, pause.HELD) == [waiting]
    finish.finished = lambda: True
    pause.release_held(None, s)
    assert s.running_batch.reqs == [a, b] and s.waiting_queue == [waiting] and not getattr(s, pause.HELD)
    assert pause.busy(lambda sch: True, s) is True
    # the next update's calibration gives up: released on the scales their entries were written with
    pause.scheduler_pause(lambda *a: None, s, SimpleNamespace(mode="in_place"))
    session.completed = 2
    s.waiting_queue = []
    pause.scheduler_continue(lambda *a: None, s, SimpleNamespace())
    current, bytes_now = dict(kv.current), [b.clone() for b in after]
    scheduler.add_request(s, _req(f"{CALIBRATION_RID}v-0"))
    prefill(runner, 160.0, 10.0)
    abandon = _req(f"{CALIBRATION_RID}v-abandon")
    scheduler.add_request(s, abandon)
    abandon.finished = lambda: True
    pause.release_held(None, s)
    assert s.running_batch.reqs == [a, b] and kv.stale() and kv.current == current
    assert kv.scales() == current and all(torch.equal(u, v) for u, v in zip(pool.k_buffer + pool.v_buffer, bytes_now))


def layer_name(kv, layer) -> str:
    return next(n for n, m in kv.kv.layers.items() if m is layer)


def test_a_request_sent_during_a_pause_calibrates_after_the_update(monkeypatch):
    """FP8 KV cache: a rollout sent while paused waits for the continue before the calibration check (else
    it would pass it with the old weights' scales and be refused by the schedulers after the update)."""
    import asyncio

    from flashrl_tools.runtime.sglang import kv_front

    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct",
                        SimpleNamespace(GenerateReqInput=lambda **kw: SimpleNamespace(**kw)))
    m = Manager()
    setattr(m, kv_front.STALE, False)

    async def run():
        m.is_pause, m.is_pause_cond = True, asyncio.Condition()
        task = asyncio.create_task(kv_front.generate_request(original_generate, m,
                                                             SimpleNamespace(rid="d", input_ids=[1])).__anext__())
        await asyncio.sleep(0.01)
        assert m.sent == []  # waits for the continue
        setattr(m, kv_front.STALE, True)  # the update
        async with m.is_pause_cond:
            m.is_pause = False
            m.is_pause_cond.notify_all()
        await task
    asyncio.run(run())
    rids = [rid for rid, _ in m.sent if rid != "<flush>"]
    assert rids[-1] == "d" and len(rids) > 2  # calibrated first


def test_concurrent_sglang_engines_get_torch_distributed_ports_of_their_own():
    """Two SGLang engines starting at the same moment on one host were handed the same free port (EADDRINUSE at
    start, 2026-11-26): the GPU jobs' engines take a port in a range of their process's own, skipping a taken one."""
    import socket

    from flashrl_tools.verify.sglang_job import own_nccl_port

    a, b = own_nccl_port(pid=1234), own_nccl_port(pid=1235)
    assert a is not None and b is not None and a // 10 != b // 10  # disjoint ranges
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", a))
        held.listen()
        assert own_nccl_port(pid=1234) == a + 1  # the next one of its range


def test_a_calibration_request_sglang_drops_from_its_queue_does_not_hold_the_next_ones():
    """SGLang's abort of a queued request pops it from the waiting queue without finishing it (the front end aborts a
    failed calibration batch's other sequences). As the request in progress it would hold every later calibration
    sequence queued for good: the rollout after a continue mid-sync waited with the scheduler idle (issue 42,
    2026-11-27, H200). A dropped request counts as done; one still queued, or being prefilled in chunks, does not."""
    from flashrl_tools.runtime.core.kv_state import calibration_rid

    sched = SimpleNamespace(waiting_queue=[], chunked_req=None)

    def original(s, req, *args, **kwargs):
        s.waiting_queue.append(req)

    def add(req, *args, **kwargs):
        return scheduler.one_calibration_per_batch(original, sched, req, *args, **kwargs)
    sched._add_request_to_queue = add

    def req(rid):
        r = SimpleNamespace(rid=rid, aborted=None)
        r.finished = lambda: r.aborted is not None
        r.set_finish_with_abort = lambda why: setattr(r, "aborted", why)
        return r
    t = [req(calibration_rid("t", i)) for i in range(3)]
    for r in t:
        add(r)
    assert sched.waiting_queue == [t[0]]
    scheduler.next_calibration(SimpleNamespace(batch_to_run=None), sched)  # t0 still queued: nothing moves
    assert sched.waiting_queue == [t[0]]
    sched.chunked_req = t[0]  # prefilled in chunks (out of the queue, not finished): still in progress
    sched.waiting_queue.clear()
    scheduler.next_calibration(SimpleNamespace(batch_to_run=None), sched)
    assert sched.waiting_queue == []
    sched.chunked_req = None  # SGLang's abort popped it, unfinished: the next sequence goes on
    scheduler.next_calibration(SimpleNamespace(batch_to_run=None), sched)
    assert sched.waiting_queue == [t[1]] and not t[0].finished()
    sched.waiting_queue.clear()  # t1 dropped too; a new calibration's first sequence is not held behind it
    u = req(calibration_rid("u", 0))
    add(u)
    assert t[2].aborted and sched.waiting_queue[-1] is u and getattr(sched, scheduler.CALIBRATING) is u


class MHATokenToKVPool:
    """SGLang's token-major KV pool as kv_store reads it: FP8 stored as bytes, one buffer per layer."""

    def __init__(self, dtype=torch.float8_e4m3fn, slots=8, heads=2, dim=4):
        self.dtype, self.start_layer = dtype, 0
        self.is_quantized_kv_cache, self.use_hnd, self.kv_cache_layout = False, False, "nhd"
        store = torch.uint8 if dtype == torch.float8_e4m3fn else dtype
        self.k_buffer = [torch.zeros(slots, heads, dim, dtype=store) for _ in range(2)]
        self.v_buffer = [torch.zeros(slots, heads, dim, dtype=store) for _ in range(2)]
        self.stock = []

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=None, v_scale=None, layer_id_override=None,
                      dcp_kv_mask=None):  # SGLang's five-kernel path, recorded
        self.stock.append(layer.layer_id)


def test_fa3_decode_stores_fp8_kv_in_one_kernel_and_everything_else_takes_sglangs_store(monkeypatch, caplog):
    """kv_store (FLASHRL_FUSED_KV_STORE=1): inside fa3's forward_decode an FP8 E4M3 pool's store goes to SGLang's
    fused kernel (the layer's buffers viewed as FP8, the KVWriteLoc's loc, the scale tensors), said once per
    process on the runtime's logger (the GPU tests read that line); outside decode, for a BF16 pool, with a DCP
    mask, with float scales or with the switch off SGLang's own store runs."""
    from flashrl_tools.runtime.sglang import kv_store

    calls = []
    monkeypatch.setattr(kv_store, "on_device", lambda t: True)  # the kernel is CUDA's: a stand-in here
    monkeypatch.setattr(kv_store, "kernel", lambda: lambda *a: calls.append(a))
    monkeypatch.setattr(kv_store, "_state", {})
    monkeypatch.setenv("FLASHRL_FUSED_KV_STORE", "1")
    pool, layer = MHATokenToKVPool(), SimpleNamespace(layer_id=1)
    k, v = torch.randn(3, 2, 4, dtype=torch.bfloat16), torch.randn(3, 2, 4, dtype=torch.bfloat16)
    scale = torch.full((), 0.5)
    loc = SimpleNamespace(loc=torch.tensor([5, 0, 7]), swa_loc=None)

    def store(p, *args, **kwargs):
        return kv_store.set_kv_buffer(type(p).set_kv_buffer, p, *args, **kwargs)

    def decode(p, *args, **kwargs):  # fa3's forward_decode under the kv_store_decode hook
        return kv_store.in_decode(lambda _backend: store(p, *args, **kwargs), None)

    store(pool, layer, loc, k, v, scale, scale)  # a prefill
    assert pool.stock == [1] and not calls
    with caplog.at_level("INFO", logger="flashrl_tools.runtime"):
        decode(pool, layer, loc, k, v, scale, scale)
    assert pool.stock == [1] and len(calls) == 1 and kv_store._decoding == 0
    assert caplog.text.count(kv_store.LOG_LINE) == 1
    q, ck, cv, kc, vc, where, ks, vs = calls[0]
    assert q is None and ck is k and cv is v and where is loc.loc and ks is scale and vs is scale
    assert kc.dtype == torch.float8_e4m3fn and kc.data_ptr() == pool.k_buffer[1].data_ptr()
    assert vc.data_ptr() == pool.v_buffer[1].data_ptr()
    decode(pool, layer, loc.loc, k, v)  # a bare loc, no scales (the kernel's 1.0)
    assert len(calls) == 2 and calls[1][5] is loc.loc and calls[1][6] is None
    decode(pool, layer, loc, k, v, k_scale=scale, v_scale=scale, layer_id_override=None)  # scales by name
    assert len(calls) == 3 and calls[2][6] is scale and calls[2][7] is scale
    calls.pop()
    for args, kwargs in (((MHATokenToKVPool(torch.bfloat16), layer, loc, k, v, scale, scale), {}),
                         ((pool, layer, loc, k, v, scale, scale), {"dcp_kv_mask": torch.ones(3, dtype=torch.bool)}),
                         ((pool, layer, loc, k, v, 0.5, 0.5), {}),
                         ((pool, layer, loc, k, v[:, :1], scale, scale), {})):
        decode(*args, **kwargs)
    assert len(calls) == 2 and pool.stock == [1, 1, 1, 1]
    monkeypatch.setattr(kv_store, "_state", {})
    monkeypatch.setenv("FLASHRL_FUSED_KV_STORE", "0")  # switched off: SGLang's store
    decode(pool, layer, loc, k, v, scale, scale)
    assert len(calls) == 2 and pool.stock == [1, 1, 1, 1, 1]
    monkeypatch.setattr(kv_store, "_state", {})
    monkeypatch.delenv("FLASHRL_FUSED_KV_STORE")  # on by default (its GPU engine test passed)
    decode(pool, layer, loc, k, v, scale, scale)
    assert len(calls) == 3


def _fa3_decode_call(page_size: int = 1, bs: int = 3, q_heads: int = 8, kv_heads: int = 2, d: int = 128, seed: int = 0):
    """The keyword arguments fa3's forward_decode gives `flash_attn_with_kvcache` (SGLang 0.5.17) over an FP8 pool
    of `page_size`: the query cast to FP8 without a scale, per-tensor descales expanded to (batch, kv_heads)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([37, 100, 5][:bs], dtype=torch.int32)
    pages = [(int(n) + page_size - 1) // page_size for n in lens]
    perm = torch.randperm(sum(pages) + 1, generator=g).to(torch.int32)
    table = torch.zeros(bs, max(pages), dtype=torch.int32)
    for i, p in enumerate(pages):
        table[i, :p] = perm[sum(pages[:i]):sum(pages[:i]) + p]
    slots = (sum(pages) + 1) * page_size
    k_buf = (torch.randn(slots, kv_heads, d, generator=g) * 2).to(torch.float8_e4m3fn)  # the pool's layer buffers
    v_buf = (torch.randn(slots, kv_heads, d, generator=g) * 2).to(torch.float8_e4m3fn)
    k_scale, v_scale = torch.tensor([0.03]), torch.tensor([0.02])
    return {"q": (torch.randn(bs, q_heads, d, generator=g) * 4).to(torch.float8_e4m3fn),
            "k_cache": k_buf.view(-1, page_size, kv_heads, d), "v_cache": v_buf.view(-1, page_size, kv_heads, d),
            "page_table": table, "cache_seqlens": lens, "cu_seqlens_q": torch.arange(bs + 1, dtype=torch.int32),
            "max_seqlen_q": 1, "softmax_scale": d ** -0.5, "causal": True, "window_size": (-1, -1), "softcap": 0.0,
            "k_descale": k_scale.expand(bs, kv_heads), "v_descale": v_scale.expand(bs, kv_heads),
            "return_softmax_lse": False, "num_splits": 0, "out": None, "ver": 3, "scheduler_metadata": None}


def test_xqa_mode_keeps_fa3s_query_bf16_and_casts_it_where_xqa_does_not_take_the_batch(monkeypatch):
    """FLASHRL_DECODE_ATTN=xqa on SGLang (runtime/sglang/decode_attn.py): while fa3's forward_decode runs over an FP8
    E4M3 pool its query stays BF16 (the backend's dtype is the query's meanwhile, restored after, also on an error); a
    batch XQA takes gets that query with no scale, a smaller one the FP8 cast fa3 makes (q_scale 1, flashrl's kernel),
    a call the kernels do not take goes to FA3 with the cast too; MLA, an MXFP8 or BF16 pool, an FP16 query (XQA's
    module is BF16's) or another mode keep fa3's cast."""
    from types import SimpleNamespace as NS

    from flashrl_tools.runtime.core import decode_attn as core
    from flashrl_tools.runtime.sglang import decode_attn, kv_store

    monkeypatch.setattr(kv_store, "on_device", lambda t: True)
    monkeypatch.setattr(core, "_state", {"mode": "xqa"})
    q16 = torch.randn(3, 8, 128, dtype=torch.bfloat16)
    seen = []

    def forward_decode(backend, q, *rest):  # fa3's: the query cast to the backend's dtype
        seen.append((q.to(backend.kv_cache_dtype).dtype, decode_attn._kept, kv_store._decoding))
        return "out"

    backend = NS(kv_cache_dtype=torch.float8_e4m3fn, use_mla=False, kv_cache_is_mxfp8=False)
    assert decode_attn.forward_decode(forward_decode, backend, q16) == "out"
    assert seen == [(torch.bfloat16, True, 1)] and backend.kv_cache_dtype == torch.float8_e4m3fn
    assert not decode_attn._kept and kv_store._decoding == 0
    with pytest.raises(RuntimeError):
        decode_attn.forward_decode(lambda b, q: (_ for _ in ()).throw(RuntimeError("x")), backend, q16)
    assert backend.kv_cache_dtype == torch.float8_e4m3fn and not decode_attn._kept
    for other, q in ((NS(**{**vars(backend), "use_mla": True}), q16), (NS(**{**vars(backend), "kv_cache_is_mxfp8": True}), q16),
                     (NS(**{**vars(backend), "kv_cache_dtype": torch.bfloat16}), q16), (backend, q16.half())):
        seen.clear()
        decode_attn.forward_decode(forward_decode, other, q)
        assert seen[0][1] is False, other
    monkeypatch.setattr(core, "_state", {"mode": "flashrl"})
    seen.clear()
    decode_attn.forward_decode(forward_decode, backend, q16)
    assert seen == [(torch.float8_e4m3fn, False, 1)]

    monkeypatch.setattr(core, "_state", {"mode": "xqa"})
    attended = []
    monkeypatch.setattr(core, "attend", lambda q, *a, q_scale=None, **k: attended.append((q.dtype, q_scale)) or "k")
    monkeypatch.setattr(decode_attn, "_kept", True)
    monkeypatch.setattr(kv_store, "_decoding", 1)
    kw = {**_fa3_decode_call(16), "q": q16}
    for xqa, want in ((True, (torch.bfloat16, None)), (False, (torch.float8_e4m3fn, 1.0))):
        attended.clear()
        monkeypatch.setattr(core, "takes_xqa", lambda *a, x=xqa, **k: x)
        assert decode_attn.flash_attn_with_kvcache(lambda *a, **k: "fa3", **kw) == "k"
        assert attended == [want]
    calls = []
    assert decode_attn.flash_attn_with_kvcache(lambda *a, **k: calls.append(k["q"].dtype) or "fa3",
                                               **{**kw, "softcap": 30.0}) == "fa3"
    assert calls == [torch.float8_e4m3fn]  # FA3 gets the query fa3 would have given it


def test_fa3_decode_calls_over_an_fp8_pool_are_the_ones_flashrls_kernel_takes(monkeypatch):
    """runtime/sglang/decode_attn.py: inside fa3's forward_decode, a one-token-per-sequence call over the FP8 E4M3
    pool with per-tensor descales goes to flashrl's kernel; prefill (outside the decode step), appended K / V, cascade
    LSE, windows, soft-cap, sinks, per-head descales, FA4, a BF16 query or pool keep FA3; FLASHRL_DECODE_ATTN unset
    takes the kernel on Hopper only, 0 keeps FA3 there."""
    from flashrl_tools.runtime.core import decode_attn as core
    from flashrl_tools.runtime.sglang import decode_attn, kv_store

    monkeypatch.setattr(kv_store, "on_device", lambda t: True)  # the kernel is CUDA's: a stand-in here
    kw = _fa3_decode_call()
    monkeypatch.setattr(kv_store, "_decoding", 0)
    assert not decode_attn.takes((), kw)  # a prefill's call
    monkeypatch.setattr(kv_store, "_decoding", 1)
    assert decode_attn.takes((), kw)
    assert decode_attn._scalar(kw["k_descale"]).data_ptr() == kw["k_descale"].data_ptr()  # the layer's tensor
    refused = [{"k": kw["q"]}, {"cu_seqlens_k_new": kw["cu_seqlens_q"]}, {"return_softmax_lse": True},
               {"window_size": (127, 0)}, {"softcap": 30.0}, {"sinks": torch.zeros(8)}, {"max_seqlen_q": 2},
               {"causal": False}, {"ver": 4}, {"q_descale": torch.ones(3, 2)},
               {"k_descale": torch.tensor([[0.03, 0.04], [0.03, 0.04], [0.03, 0.04]])},
               {"q": kw["q"].to(torch.bfloat16)}, {"k_cache": kw["k_cache"].to(torch.bfloat16)}]
    for change in refused:
        assert not decode_attn.takes((), {**kw, **change}), change
    assert not decode_attn.takes((kw["q"],), {k: v for k, v in kw.items() if k != "q"})  # positional: FA3's own
    monkeypatch.setattr(core, "attend", lambda *a, **k: "flashrl")
    for value, capability, want in ((None, (9, 0), "flashrl"), (None, (8, 9), "fa3"), ("0", (9, 0), "fa3")):
        calls = []
        monkeypatch.setattr(core, "_state", {})
        if value is None:
            monkeypatch.delenv("FLASHRL_DECODE_ATTN", raising=False)
        else:
            monkeypatch.setenv("FLASHRL_DECODE_ATTN", value)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert decode_attn.flash_attn_with_kvcache(lambda *a, c=calls, **k: c.append(k) or "fa3", **kw) == want
        assert len(calls) == (want == "fa3"), (value, capability)


def _sglang_decode_attn_check() -> None:
    """Run inside a process started with TRITON_INTERPRET=1: fa3's decode call through the hook equals float32
    attention over the pool's FP8 values (page sizes 1 and 16, SGLang's output buffer or a new BF16 one, its
    deterministic `num_splits=1`), logged once."""
    from flashrl_tools.quant.kernels import fp8_decode_attn_ref
    from flashrl_tools.runtime.core import decode_attn as core
    from flashrl_tools.runtime.sglang import decode_attn, kv_store

    kv_store.on_device = lambda t: True
    core._sm_count = lambda index: 132
    core._state["mode"] = "flashrl"
    kv_store._decoding = 1

    def fail(*a, **k):
        raise AssertionError("FA3 was called")

    for page_size, num_splits, given_out in ((1, 0, False), (16, 0, True), (16, 1, False)):
        kw = _fa3_decode_call(page_size)
        if given_out:
            kw["out"] = torch.full(kw["q"].shape, 7.0, dtype=torch.bfloat16)
        kw["num_splits"] = num_splits
        out = decode_attn.flash_attn_with_kvcache(fail, **kw)
        assert out.dtype == torch.bfloat16 and out.shape == kw["q"].shape and (out is kw["out"] or not given_out)
        ref = fp8_decode_attn_ref.reference(kw["q"], kw["k_cache"], kw["v_cache"], kw["page_table"], kw["cache_seqlens"],
                                        kw["cu_seqlens_q"], kw["softmax_scale"], kw["k_descale"][0, 0],
                                        kw["v_descale"][0, 0], q_scale=1.0)
        err = float((out.float() - ref).abs().max() / ref.abs().max())
        assert err <= 2 ** -7, (page_size, num_splits, err)
    assert core.ran()


def test_fa3_decode_through_flashrls_kernel_equals_float32_attention():
    """The hook's operands (SGLang's pool views, page table, lengths, descales, the unscaled FP8 query) reach the
    kernel as it computes them: through Triton's interpreter on CPU, in a process of its own."""
    import os
    import subprocess
    from pathlib import Path

    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU: tests/gpu runs the hook in SGLang itself")
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from test_runtime_sglang import "
            "_sglang_decode_attn_check; _sglang_decode_attn_check()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stderr[-3000:]


def test_a_step_log_whose_directory_is_missing_is_refused_at_start(tmp_path):
    """FLASHRL_STEP_LOG=PATH: refused at start, in one line, where PATH's directory does not exist (the scheduler
    would otherwise fail on its first batch); a path in an existing directory is taken."""
    from flashrl_tools.config.settings import Settings
    from flashrl_tools.errors import FlashRLError
    from flashrl_tools.runtime.core.adapter import check_settings
    from flashrl_tools.runtime.sglang.capabilities import CAPABILITIES

    check_settings(CAPABILITIES, Settings.read({"FLASHRL_STEP_LOG": str(tmp_path / "steps")}), "env")
    with pytest.raises(FlashRLError, match="FLASHRL_STEP_LOG=.*its directory does not exist") as e:
        check_settings(CAPABILITIES, Settings.read({"FLASHRL_STEP_LOG": str(tmp_path / "no" / "steps")}), "env")
    assert "\n" not in str(e.value)
