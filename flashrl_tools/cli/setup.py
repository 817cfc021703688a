"""`flashrl setup`: write the patcher YAML that FLASHRL_CONFIG points at."""

from __future__ import annotations

from pathlib import Path

import typer

from flashrl_tools.cli.common import out
from flashrl_tools.fsutil import check_writable
from flashrl_tools.setup.write import build_entry, parse_assignments, setup


def command(
    model: Path = typer.Option(None, "-m", "--model", help="the 8-bit checkpoint (with a profile)"),
    profile: Path = typer.Option(None, "-p", "--profile", help="profile file from `flashrl profile`"),
    fn: str = typer.Option("int8", "--fn", help="bf16 | fp8 | int8 | fp8_channel | fp8_tensor | fp8_block | w4a16"),
    output: Path = typer.Option(Path("~/.flashrl_config.yaml"), "-o", "--config-output",
                                help="config file to write"),
    append: bool = typer.Option(False, "-a", "--append", help="add an entry to an existing file"),
    fields: list[str] = typer.Argument(None, help="extra key=value fields (YAML values)"),
) -> None:
    """Write (or append to) a flash-llm-rl compatible config; set FLASHRL_CONFIG to its path."""
    path = output.expanduser()
    check_writable(path, "-o")
    entry = build_entry(fn, model, profile, parse_assignments(fields or []))
    config = setup(path, entry, append=append)
    out.print(f"wrote {path} ({len(config.configs)} config(s)); use it with FLASHRL_CONFIG={path}",
              highlight=False, soft_wrap=True)
