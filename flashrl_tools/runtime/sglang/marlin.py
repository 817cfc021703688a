"""SGLang's compressed-tensors W4A16 linears (issue 75): its Marlin scheme (`CompressedTensorsWNA16`) re-lays the
loaded `weight_packed` ([N, K / 8] int32 codes) and `weight_scale` ([N, K / group]) out into new tensors after
loading (`gptq_marlin_repack`, `marlin_permute_scales`) and rebinds the loaded Parameters to them, so a second load
through its loaders would land nowhere the kernel reads. Per such layer this process keeps the loaded tensors (their
storage and layout: what the loaders write; +0.5 byte a weight) beside the processed ones. A sync writes the loaded
tensors through SGLang's own loaders (weight_sync.py), then `write` recomputes the processed layout from them with
the scheme's own ops and kernel config and copies it into the tensors the kernel -- and a captured CUDA graph --
reads. At start `check` holds the recomputation to SGLang's processing bit for bit, or the engine is refused.

SGLang 0.5.17 sums Marlin's split-K partials with atomic adds on Hopper where N < 2048 <= K
(`should_use_atomic_add_reduce`, its environment switch hard-wired on; its W4A16 MoE GEMMs always, but flashrl refuses
4-bit experts on SGLang). Their order varies from run to run, and so may an engine's logprobs (H200, 2026-11-30: on
the GPU tests' model, whose down projections take that path, every sync path ended 0.015-0.018 from a fresh engine),
so no sync could be checked exact. `no_atomic_add` keeps Marlin's fixed-order reduction, vLLM's default
(VLLM_MARLIN_USE_ATOMIC_ADD unset)."""

from __future__ import annotations

import importlib

import torch

from flashrl_tools.errors import FlashRLError

SCHEME = "CompressedTensorsWNA16"
SCHEME_MODULE = "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16"  # its ops too
REPACKED = ("weight_packed", "weight_scale")
_DIMS = ("_input_dim", "_output_dim", "_packed_dim")  # the layout attributes SGLang's processing rewrites


def is_w4a16(layer: torch.nn.Module) -> bool:
    """A layer SGLang serves through its compressed-tensors WNA16 (Marlin) scheme."""
    return type(getattr(layer, "scheme", None)).__name__ == SCHEME


class MarlinLayer:
    """One W4A16 layer: its loaded Parameters (taken before SGLang processes the layer) and its processed tensors."""

    def __init__(self, layer: torch.nn.Module):
        self.layer = layer
        self.params = {n: layer._parameters[n] for n in REPACKED}
        self.data = {n: p.data for n, p in self.params.items()}
        self.dims = {n: {a: getattr(p, a) for a in _DIMS if hasattr(p, a)} for n, p in self.params.items()}

    def restore(self) -> dict[str, torch.nn.Parameter]:
        """After SGLang's processing: the loaded Parameters hold their loaded tensors and layout again (processing
        permuted and rebound them); returns them (what the loaders write into)."""
        for name, param in self.params.items():
            param.data = self.data[name]
            for attr, value in self.dims[name].items():
                setattr(param, attr, value)
        return self.params

    def processed(self) -> dict[str, torch.Tensor]:
        """What SGLang's processing makes of the loaded tensors as they are now: the scheme module's own
        `gptq_marlin_repack` / `marlin_permute_scales`, its kernel config, the layer's `g_idx_sort_indices`."""
        config, ops = self.layer.scheme.kernel_config, importlib.import_module(SCHEME_MODULE)
        if getattr(config, "has_g_idx", False) or getattr(config, "zero_points", False):
            raise FlashRLError(f"flashrl: SGLang's {SCHEME} layer uses activation order or zero points; flashrl's "
                               "W4A16 is symmetric without them", None, "serve a checkpoint of `flashrl quantize`")
        k, n = config.partition_weight_shape
        codes, scales = (self._as_kn(name) for name in REPACKED)
        return {"weight_packed": ops.gptq_marlin_repack(codes, perm=self.layer.g_idx_sort_indices, size_k=k,
                                                        size_n=n, num_bits=config.weight_type.size_bits),
                "weight_scale": ops.marlin_permute_scales(scales, size_k=k, size_n=n, group_size=config.group_size)}

    def _as_kn(self, name: str) -> torch.Tensor:
        """The loaded tensor with its input dimension first (the permutation SGLang's processing starts with)."""
        inp, out = self.dims[name].get("_input_dim"), self.dims[name].get("_output_dim")
        inp = (out + 1) % 2 if inp is None else inp  # as SGLang's permute_param_layout_ completes a 2-D layout
        out = (inp + 1) % 2 if out is None else out
        return self.data[name].permute(inp, out).contiguous()

    def check(self) -> None:
        """At start, right after SGLang processed the layer: the recomputation equals what its kernel reads."""
        try:
            recomputed = self.processed()
        except FlashRLError:
            raise
        except Exception as e:  # noqa: BLE001 -- e.g. a build whose scheme module lacks the ops: refused, one line
            raise FlashRLError(f"flashrl: cannot recompute SGLang's {SCHEME} layout ({type(e).__name__}: {e}); its "
                               "weight syncs could not be exact", None,
                               "serve int8 or fp8 (per-channel) with SGLang, or run 4-bit rollouts on vLLM") from None
        for name, tensor in recomputed.items():
            now = self.layer._parameters[name]
            if now.shape != tensor.shape or not torch.equal(now.data, tensor):
                raise FlashRLError(f"flashrl: SGLang's {SCHEME} processing of `{name}` is not what flashrl "
                                   "recomputes from the loaded tensors; its weight syncs could not be exact", None,
                                   "serve int8 or fp8 (per-channel) with SGLang, or run 4-bit rollouts on vLLM")

    def write(self) -> None:
        """After a sync wrote the loaded tensors: the processed layout, copied into the kernel's tensors."""
        for name, tensor in self.processed().items():
            self.layer._parameters[name].data.copy_(tensor)


def no_atomic_add(original, *args, **kwargs) -> bool:
    """AROUND marlin_utils.should_use_atomic_add_reduce: Marlin's linears reduce in a fixed order (never atomic)."""
    return False

