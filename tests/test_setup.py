"""`flashrl setup` and the config schema shared with the runtime."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import REPO, run_cli
from flashrl_tools.errors import FlashRLError
from flashrl_tools.config.schema import ConfigFn, load_config, parse_config
from flashrl_tools.config.defaults import DEFAULTS
from flashrl_tools.setup.write import build_entry


@pytest.fixture(scope="module")
def sq_profile_file(sq_profile) -> Path:
    return sq_profile[0]


def test_setup_writes_a_flashrl_compatible_yaml(smoothquant_checkpoint, sq_profile_file, tmp_path):
    cfg = tmp_path / "config.yaml"
    res = run_cli("setup", "-m", smoothquant_checkpoint, "-p", sq_profile_file, "--fn", "int8", "-o", cfg,
                  "distributed_executor_backend=mp", "module_attribute_to_preserve=[workspace, foo]",
                  "logprobs_mode=processed_logprobs")
    assert res.returncode == 0, res.stderr
    data = yaml.safe_load(cfg.read_text())
    assert data["version"] == 1 and len(data["configs"]) == 1
    entry = data["configs"][0]
    for key in ("fn", "model", "profile", "load_format", "distributed_executor_backend",
                "module_attribute_to_preserve", "quantization"):
        assert key in entry
    assert entry["fn"] == "int8" and entry["model"] == str(smoothquant_checkpoint.resolve())
    assert entry["distributed_executor_backend"] == "mp"
    assert entry["module_attribute_to_preserve"] == ["workspace", "foo"]
    assert len(entry["profile_sha256"]) == 64
    res = run_cli("setup", "--fn", "fp8", "-o", cfg, "--append")
    assert res.returncode == 0, res.stderr
    loaded = load_config(cfg)
    assert [c.fn for c in loaded.configs] == [ConfigFn.int8, ConfigFn.fp8]


def test_values_are_yaml_never_eval(tmp_path):
    cfg = tmp_path / "c.yaml"
    res = run_cli("setup", "--fn", "bf16", "-o", cfg, "distributed_executor_backend=__import__('os').getcwd()")
    assert res.returncode == 0, res.stderr
    assert load_config(cfg).configs[0].distributed_executor_backend == "__import__('os').getcwd()"


def test_unknown_key_names_it_and_the_allowed_ones(tmp_path):
    res = run_cli("setup", "--fn", "int8", "-o", tmp_path / "c.yaml", "profiel=x")
    assert res.returncode != 0
    msg = res.stderr.strip()
    assert msg.startswith("error: unknown key 'profiel'") and "allowed keys: fn, model, profile" in msg
    assert not (tmp_path / "c.yaml").exists()
    with pytest.raises(FlashRLError, match="unknown key 'extra'"):
        parse_config({"configs": [{"fn": "int8"}], "extra": 1}, "test")


def test_profile_of_another_checkpoint_is_refused(default_int8, sq_profile_file, tmp_path):
    res = run_cli("setup", "-m", default_int8, "-p", sq_profile_file, "--fn", "int8", "-o", tmp_path / "c.yaml")
    assert res.returncode != 0 and "profile was made from another checkpoint" in res.stderr
    res = run_cli("setup", "-m", default_int8, "-p", sq_profile_file, "--fn", "fp8_channel", "-o", tmp_path / "c.yaml")
    assert res.returncode != 0 and "profile is for fn int8" in res.stderr
    assert not (tmp_path / "c.yaml").exists()


def test_flash_llm_rl_spellings_and_bad_values():
    assert build_entry("fp8_vllm", None, None, {}).fn is ConfigFn.fp8
    assert build_entry("int8_wo_prune", None, None, {}).fn is ConfigFn.int8
    with pytest.raises(FlashRLError, match="int8_prune"):
        build_entry("int8_prune", None, None, {})
    with pytest.raises(FlashRLError, match="a profile needs `model`"):
        parse_config({"configs": [{"fn": "int8", "profile": "p.safetensors"}]}, "t")
    with pytest.raises(FlashRLError, match="invalid value 'int4'"):
        parse_config({"configs": [{"fn": "int4"}]}, "t")


@pytest.mark.parametrize("fn", ["bf16", "fp8", "int8"])
def test_shipped_configs_are_the_shortcuts(fn):
    shipped = load_config(REPO / "configs" / f"{fn}.yaml")
    assert len(shipped.configs) == 1
    assert shipped.configs[0] == parse_config({"configs": [DEFAULTS[fn]]}, "defaults").configs[0]
