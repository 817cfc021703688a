"""The format table (flashrl_tools/quant/formats.py): every name has its properties, names parse (with
flash-llm-rl's aliases), and a checkpoint's compressed-tensors scheme maps back to its format."""

from __future__ import annotations

import pytest

from flashrl_tools.quant.formats import FORMATS, ROLLOUT, ConfigFn, QuantFn, Strategy
from flashrl_tools.quant.quant_config import quantization_config, scheme_for


def test_every_name_has_one_row():
    assert set(FORMATS) == set(QuantFn) and set(ROLLOUT) == set(ConfigFn)
    # every checkpoint format is a rollout config of the same name serving it
    assert all(ConfigFn(fn.value).quant_fn is fn for fn in QuantFn)


@pytest.mark.parametrize("fn", list(QuantFn))
def test_a_checkpoint_scheme_maps_back_to_its_format(fn):
    """What quant_config writes for a format is read back as that format (profile/build reads
    quantized checkpoints this way)."""
    w = scheme_for(fn).weights
    assert QuantFn.from_scheme(w.type, w.num_bits, w.strategy) is fn
    assert getattr(w.strategy, "value", w.strategy) == fn.strategy.value
    fmt = quantization_config(fn)["format"]
    assert fmt == ("pack-quantized" if fn.packed else "int-quantized" if fn.is_int else "float-quantized")


def test_properties():
    assert [f for f in QuantFn if f.is_int] == [QuantFn.int8, QuantFn.w4a16]
    assert [f for f in QuantFn if f.calibratable] == [QuantFn.int8] and [f for f in QuantFn if f.packed] == [
        QuantFn.w4a16]
    assert {f.strategy for f in QuantFn if f.is_fp8} == set(Strategy) - {Strategy.group}
    assert not ConfigFn.bf16.quantized and ConfigFn.bf16.quant_fn is None
    assert ConfigFn.fp8.vllm_online_fp8 and ConfigFn.fp8.quant_fn is None and ConfigFn.fp8.is_fp8
    assert not ConfigFn.int8.is_fp8 and ConfigFn.fp8_block.is_fp8
    assert QuantFn.from_scheme("int", 4, "group") is QuantFn.w4a16 and QuantFn.from_scheme("int", 4, "channel") is None


def test_names_parse_with_aliases_and_clear_errors():
    assert ConfigFn.parse("fp8_vllm") is ConfigFn.fp8 and ConfigFn.parse("int8_wo_prune") is ConfigFn.int8
    assert QuantFn.parse("fp8_block") is QuantFn.fp8_block
    with pytest.raises(ValueError, match="unknown format 'fp4'.*int8, fp8_channel"):
        QuantFn.parse("fp4")
    with pytest.raises(ValueError, match="unknown fn 'int4'.*bf16, fp8, int8.*fp8_vllm"):
        ConfigFn.parse("int4")
