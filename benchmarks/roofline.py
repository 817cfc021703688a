"""The bytes a rollout must read from memory at least, and a measured rollout's fraction of that bound (issue 74's
goal 5: every goal row records its roofline fraction).

Decode reads every weight once a step and each running sequence's whole context (its KV cache) once a step. With the
forced output lengths of `rl_step.py` (all requests start together; a request of L tokens is decoded over L steps
with contexts P, P + 1, ..., P + L - 1) that is, summed over the rollout,

    bytes = sum over steps t of weights(t) + kv_bytes_per_token * sum over requests of (L P + L (L - 1) / 2)

weights(t): the linear layers' and the LM head's bytes (the embedding reads a row a token: left out); a MoE layer reads
the experts its running sequences route to, E (1 - (1 - k / E)^B) of E for B sequences and k experts a token (uniform
routing, dummy weights). Left out (so the bound is lower still): prefill, norms, activations, sampling, the host.
Where fewer requests run at once (a cap on running sequences, preemption) the steps and weight reads only grow, so
`bound_s` = bytes / the device's peak bandwidth stays a lower bound of the rollout's time and `fraction` =
bound_s / rollout_s is at most 1."""

from __future__ import annotations

from step_bands import BANDS, band_name

from flashrl_tools.quant.formats import QuantFn, Strategy
from flashrl_tools.quant.quantizer import INT4_GROUP

# the devices' HBM bandwidth by spec (SXM parts), TB/s
PEAK_TB_S = {"H200": 4.8, "H100": 3.35, "B200": 8.0, "A100": 2.04}


def _weight_bytes(name: str) -> float | None:
    """Bytes a stored weight element takes under an `rl_step.py` config name (the format table's bits; a BF16 scale a
    group of INT4_GROUP for grouped formats, per-channel / block scales left out); vLLM's online `fp8` 1."""
    if name in ("bf16", "fp8"):
        return 2.0 if name == "bf16" else 1.0
    try:
        fn = QuantFn(name)
    except ValueError:
        return None
    return fn.bits / 8 + (2 / INT4_GROUP if fn.strategy == Strategy.group else 0.0)


def peak_tb_s(device: str) -> float | None:
    """The spec bandwidth of a device named like torch's `get_device_name` ("NVIDIA H200"), None if unknown."""
    return next((bw for name, bw in PEAK_TB_S.items() if name in device), None)


def element_bytes(config: str) -> tuple[float, float] | None:
    """(weight, KV cache) bytes an element for an `rl_step.py` config ("int8+kv": INT8 weights, FP8 KV cache); None
    for a config whose layers differ (a YAML mix)."""
    weights, _, kv = config.partition("+")
    w_bytes = _weight_bytes(weights)
    if w_bytes is None or kv not in ("", "kv"):
        return None
    return w_bytes, 1.0 if kv else 2.0


def expected_experts(experts: int, per_token: int, tokens: int) -> float:
    """Distinct experts `tokens` tokens route to, each to `per_token` of `experts` uniformly."""
    return experts * (1 - (1 - per_token / experts) ** tokens)


def step_bytes(hf_config: dict, config: str, prompt_lens: list[int], out_lens: list[int]) -> list[tuple[int, float]] | None:
    """Per decode step (module docstring): (requests running, least bytes read); None where `config`'s element sizes
    are not uniform."""
    sizes = element_bytes(config)
    if sizes is None:
        return None
    w_bytes, kv_bytes = sizes
    h, layers = hf_config["hidden_size"], hf_config["num_hidden_layers"]
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads", heads)
    head_dim = hf_config.get("head_dim") or h // heads
    attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2  # q, o; k, v
    lm_head = 2.0 * hf_config["vocab_size"] * h  # kept in BF16 by every config
    experts = hf_config.get("num_experts")
    per_token = layers * 2 * kv_heads * head_dim * kv_bytes  # a context token's K and V in every layer

    def weights(running: int) -> float:
        if not experts:
            return layers * w_bytes * (attn + 3 * h * hf_config["intermediate_size"]) + lm_head
        routed = expected_experts(experts, hf_config["num_experts_per_tok"], running)
        return layers * (w_bytes * (attn + routed * 3 * h * hf_config["moe_intermediate_size"])
                         + 2.0 * h * experts) + lm_head  # the router in BF16

    ends = sorted(zip(out_lens, prompt_lens))  # requests leave the batch in order of their lengths
    running, prompts, gone, steps = len(ends), sum(prompt_lens), 0, []
    for t in range(max(out_lens)):
        while ends[gone][0] <= t:  # a request of n tokens decodes at steps 0 .. n - 1
            running, prompts, gone = running - 1, prompts - ends[gone][1], gone + 1
        steps.append((running, weights(running) + per_token * (prompts + running * t)))
    return steps


def rollout_bytes(hf_config: dict, config: str, prompt_lens: list[int], out_lens: list[int]) -> float | None:
    """The rollout's least bytes read (module docstring) for a model's config.json dict; None where `config`'s
    element sizes are not uniform."""
    steps = step_bytes(hf_config, config, prompt_lens, out_lens)
    return None if steps is None else sum(b for _, b in steps)


def band_roofline(steps: list[tuple[int, float]], bands: list[dict], peak: float | None) -> list[dict]:
    """`rl_step.py --step-bands`' measured bands (`step_bands.BANDS`: name, steps, seconds), each with the model's
    `steps` (`step_bytes`) in it, their least bytes, its bound at `peak` TB/s and the fraction of it the band reached."""
    out = []
    for (lo, hi), band in zip(BANDS, bands):
        inside = [b for n, b in steps if lo <= n and (hi is None or n <= hi)]
        total = sum(inside) if inside else 0.0
        bound = total / (peak * 1e12) if peak and steps else None
        out.append({"band": band_name(lo, hi), "model_steps": len(inside), "bytes": total, "bound_s": bound,
                    "fraction": bound / band["seconds"] if bound and band.get("seconds") else None})
    return out


def roofline(hf_config: dict, config: str, prompt_lens: list[int], out_lens: list[int], device: str,
             rollout_s: float, gpus: int = 1, bands: list[dict] | None = None) -> dict:
    """A row's `roofline` entry: its least bytes, the peak bandwidth of its `gpus` devices (tensor parallel: each
    reads its shard), the bound's seconds and the fraction of it the measured rollout reached (None where the
    device's peak or the config's sizes are unknown); with the rollout's measured `bands`, the same per band."""
    steps = step_bytes(hf_config, config, prompt_lens, out_lens)
    total = None if steps is None else sum(b for _, b in steps)
    peak = peak_tb_s(device) * gpus if peak_tb_s(device) else None
    bound = total / (peak * 1e12) if total is not None and peak else None
    entry = {"bytes": total, "peak_tb_s": peak, "bound_s": bound,
             "fraction": bound / rollout_s if bound is not None and rollout_s > 0 else None}
    if bands:
        entry["bands"] = band_roofline(steps or [], bands, peak)
    return entry
