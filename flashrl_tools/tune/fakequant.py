"""The BF16 policy in transformers with any set of units (mixed.units) fake-quantized (8-bit, or W4A16 where it
can be served), and the token KL of that model from the BF16 one on fixed sequences: the ranking signal of
`flashrl tune`.

A quantized linear computes with the dequantized 8-bit weight and a dynamically fake-quantized
input, as the engine's W8A8 / FP8 kernels do (quantizer.py has the math). Under a SmoothQuant
profile the weight lives in smoothed column space: its input is divided by the smoothing factor
(what the divided norm does in the engine), rows divided by smooth_out are multiplied back.
Computed in fp32: the ranking is of quantization error, not of BF16 rounding. On the GPU when
there is one (the fp32 forwards of the ranking are most of `tune`'s time on a CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from flashrl_tools.quant.formats import LAYERS_4BIT
from flashrl_tools.quant.mixed import units
from flashrl_tools.profile.format import Profile
from flashrl_tools.quant.quantizer import (INT4_GROUP, QuantFn, dequantize, fake_quant_activation, quantize_weight,
                                          requantize_int8)


@dataclass
class _Linear:
    module: torch.nn.Linear
    original: torch.Tensor  # fp32 weight
    quantized: torch.Tensor  # fp32 dequantized weight (column-smoothed under a profile)
    col_div: torch.Tensor | None  # the input is divided by this before the 8-bit matmul
    four: torch.Tensor | None = None  # fp32 dequantized W4A16 weight (BF16 activations), where it can be served


class FakeQuantModel:
    def __init__(self, model_dir: Path, fn: QuantFn, linear_weights: set[str], profile: Profile | None = None,
                 pow2: bool = False):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.fn = fn
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval().to(self.device)
        bf16 = {n: p.detach().to(torch.bfloat16) for n, p in self.model.named_parameters()}
        self.units = units(linear_weights)
        self.linears: dict[str, _Linear] = {}
        for weights in self.units.values():
            for name in weights:
                module = self.model.get_submodule(name.removesuffix(".weight"))
                quantized, col_div = _fake_weight(fn, name, bf16[name], profile, pow2)
                four = None if profile is not None or bf16[name].shape[1] % INT4_GROUP else \
                    dequantize(LAYERS_4BIT, quantize_weight(LAYERS_4BIT, bf16[name]))
                self.linears[name] = _Linear(module, module.weight.detach().clone(), quantized, col_div, four)
        self._hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}
        self.unit_bytes = {u: sum(self.linears[n].original.numel() * 2 for n in ws) for u, ws in self.units.items()}

    def four_bit_ok(self, unit: str) -> bool:
        """Whether a unit can be served W4A16 (input columns in groups of 128, no calibrated profile, no experts)."""
        return not unit.endswith(".experts") and all(self.linears[n].four is not None for n in self.units[unit])

    def set_quantized(self, quantized_units: set[str], four_bit_units: set[str] = frozenset()) -> None:
        """Quantize exactly these units, `four_bit_units` to W4A16 (the others compute with the original weights)."""
        for unit, weights in self.units.items():
            four = unit in four_bit_units
            on = unit in quantized_units and not four
            for name in weights:
                lin = self.linears[name]
                lin.module.weight.data = lin.four if four else lin.quantized if on else lin.original
                if on and name not in self._hooks:
                    self._hooks[name] = lin.module.register_forward_pre_hook(self._input_hook(lin))
                elif not on and name in self._hooks:
                    self._hooks.pop(name).remove()

    def _input_hook(self, lin: _Linear):
        def hook(module, args):
            x = args[0]
            if lin.col_div is not None:
                x = x / lin.col_div
            return (fake_quant_activation(self.fn, x),) + tuple(args[1:])
        return hook

    @torch.no_grad()
    def cache_layer_outputs(self, batch: SequenceBatch) -> None:
        """Record every decoder layer's output with nothing quantized: a later evaluation whose
        first quantized unit sits in layer L replays layers < L from here (identical inputs)."""
        self.set_quantized(set())
        outputs: list[torch.Tensor] = []
        layers = self.model.model.layers
        hooks = [layer.register_forward_hook(lambda m, a, out: outputs.append(out)) for layer in layers]
        try:
            self.model.model(input_ids=batch.ids, attention_mask=batch.mask)
        finally:
            for h in hooks:
                h.remove()
        self._cached = (batch, outputs)

    @torch.no_grad()
    def response_logprobs(self, batch: SequenceBatch, replay_layers: int = 0) -> torch.Tensor:
        """log-softmax at every response position [positions, vocab] (fp32). The first
        `replay_layers` decoder layers return their cached unquantized outputs (they must hold
        no quantized unit)."""
        layers = self.model.model.layers
        cached = getattr(self, "_cached", None)
        replay = replay_layers if cached is not None and cached[0] is batch else 0
        for i in range(replay):
            layers[i].forward = (lambda out: lambda *a, **k: out)(cached[1][i])
        try:
            hidden = self.model.model(input_ids=batch.ids, attention_mask=batch.mask).last_hidden_state
        finally:
            for i in range(replay):
                del layers[i].forward
        logits = self.model.lm_head(hidden[batch.rows, batch.cols])  # response positions only
        return torch.log_softmax(logits.float(), dim=-1)


def _fake_weight(fn: QuantFn, name: str, w: torch.Tensor, profile: Profile | None, pow2: bool = False):
    entry = profile.linear(name) if profile is not None else None
    if entry is None:
        return dequantize(fn, quantize_weight(fn, w, pow2)), None
    on = lambda t: t.to(w.device) if t is not None else None  # noqa: E731 (profile tensors live on the CPU)
    scale, smooth_in, smooth_out = on(entry.weight_scale), on(entry.smooth_in), on(entry.smooth_out)
    q = requantize_int8(w, scale, smooth_in, smooth_out)
    deq = q.float() * scale.float()
    if smooth_out is not None:
        deq = deq * smooth_out.float()[:, None]
    return deq, (smooth_in.float() if smooth_in is not None else None)


@dataclass
class SequenceBatch:
    ids: torch.Tensor  # [B, L] right-padded
    mask: torch.Tensor
    rows: torch.Tensor  # response positions (row, col) whose logits predict a response token
    cols: torch.Tensor

    @classmethod
    def of(cls, prompts: list[list[int]], responses: list[list[int]]) -> SequenceBatch:
        width = max(len(p) + len(r) for p, r in zip(prompts, responses))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        rows, cols = [], []
        for i, (p, r) in enumerate(zip(prompts, responses)):
            seq = torch.tensor(p + r)
            ids[i, :len(seq)], mask[i, :len(seq)] = seq, 1
            rows += [i] * len(r)
            cols += range(len(p) - 1, len(p) + len(r) - 1)
        return cls(ids, mask, torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long))

    def to(self, device) -> SequenceBatch:
        return SequenceBatch(self.ids.to(device), self.mask.to(device), self.rows.to(device), self.cols.to(device))


def token_kl(logq: torch.Tensor, logp: torch.Tensor) -> float:
    """Mean over positions of KL(q || p): q the rollout (quantized) policy, p the trainer's."""
    return float((logq.exp() * (logq - logp)).sum(-1).mean())


@torch.no_grad()
def sample_responses(model, prompts: list[list[int]], max_tokens: int, seed: int) -> list[list[int]]:
    """The BF16 policy's own T=1 samples (transformers generate), one per prompt, EOS included."""
    torch.manual_seed(seed)
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=model.device)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_p=1.0,
                             top_k=0, max_new_tokens=max_tokens, pad_token_id=model.config.eos_token_id)
        resp = gen[0, len(p):].tolist()
        eos = model.config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        cut = next((i + 1 for i, t in enumerate(resp) if t in eos), len(resp))
        out.append(resp[:cut])
    return out
