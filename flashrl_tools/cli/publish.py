"""`flashrl publish`: push a config, its profiles and a model card to the Hub in one commit."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from flashrl_tools.cli.common import err, out
from flashrl_tools.publish.push import publish


def command(
    config: Path = typer.Argument(..., help="config YAML written by `flashrl setup`"),
    repo: str = typer.Option(..., "--repo", help="Hub model repo USER/NAME (created if missing)"),
    path_in_repo: str = typer.Option("", "--path-in-repo", help="folder in the repo (default: its root)"),
    private: bool = typer.Option(False, "--private", help="create the repo private"),
    revision: str = typer.Option(None, "--revision", help="branch to commit to (created if missing; default main)"),
    model_repo: str = typer.Option(None, "--model-repo",
                                   help="USER/NAME or USER/NAME@REV of the 8-bit checkpoint on the Hub: written as the "
                                        "config's `model` instead of the local path"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print what would be uploaded; upload nothing"),
    token: str = typer.Option(None, "--token", help="Hub token (default: HF_TOKEN or the saved login)"),
) -> None:
    """Publish CONFIG.yaml (+ profiles, model card) and print the pinned FLASHRL_CONFIG line."""
    res = publish(config, repo, path_in_repo=path_in_repo, private=private, revision=revision,
                  token=token, model_repo=model_repo, dry_run=dry_run)
    for warning in res.bundle.warnings:
        err.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=True)
    table = Table(title=f"{'would upload' if dry_run else 'uploaded'} to {repo}@{res.revision}")
    for col in ("path in repo", "bytes", "sha256"):
        table.add_column(col)
    for u in res.bundle.uploads:
        table.add_row(u.path_in_repo, str(u.size), u.sha256[:16])
    out.print(table)
    if dry_run:
        from flashrl_tools.config.schema import dump_config

        out.print(f"# {res.bundle.config_path}\n{dump_config(res.bundle.config)}", highlight=False, markup=False,
                  soft_wrap=True)
        out.print(f"dry run: nothing uploaded; after publishing: {res.bundle.line('<commit>')}", highlight=False,
                  markup=False, soft_wrap=True)
        return
    out.print(res.line, highlight=False, soft_wrap=True)
