"""The `flashrl` entry point."""

from __future__ import annotations

import sys

import typer

from flashrl_tools.cli import models, profile, publish, quantize, setup, tune, verify
from flashrl_tools.cli.common import err, out
from flashrl_tools.cli.version import version_text
from flashrl_tools.errors import FlashRLError

app = typer.Typer(
    name="flashrl",
    help="8-bit (INT8/FP8) rollouts in vLLM for RL training: quantize, profile, setup, verify, publish.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version_callback(value: bool) -> None:
    if value:
        out.print(version_text(), highlight=False)
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version_callback,
                                       is_eager=True, help="print versions and exit")) -> None:
    pass


@app.command("version")
def version() -> None:
    """Print the versions of flashrl_tools, torch, vllm, transformers, compressed-tensors."""
    out.print(version_text(), highlight=False)


app.command("quantize")(quantize.command)
app.command("profile")(profile.command)
app.command("setup")(setup.command)
app.command("publish")(publish.command)
app.command("tune")(tune.command)
app.add_typer(models.app, name="models")
app.add_typer(verify.app, name="verify")


def main() -> None:
    try:
        app()
    except FlashRLError as e:
        err.print(f"[bold red]error:[/] {e.message}", highlight=False, soft_wrap=True, markup=True)
        sys.exit(e.exit_code)
