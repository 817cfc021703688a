"""The GPU job files (scripts/jobs/, run by scripts/gpu_job.sh on the lent host) checked here, before they cost
device time: each parses as bash and names only NEEDS the runner knows; every TESTS group has the runner's
`name:jobs:engine:node ids` form, a vLLM or SGLang engine and test files that exist, `-k` expressions that select
at least one test of them; every ROWS line names a shape benchmarks/shapes.py knows; a queue lists existing jobs."""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

JOBS = REPO / "scripts" / "jobs"
NEEDS = {"vllm", "sglang", "trainers", "ray", "model", "xqa", "sq"}  # scripts/gpu_job.sh's check()


def _job(path: Path) -> dict:
    """The job file's variables, as the runner reads them (sourced by bash)."""
    names = ("NEEDS", "GPUS", "TESTS", "ROWS", "ROW_ARGS", "RUN", "ENV", "TESTS_GPU", "RUN_GPU")
    script = f"set -u; source {shlex.quote(str(path))}; " + "; ".join(
        f"printf '%s\\0' \"${{{n}:-}}\"" for n in names)
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, f"{path.name}: {out.stderr}"
    return dict(zip(names, out.stdout.split("\0")))


@functools.lru_cache(maxsize=1)
def _node_ids() -> tuple[str, ...]:
    """Every test id pytest collects from the files the job files name (one collection for all of them)."""
    files = sorted({f for path in JOBS.glob("*.job") for line in _job(path)["TESTS"].splitlines()
                    for f in re.findall(r"[\w/]+\.py", line) if (REPO / f).is_file()})
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider",
                          *files], capture_output=True, text=True, cwd=REPO, timeout=300)
    return tuple(line for line in out.stdout.splitlines() if "::" in line)


def _selected(args: list[str]) -> list[str]:
    """The collected ids a group's pytest arguments select: its files (or node ids), `-k` as pytest reads it (a
    name matches when it is a substring of the id's parts, case-insensitively)."""
    from _pytest.mark.expression import Expression

    keyword = args[args.index("-k") + 1] if "-k" in args else None
    targets = [a for a in args if a.endswith(".py") or ".py::" in a]
    expr = Expression.compile(keyword) if keyword else None
    return [i for i in _node_ids() if any(i == t or i.startswith(t + "::") for t in targets)
            and (expr is None or expr.evaluate(lambda name, *_, i=i: name.lower() in i.lower()))]


@pytest.mark.parametrize("path", sorted(JOBS.glob("*.job")), ids=lambda p: p.stem)
def test_a_job_file_names_what_exists(path):
    job = _job(path)
    assert set(job["NEEDS"].split()) <= NEEDS, job["NEEDS"]
    # verl 0.9.1 imports Ray (2 x H200, 2026-11-30: tp2_vllm's verl-code cases failed "No module named 'ray'");
    # only TRL's runs use the trainers' wheels without it
    if "trainers" in job["NEEDS"].split() and path.stem != "trl_grpo":
        assert "ray" in job["NEEDS"].split(), f"{path.name}: verl needs Ray: NEEDS=\"... trainers ray\""
    assert re.fullmatch(r"[1-8]?", job["GPUS"]), job["GPUS"]
    assert job["TESTS"] or job["ROWS"] or job["RUN"], "a job with nothing to run"
    for line in filter(None, job["TESTS"].splitlines()):
        if line == "default":  # gpu_tests.sh's own groups
            continue
        name, jobs, engine, ids = line.split(":", 3)
        assert re.fullmatch(r"[\w-]+", name) and jobs.isdigit() and engine in ("vllm", "sglang"), line
        args = shlex.split(ids)
        files = [a.split("::")[0] for a in args if a.endswith(".py") or ".py::" in a]
        assert files and all((REPO / f).is_file() for f in files), line
        assert _selected(args), f"selects no test: {line}"
        missing = [a for a in args if ".py::" in a and a not in _node_ids()]
        assert not missing, f"node ids pytest does not collect: {missing}"
    if job["ROWS"]:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from shapes import LLAMA3, QWEN3, QWEN3_MOE, QWEN25

        known = {**QWEN25, **QWEN3, **LLAMA3, **QWEN3_MOE, "default": None}
        for line in filter(None, job["ROWS"].splitlines()):
            fields = line.split(":")
            assert re.fullmatch(r"\d+(,\d+)*", fields[0]) and fields[1] in ("vllm", "sglang") and fields[2] in known, line
            gpus = fields[0].count(",") + 1  # a row over several GPUs: rl_step.py's --tp names as many
            assert gpus == 1 or f"--tp {gpus}" in job["ROW_ARGS"], line
        # parts without a GPU run in a lane of their own, beside the rows (H200, 2026-12-02: moe74's tile search ran
        # beside its BF16 row): on one GPU they name the rows' GPU and run before them
        if job["GPUS"] in ("", "1"):
            lanes = {line.split(":")[0] for line in filter(None, job["ROWS"].splitlines())}
            for part in ("TESTS", "RUN"):
                assert not job[part] or job[f"{part}_GPU"] in lanes, f"{path.name}: one GPU: {part}_GPU=0"
    for script in re.findall(r"(?:scripts|benchmarks|examples)/[\w/.-]+\.(?:py|sh)", job["RUN"]):
        assert (REPO / script).is_file(), script


def test_every_queue_lists_jobs_that_exist():
    for queue in JOBS.glob("*.queue"):
        for line in queue.read_text().splitlines():
            name = line.split("#")[0].split()
            if name:
                assert (JOBS / f"{name[0]}.job").is_file(), f"{queue.name}: {name[0]}"


def test_a_group_selecting_nothing_is_caught():
    assert _selected(["-k", "compiled", "tests/test_kernels.py"])
    assert not _selected(["-k", "no_such_case", "tests/test_kernels.py"])
    assert not _selected(["-k", "compiled and not compiled", "tests/test_kernels.py"])
