"""`quantize --fn int8` is bit-identical with llmcompressor's data-free W8A8.

The reference was made once by llmcompressor in its own venv
(scripts/make_llmcompressor_fixture.sh; versions in the fixture's VERSIONS.txt) from a tiny
Llama with hard rows (zero, huge, tiny, outlier). Every tensor is compared: names, dtypes,
shapes, bytes; and the quantization scheme in config.json.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from conftest import FIXTURES, run_cli

FIX = FIXTURES / "llmcompressor_w8a8_tiny"


def test_int8_matches_llmcompressor_bit_for_bit(tmp_path):
    out = tmp_path / "ours"
    res = run_cli("quantize", "-m", FIX / "source", "-o", out, "--fn", "int8")
    assert res.returncode == 0, res.stderr
    ours = load_file(out / "model.safetensors")
    ref = load_file(FIX / "reference" / "model.safetensors")
    assert sorted(ours) == sorted(ref)
    assert sum(k.endswith("weight_scale") for k in ref) == 14
    for name, expected in ref.items():
        got = ours[name]
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        assert torch.equal(got, expected), f"{name}: {(got != expected).sum().item()} entries differ"


def test_int8_config_matches_llmcompressor_scheme(tmp_path):
    out = tmp_path / "ours"
    assert run_cli("quantize", "-m", FIX / "source", "-o", out, "--fn", "int8").returncode == 0
    ours = json.loads((out / "config.json").read_text())["quantization_config"]
    ref = json.loads((FIX / "reference" / "config.json").read_text())["quantization_config"]
    for key in ("quant_method", "format", "quantization_status", "ignore"):
        assert ours[key] == ref[key], key
    for part in ("weights", "input_activations"):
        a, b = ours["config_groups"]["group_0"][part], ref["config_groups"]["group_0"][part]
        for field in ("num_bits", "type", "symmetric", "strategy", "dynamic", "group_size"):
            assert a[field] == b[field], (part, field)
    assert ours["config_groups"]["group_0"]["targets"] == ref["config_groups"]["group_0"]["targets"]
