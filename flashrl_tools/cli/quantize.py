"""`flashrl quantize`: BF16 checkpoint -> 8-bit compressed-tensors checkpoint."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from flashrl_tools.cli.common import ModelOption, err, model_path, out
from flashrl_tools.fsutil import check_writable
from flashrl_tools.quant.formats import QuantFn

FN_HELP = " | ".join(f.value for f in QuantFn)


def command(
    model: str = ModelOption,
    output: Path = typer.Option(..., "-o", "--output", help="checkpoint directory to write"),
    fn: str = typer.Option(..., "--fn", help=FN_HELP),
    force: bool = typer.Option(False, "--force", help="replace an existing output"),
    keep_bf16: list[str] = typer.Option([], "--keep-bf16", help="glob of module names kept in BF16 (repeatable)"),
    first_layers_bf16: int = typer.Option(0, "--first-layers-bf16", min=0, help="keep the first N layers in BF16"),
    last_layers_bf16: int = typer.Option(0, "--last-layers-bf16", min=0, help="keep the last N layers in BF16"),
    w4a16_layers: list[str] = typer.Option([], "--w4a16-layers", help="glob of module names stored W4A16 beside the "
                                           "8-bit ones (repeatable; fused partners follow)"),
    pow2_scales: bool = typer.Option(False, "--pow2-scales", help="FP8 formats: round every scale up to a "
                                     "power of two (NeMo-RL style)"),
) -> None:
    """Write an 8-bit checkpoint (weights + config.json + tokenizer) that vLLM loads without flags."""
    from flashrl_tools.quant.mixed import KeepSpec
    from flashrl_tools.quant.quantize import check_four_bit, check_pow2, parse_fn, quantize  # seconds to import

    fn_ = parse_fn(fn)  # validate before any slow work
    keep = KeepSpec(tuple(keep_bf16), first_layers_bf16, last_layers_bf16, tuple(w4a16_layers))
    check_pow2(fn_, pow2_scales)
    check_four_bit(fn_, keep)
    check_writable(output)
    src = model_path(model)
    with err.status(f"quantizing {src.name} ({fn_.value})"):
        result = quantize(src, output, fn_, force=force, keep=keep, pow2=pow2_scales)
    table = Table(title=f"flashrl quantize --fn {fn_.value}", show_header=False)
    table.add_row("output", str(result.out))
    table.add_row("quantized linear weights", str(len(result.quantized)))
    if result.kept_bf16:
        table.add_row("linear weights kept in BF16", str(len(result.kept_bf16)))
    if result.four_bit:
        table.add_row("of them W4A16 (4-bit)", str(len(result.four_bit)))
    if pow2_scales:
        table.add_row("scales", "powers of two")
    table.add_row("tensors kept as-is", str(result.kept))
    table.add_row("size", f"{result.bytes_in / 2**20:.1f} MiB -> {result.bytes_out / 2**20:.1f} MiB")
    table.add_row("time", f"{result.seconds:.1f} s")
    out.print(table)
