"""Tuned tile tables for vLLM's Triton fused-MoE GEMM where vLLM ships none (issue 74, goal 3).

vLLM 0.26 serves compressed-tensors INT8 experts with dynamic activations as `int8_w8a16` (no static input
scales) through its Triton `fused_experts`, and ships no `int8_w8a16` table for any GPU: every batch size takes
`get_default_config`. `benchmarks/moe_tune.py` times the tile configurations on a GPU and writes vLLM's own table
format under vLLM's own file name into `TABLES`; AROUND `fused_moe.get_moe_configs` this module answers from
there only where vLLM found nothing (the user's VLLM_TUNED_CONFIG_FOLDER and vLLM's tables come first) and never
under VLLM_BATCH_INVARIANT. A table changes the tiles only: a synced engine and a fresh one take the same table.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

log = logging.getLogger("flashrl_tools.runtime")
LOG_LINE = "Triton fused-MoE tiles from flashrl's tuned table"  # logged once per table and process (rl_step reads it)
TABLES = Path(__file__).with_name("moe_configs")
CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")


def check_table(table: dict) -> dict[int, dict[str, int]]:
    """vLLM's table format ({"tokens": config, ...}, an optional "triton_version") as {tokens: config}; raises
    ValueError naming the first bad entry."""
    out = {}
    for key, config in table.items():
        if key == "triton_version":
            continue
        if not str(key).isdigit() or int(key) < 1:
            raise ValueError(f"batch size {key!r} is not a positive integer")
        if not isinstance(config, dict) or set(config) != set(CONFIG_KEYS):
            raise ValueError(f"batch size {key}: keys {sorted(config) if isinstance(config, dict) else config!r}, "
                             f"expected {list(CONFIG_KEYS)}")
        for name, value in config.items():
            if not isinstance(value, int) or value < 1 or (name != "num_stages" and value & (value - 1)):
                raise ValueError(f"batch size {key}: {name}={value!r} is not a positive power of two")
        out[int(key)] = dict(config)
    if not out:
        raise ValueError("no batch size")
    return out


def load(path: Path) -> dict[int, dict[str, int]] | None:
    """A table file as {tokens: config}; None where there is no file."""
    return check_table(json.loads(path.read_text())) if path.is_file() else None


@functools.cache
def _ours(E, N, dtype, block_n, block_k) -> dict[int, dict[str, int]] | None:
    from vllm import envs
    from vllm.model_executor.layers.fused_moe import fused_moe

    if envs.VLLM_BATCH_INVARIANT:
        return None
    block_shape = [block_n, block_k] if block_n and block_k else None
    name = fused_moe.get_config_file_name(E, N, dtype, block_shape)
    table = load(TABLES / name)
    if table is not None:
        log.info("%s %s", LOG_LINE, name)
    return table


def get_moe_configs(original, E, N, dtype, block_n=None, block_k=None):
    """AROUND vLLM's `get_moe_configs(E, N, dtype, block_n, block_k)` (cached, as vLLM's is): vLLM's answer,
    else flashrl's table of the same file name, else None (vLLM's default configuration)."""
    found = original(E, N, dtype, block_n, block_k)
    return found if found is not None else _ours(E, N, dtype, block_n, block_k)
