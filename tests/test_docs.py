"""The pages say what is true now (issue 73): every path of this repository that a page names exists, and every
runtime module is named in DEVELOPERS.md or its engine's docs/internals page."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO

PAGES = [REPO / "README.md", REPO / "DEVELOPERS.md", REPO / "scripts" / "GPU.md", REPO / "benchmarks" / "RESULTS.md",
         *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "examples").rglob("*.md"))]
PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)+[\w.-]+\.(?:py|sh|md|json|jsonl|yaml|png|toml|txt|log))(?![\w/])")
OUTPUT = re.compile(r"(?:-o|--out|--json|--report|-d|>)\s*$")  # a command's output, not a file that must exist
PACKAGE = REPO / "flashrl_tools"
# where a page's relative path is read from: the repository, the package (runtime/..., quant/...), the runtime
# (vllm/..., core/...), benchmarks/ (results/...)
ROOTS = {**{p.name: REPO for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".")},
         **{p.name: PACKAGE for p in PACKAGE.iterdir() if p.is_dir()},
         **{p.name: PACKAGE / "runtime" for p in (PACKAGE / "runtime").iterdir() if p.is_dir()},
         "results": REPO / "benchmarks"}


def named_paths(page: Path) -> list[tuple[str, Path]]:
    """(as written, where it must be) for each path of this repository the page names."""
    text, out = page.read_text(), []
    for m in PATH.finditer(text):
        written = m.group(1)
        root = ROOTS.get(written.split("/", 1)[0])
        if root is None or OUTPUT.search(text[max(0, m.start() - 10):m.start()]):
            continue  # another package's source (an engine's), a user's path, or an output
        out.append((written, root / written))
    return out


def test_every_path_a_page_names_exists():
    missing = [f"{page.relative_to(REPO)}: {written}" for page in PAGES for written, path in named_paths(page)
               if not path.exists() and not (page.parent / written).exists()]
    assert missing == []


def test_the_path_check_reads_paths_as_written():
    page = REPO / "DEVELOPERS.md"
    found = dict(named_paths(page))
    assert found["runtime/core/digest.py"] == PACKAGE / "runtime" / "core" / "digest.py"
    assert all(p.suffix for p in found.values())


def test_every_runtime_module_is_named_in_the_developer_map():
    developers = (REPO / "DEVELOPERS.md").read_text()
    unnamed = []
    for module in sorted((PACKAGE / "runtime").rglob("*.py")):
        internals = REPO / "docs" / "internals" / f"{module.parent.name}.md"
        text = developers + (internals.read_text() if internals.is_file() else "")
        if module.name != "__init__.py" and module.name not in text:
            unnamed.append(str(module.relative_to(PACKAGE)))
    assert unnamed == []
