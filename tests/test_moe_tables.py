"""flashrl's tuned tile tables for vLLM's Triton fused-MoE GEMM (runtime/vllm/moe_tables.py) and the tuner that
writes them (benchmarks/moe_tune.py): vLLM's own lookup answers from a table only where vLLM has none."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO
from flashrl_tools.runtime.core.adapter import Hook, HookKind
from flashrl_tools.runtime.core.hooks import wrap
from flashrl_tools.runtime.vllm import moe_tables

sys.path.insert(0, str(REPO / "benchmarks"))
import moe_tune  # noqa: E402

fused_moe = pytest.importorskip("vllm.model_executor.layers.fused_moe.fused_moe")
W1, W2 = (128, 1536, 2048), (128, 2048, 768)  # Qwen3-30B-A3B's experts: E, 2N, K / E, K, N
TABLE = {16: {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4,
              "num_stages": 4},
         64: {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 8,
              "num_stages": 3}}


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """flashrl's tables in tmp_path; vLLM's `get_moe_configs` wrapped by the hook as the adapter installs it."""
    monkeypatch.setattr(moe_tables, "TABLES", tmp_path)
    hook = Hook("moe_tables", "x.get_moe_configs", moe_tables.get_moe_configs, HookKind.AROUND, "worker", "")
    monkeypatch.setattr(fused_moe, "get_moe_configs", wrap(fused_moe.get_moe_configs, hook))
    moe_tables._ours.cache_clear()
    yield tmp_path
    moe_tables._ours.cache_clear()


def test_vllm_takes_flashrl_table_only_where_it_has_none(tables, monkeypatch):
    int8 = fused_moe.get_config_file_name(128, 768, "int8_w8a16")
    moe_tune.write_table(TABLE, tables / int8)
    assert json.loads((tables / int8).read_text())["64"] == TABLE[64] and not list(tables.glob("*.tmp"))
    for m, key in ((1, 16), (40, 16), (41, 64), (4096, 64)):  # vLLM's nearest batch size
        assert fused_moe.try_get_optimal_moe_config(W1, W2, 8, "int8_w8a16", m) == TABLE[key]
    # no flashrl table for this dtype (BF16 experts): vLLM's own answer, unchanged
    assert fused_moe.try_get_optimal_moe_config(W1, W2, 8, None, 64) == fused_moe.get_default_config(
        64, 128, 768, 2048, 8, None)
    # vLLM's answer (the user's VLLM_TUNED_CONFIG_FOLDER, its own tables) comes first
    theirs = {1: dict(TABLE[16], BLOCK_SIZE_N=32)}
    assert moe_tables.get_moe_configs(lambda *a: theirs, 128, 768, "int8_w8a16") is theirs
    moe_tables._ours.cache_clear()
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")  # batch invariance: vLLM's fixed tiles, never a table
    assert moe_tables.get_moe_configs(lambda *a: None, 128, 768, "int8_w8a16") is None


def test_tables_are_checked():
    for path in moe_tables.TABLES.glob("*.json"):  # the shipped tables: vLLM's file names, valid entries
        assert re.fullmatch(r"E=\d+,N=\d+,device_name=\w+(,dtype=\w+)?(,block_shape=\[\d+,\d+\])?\.json", path.name)
        assert moe_tables.check_table(json.loads(path.read_text()))
    good = {"triton_version": "3.6.0", "16": TABLE[16]}
    assert moe_tables.check_table(good) == {16: TABLE[16]}
    for bad, why in (({"x": TABLE[16]}, "not a positive integer"), ({"16": {"BLOCK_SIZE_M": 16}}, "expected"),
                     ({"16": dict(TABLE[16], BLOCK_SIZE_N=48)}, "power of two"), ({}, "no batch size"),
                     ({"16": dict(TABLE[16], num_warps=0)}, "power of two")):
        with pytest.raises(ValueError, match=why):
            moe_tables.check_table(bad)


def test_moe_tune_search_space_and_its_refusals(tmp_path):
    assert moe_tune.shape_dims("30b-a3b") == (128, 768, 2048, 8)
    mixtral = {"architectures": ["MixtralForCausalLM"], "num_local_experts": 8, "intermediate_size": 14336,
               "hidden_size": 4096, "num_experts_per_tok": 2}
    (tmp_path / "mixtral").mkdir()
    (tmp_path / "mixtral" / "config.json").write_text(json.dumps(mixtral))
    assert moe_tune.shape_dims(str(tmp_path / "mixtral"), tp=2) == (8, 7168, 4096, 2)
    (tmp_path / "dense.json").write_text(json.dumps({"hidden_size": 4096, "intermediate_size": 12288}))
    for shape, tp, why in (("mixtral", 3, "does not split into 3"), ("dense.json", 1, "not a MoE model"),
                           ("nowhere", 1, "nor a model's config.json")):
        with pytest.raises(ValueError, match=why):
            moe_tune.shape_dims(str(tmp_path / shape), tp)
    assert moe_tune.block_ms(64, 8, 128) == [16] and moe_tune.block_ms(256, 8, 128) == [16, 32]
    assert moe_tune.block_ms(4096, 8, 128) == [16, 32, 64, 128]
    small, big = moe_tune.candidates(64, 8, 128), moe_tune.candidates(4096, 8, 128)
    assert len(small) == 60 and all(c["GROUP_SIZE_M"] == 1 for c in small)  # one M tile an expert: no grouping
    assert len(big) == 480 and all(set(c) == set(moe_tables.CONFIG_KEYS) for c in big)
    near = sorted(small, key=lambda c: moe_tune.distance(c, TABLE[16]))
    assert near[0] == TABLE[16] and moe_tune.distance(near[-1], TABLE[16]) > 0
    with pytest.raises(ValueError, match="power of two"):
        moe_tune.write_table({16: dict(TABLE[16], BLOCK_SIZE_K=96)}, tmp_path / "out" / "t.json")
    assert not (tmp_path / "out").exists()  # checked before anything is written
    script = str(REPO / "benchmarks" / "moe_tune.py")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    for args, why in ((["--shapes", "14b"], "nor a model's config.json"), (["--tokens", "4,x"], "positive integers"),
                      (["--shapes", str(tmp_path / "mixtral"), "--tp", "3"], "does not split"),
                      (["--out", str(tmp_path / "dense.json" / "tables")], "is not a folder you can write"),
                      (["--tokens", "0"], "positive integers"), ([], "needs a CUDA GPU")):
        res = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=env, timeout=120)
        assert res.returncode != 0 and why in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_a_failing_tile_leaves_no_override_behind():
    """vLLM's override_config restores the old tile only when its body returns: a tile the shared memory cannot
    hold (Triton's OutOfResources) stayed in force for every later call (vLLM's own choice and BF16's timed on it)."""
    import vllm.model_executor.layers.fused_moe as fm

    assert fm.get_config() is None
    with pytest.raises(RuntimeError), moe_tune.tile(TABLE[16]):
        assert fm.get_config()["BLOCK_SIZE_N"] == 64
        raise RuntimeError("out of resource: shared memory")
    assert fm.get_config() is None
    with moe_tune.tile(TABLE[64]):
        assert fm.get_config()["BLOCK_SIZE_N"] == 256
    assert fm.get_config() is None
