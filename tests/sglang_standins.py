"""Stand-ins of the SGLang pieces the runtime touches (SGLang has no CPU build installable here; the real
engine runs in tests/gpu/): its plugin registry, ServerArgs (frozen after __post_init__ in 0.5.17),
compressed-tensors W8A8 layers whose processing replaces `weight` by its transpose and `weight_scale`
by a new Parameter over the same storage, a model whose `load_weights` maps checkpoint names onto fused
parameters through each parameter's `weight_loader`, RadixAttention layers, a model runner and the
TokenizerManager as the FP8 KV front end uses it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from flashrl_tools.config.schema import ConfigFn
from flashrl_tools.quant.formats import QuantFn
from flashrl_tools.runtime.core.convert import WeightConverter
from flashrl_tools.runtime.sglang.weight_sync import LoadedParams


class Registry:
    def __init__(self):
        self.hooks = []

    def register(self, target, hook, kind):
        self.hooks.append((target, hook, kind))


Kinds = SimpleNamespace(BEFORE="before", AFTER="after", AROUND="around", REPLACE="replace")


def server_args(model, **kw):
    return SimpleNamespace(**{"model_path": str(model), "tokenizer_path": None, "quantization": None,
                              "load_format": "auto", "kv_cache_dtype": "auto", **kw})


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


# -- compressed-tensors W8A8 linear layers and a model loader ------------------------------------

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


QUANTIZED = frozenset({"q_proj.weight", "k_proj.weight", "o_proj.weight"})
NAMES = sorted(QUANTIZED | {"norm"})


def weights(seed):
    g = torch.Generator().manual_seed(seed)
    return [("q_proj.weight", torch.randn(6, 4, generator=g, dtype=torch.bfloat16)),
            ("k_proj.weight", torch.randn(2, 4, generator=g, dtype=torch.bfloat16)),
            ("o_proj.weight", torch.randn(4, 6, generator=g, dtype=torch.bfloat16)),
            ("norm", torch.rand(4, generator=g) + 0.5)]


def converter():
    return WeightConverter(ConfigFn.int8, set(QUANTIZED), expected=set(NAMES), served=QuantFn.int8)


def served(tensors):
    """What a fresh engine on these BF16 weights would hold: the checkpoint, then SGLang's processing."""
    model, loaded = Model(), LoadedParams()
    model.load_weights([pair for name, t in tensors for pair in converter().convert(name, t)])
    for layer in (model.qkv_proj, model.o_proj):
        loaded.around_processing(lambda m, lay: m.process_weights_after_loading(lay), ChannelMethod(), layer)
    return model, loaded


# -- FP8 KV cache: RadixAttention, the model runner, the TokenizerManager -------------------------

class RadixAttention(torch.nn.Module):
    """SGLang's attention layer as the runtime sees it: forward(q, k, v, forward_batch); k_scale None
    without a KV-cache quant method (a BF16 checkpoint)."""

    def __init__(self):
        super().__init__()
        self.k_scale = self.v_scale = self.k_scale_float = self.v_scale_float = None

    def forward(self, q, k, v, forward_batch):
        return q


class KVPool:
    """SGLang's token-indexed KV pool (MHATokenToKVPool): FP8 entries stored as bytes, one row per token slot."""

    def __init__(self, layers: int, slots: int = 16):
        self.k_buffer = [torch.zeros(slots, 1, 4, dtype=torch.uint8) for _ in range(layers)]
        self.v_buffer = [torch.zeros(slots, 1, 4, dtype=torch.uint8) for _ in range(layers)]

    def get_key_buffer(self, layer_id):
        return self.k_buffer[layer_id].view(torch.float8_e4m3fn)

    def get_value_buffer(self, layer_id):
        return self.v_buffer[layer_id].view(torch.float8_e4m3fn)


class KVRunner:
    def __init__(self):
        self.model = torch.nn.Sequential(torch.nn.Linear(2, 2), RadixAttention(), RadixAttention())
        for i, layer in enumerate(m for m in self.model if isinstance(m, RadixAttention)):
            layer.layer_id = i
        self.token_to_kv_pool = KVPool(2)
        self.server_args = SimpleNamespace(kv_cache_dtype="fp8_e4m3")
        self.prefill_cuda_graph_runner = self.decode_cuda_graph_runner = "graphs"
        self.captures = 0

    def init_decode_cuda_graph(self):
        assert self.prefill_cuda_graph_runner == "graphs"  # calibration over before capturing
        self.captures += 1


def prefill(runner, k_max: float, v_max: float, tokens: int = 3):
    """One forward of every attention layer; rows past the batch's real tokens are padding (huge)."""
    for i, layer in enumerate(m for m in runner.model if isinstance(m, RadixAttention)):
        k = torch.full((tokens + 2, 4), k_max * (i + 1))
        k[tokens:] = 1e6
        v = torch.full((tokens + 2, 4), -v_max * (i + 1))
        v[tokens:] = 1e6
        layer(torch.zeros(tokens + 2, 4), k, v, SimpleNamespace(out_cache_loc=torch.arange(tokens)))


class Manager:
    """SGLang's TokenizerManager as the FP8 KV front end uses it; `on_prefill(rid, ids)` is called for
    every request it serves (the schedulers' side)."""

    def __init__(self, kv="fp8_e4m3", abort=False, on_prefill=None):
        self.server_args = SimpleNamespace(kv_cache_dtype=kv)
        self.rid_to_state, self.tokenizer, self.context_len = {}, None, 64
        self.model_config = SimpleNamespace(vocab_size=100)
        self.sent, self.flushes, self.abort = [], 0, abort
        self.on_prefill = on_prefill

    async def get_internal_state(self):
        """The schedulers' answer (one DP group): their sync state through the adapter's sync_state hook."""
        from flashrl_tools.runtime.sglang import pause

        out = SimpleNamespace(internal_state={})
        pause.sync_state(out, None)
        return [out.internal_state]

    async def flush_cache(self):
        self.flushes += 1
        self.sent.append(("<flush>", []))
        return SimpleNamespace(success=True)


async def original_generate(manager, obj, request=None):
    """One request, or a batch (rid and input_ids lists: SGLang yields the list of their outputs)."""
    batch = isinstance(obj.rid, list)
    outs = []
    for rid, ids in zip(obj.rid, obj.input_ids) if batch else [(obj.rid, obj.input_ids)]:
        manager.sent.append((rid, list(ids)))
        if manager.on_prefill is not None:
            manager.on_prefill(rid, list(ids))
        aborted = manager.abort and rid.startswith("flashrl-kv-calibration-")
        outs.append({"meta_info": {"finish_reason": {"type": "abort" if aborted else "length"}}})
    yield outs if batch else outs[0]


def generate(manager, rid):
    import asyncio

    from flashrl_tools.runtime.sglang import kv_front

    async def run():
        obj = SimpleNamespace(rid=rid, input_ids=[1, 2])
        return [out async for out in kv_front.generate_request(original_generate, manager, obj)]
    return asyncio.run(run())


class Batch:
    """SGLang's ScheduleBatch as the pause hooks use it (merge / filter of finished requests)."""

    def __init__(self, reqs=(), batch_is_full=False, extend=False):
        self.reqs, self.batch_is_full = list(reqs), batch_is_full
        self.forward_mode = SimpleNamespace(is_extend=lambda: extend)

    def is_empty(self):
        return not self.reqs

    def merge_batch(self, other):
        self.reqs += other.reqs

    def filter_batch(self, chunked_req_to_exclude=()):
        self.reqs = [r for r in self.reqs if not r.finished() and r not in chunked_req_to_exclude]


def schedule_batch_module():
    """sglang.srt.managers.schedule_batch for the pause hooks (monkeypatched into sys.modules)."""
    return SimpleNamespace(ScheduleBatch=Batch, FINISH_ABORT=lambda message: SimpleNamespace(message=message))


# -- SGLang's Llama on a real checkpoint ----------------------------------------------------------

class BF16Layer(torch.nn.Module):
    def __init__(self, shards: dict, cols: int):
        super().__init__()
        offsets, at = {}, 0
        for name, rows in shards.items():
            offsets[name], at = (at, rows), at + rows
        self.weight = torch.nn.Parameter(torch.zeros(at, cols, dtype=torch.bfloat16), requires_grad=False)
        self.weight.weight_loader = _loader(offsets)


class SglangLlama(torch.nn.Module):
    """SGLang's LlamaForCausalLM as its loader sees it: q / k / v fused into qkv_proj, gate / up into
    gate_up_proj; with a compressed-tensors W8A8 checkpoint those layers are W8A8 (processed into
    transposed views after loading, through the runtime's layout hook as in SGLang)."""

    FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
             "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}

    def __init__(self, path, quantized: bool):
        import json

        super().__init__()
        c = json.loads((path / "config.json").read_text())
        hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        h, inter = c["hidden_size"], c["intermediate_size"]
        q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
        linear = W8A8Layer if quantized else BF16Layer
        self.path, self.linears = path, []
        self.embed_tokens = torch.nn.Embedding(c["vocab_size"], h, dtype=torch.bfloat16)
        self.layers = torch.nn.ModuleList()
        for _ in range(c["num_hidden_layers"]):
            layer = torch.nn.Module()
            layer.qkv_proj = linear({"q": q, "k": kv, "v": kv}, h)
            layer.o_proj = linear({None: h}, q)
            layer.gate_up_proj = linear({"gate": inter, "up": inter}, h)
            layer.down_proj = linear({None: h}, inter)
            layer.input_layernorm = torch.nn.Parameter(torch.ones(h, dtype=torch.bfloat16), requires_grad=False)
            layer.post_attention_layernorm = torch.nn.Parameter(torch.ones(h, dtype=torch.bfloat16),
                                                                requires_grad=False)
            self.linears += [layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj]
            self.layers.append(layer)
        self.norm = torch.nn.Parameter(torch.ones(h, dtype=torch.bfloat16), requires_grad=False)
        self.lm_head = torch.nn.Linear(h, c["vocab_size"], bias=False, dtype=torch.bfloat16)

    def _param(self, name: str):
        parts = name.split(".")
        if parts[0] == "model":
            parts = parts[1:]
        if parts[0] == "layers":  # layers.i.(self_attn|mlp).leaf.weight[_scale] / layers.i.norm.weight
            i, leaf = int(parts[1]), parts[-2]
            layer = self.layers[i]
            if leaf.endswith("layernorm"):
                return getattr(layer, leaf), None
            fused, shard = self.FUSED.get(leaf, (leaf, None))
            return getattr(getattr(layer, fused), parts[-1]), shard
        if parts[0] == "norm":
            return self.norm, None
        return dict(self.named_parameters())[".".join(parts)], None

    def load_weights(self, weights):
        for name, tensor in weights:
            param, shard = self._param(name)
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                if param.shape != tensor.shape:
                    raise AssertionError(f"{name}: {tuple(param.shape)} vs {tuple(tensor.shape)}")
                param.data.copy_(tensor)
            else:
                loader(param, tensor, shard)

    @classmethod
    def load(cls, path, loaded):
        """Load `path` as SGLang would: the checkpoint, then each W8A8 layer's processing."""
        from pathlib import Path

        from flashrl_tools.safetensors_io import CheckpointReader

        reader = CheckpointReader(Path(path))
        model = cls(Path(path), any(n.endswith("_scale") for n in reader.names()))
        model.load_weights(reader.iter_tensors())
        for layer in model.linears:
            if isinstance(layer, W8A8Layer):
                loaded.around_processing(lambda m, lay: m.process_weights_after_loading(lay), ChannelMethod(), layer)
        return model
