"""Shared CLI pieces: consoles, the -m MODEL option, and model-name resolution."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from flashrl_tools.models import resolve_model

out = Console()  # results: what a script may parse
err = Console(stderr=True)  # progress and errors

MODEL_HELP = "model directory (BF16 safetensors), or 'default' for the embedded SmolLM2-135M-Instruct"
ModelOption = typer.Option(..., "-m", "--model", help=MODEL_HELP)


def model_path(name: str) -> Path:
    """Resolve -m, materialising the embedded model (with a progress spinner) when asked for."""
    with err.status("preparing model") as status:
        return resolve_model(name, step=lambda s: status.update(s))
