"""`flashrl profile`: diff a BF16 model against its 8-bit checkpoint -> a profile file."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from flashrl_tools.cli.common import err, model_path, out
from flashrl_tools.errors import FlashRLError
from flashrl_tools.fsutil import atomic_write_text, check_writable

SHOWN_ROWS = 15


def command(
    model: str = typer.Option(None, "-m", "--model", help="BF16 model dir, or 'default'"),
    quantized: Path = typer.Option(..., "-qm", "-q", "--quantized", help="the 8-bit checkpoint"),
    output: Path = typer.Option(..., "-o", "--output", help="profile file to write (.safetensors)"),
    fn: str = typer.Option("int8", "--fn", help="int8 | fp8_channel | fp8_tensor | fp8_block"),
    report: Path = typer.Option(None, "--report", help="also write the per-layer report as JSON"),
    from_flashrl: Path = typer.Option(None, "--from-flashrl", help="convert a flash-llm-rl .pt profile"),
    force: bool = typer.Option(False, "--force", help="replace an existing output"),
) -> None:
    """Record what re-quantizing updated BF16 weights needs (scales, SmoothQuant factors) and
    report how exactly that reproduces the checkpoint, worst layers first."""
    # imported here: compressed-tensors (via transformers) costs seconds on every `flashrl` call
    from flashrl_tools.profile.build import build_profile
    from flashrl_tools.profile.format import save_profile
    from flashrl_tools.profile.legacy import convert_flashrl_profile
    from flashrl_tools.quant.quantize import parse_fn

    fn_ = parse_fn(fn)
    check_writable(output)
    check_writable(report, "--report")
    for path in (output, report):
        if path is not None and path.exists() and not force:
            raise FlashRLError("output already exists", str(path), "pass --force to replace it")
    if from_flashrl is not None:
        profile = convert_flashrl_profile(from_flashrl, quantized)
        if profile.meta.fn != fn_.value:
            raise FlashRLError(f"the checkpoint is {profile.meta.fn}, not --fn {fn_.value}", str(quantized))
        save_profile(profile, output)
        out.print(f"converted {from_flashrl} -> {output} ({len(profile.meta.quantized)} linears)")
        return
    if model is None:
        raise FlashRLError("missing -m BF16_MODEL", None, "profile compares the BF16 model with -qm")
    with err.status("profiling"):
        result = build_profile(model_path(model), quantized, fn_)
    save_profile(result.profile, output)
    if report is not None:
        atomic_write_text(report, json.dumps(result.report(), indent=2) + "\n")
    _print(result)
    out.print(f"profile written to {output}" + (f", report to {report}" if report else ""))


def _print(result) -> None:
    s = result.summary()
    if not result.rows:
        out.print(f"{s['fn']}: {s['quantized_linears']} quantized linear weights (no calibration to record)")
        return
    table = Table(title=f"flashrl profile --fn {s['fn']}: worst {min(SHOWN_ROWS, len(result.rows))} of "
                        f"{len(result.rows)} tensors")
    for col in ("tensor", "kind", "smoothed", "exact", "max |Δq|", "clipped"):
        table.add_column(col, justify="left" if col == "tensor" else "right",
                         overflow="fold" if col == "tensor" else "ellipsis")
    for r in result.rows[:SHOWN_ROWS]:
        table.add_row(r.tensor, r.kind, "yes" if r.smoothed else "no", f"{100 * r.exact_fraction:.4f}%",
                      str(r.max_abs_diff), f"{100 * r.clip_fraction:.4f}%")
    out.print(table)
    out.print(f"INT8 entries reproduced exactly: {100 * s['exact_fraction']:.5f}% of {s['int8_entries']:,} "
              f"(worst layer {100 * s['worst_layer_exact_fraction']:.4f}%); smoothed groups: "
              f"{s['smoothed_groups']}; factors all 1: {s['smoothing_factors_all_one']}", highlight=False)
