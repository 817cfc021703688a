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


def test_vllm_is_imported_in_runtime_vllm_only():
    """Outside runtime/vllm/, only verify's engine job (a subprocess that runs one engine) imports vLLM."""
    allowed = {"flashrl_tools.verify.engine_job"}
    users = set()
    for name, f in _modules().items():
        for node in ast.walk(ast.parse(f.read_text())):
            mods = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                    [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if any(m == "vllm" or m.startswith("vllm.") for m in mods):
                users.add(name)
    assert {u for u in users if not u.startswith("flashrl_tools.runtime.vllm")} <= allowed


def test_no_runtime_module_over_300_lines():
    long = {str(f.relative_to(REPO)): n for f in (PKG / "runtime").rglob("*.py")
            if (n := len(f.read_text().splitlines())) > 300}
    assert long == {}
