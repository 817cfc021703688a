"""`flashrl tune`: pick the fewest layers to keep in BF16 (and, with --w4a16, the most at 4 bits) for a drift budget."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from flashrl_tools.cli.common import ModelOption, err, model_path, out
from flashrl_tools.errors import FlashRLError
from flashrl_tools.fsutil import check_writable


def command(
    model: str = ModelOption,
    fn: str = typer.Option("int8", "--fn", help="int8 | fp8_channel | fp8_tensor | fp8_block"),
    output: Path = typer.Option(..., "-o", "--output", help="config YAML to write (with keep_bf16, w4a16_layers)"),
    max_kl: float = typer.Option(None, "--max-kl", help="token KL budget of the engine (`verify drift` k3)"),
    max_kl_ratio: float = typer.Option(None, "--max-kl-ratio", help="budget as a multiple of the BF16 engine's "
                                       "own drift (default 3)"),
    config: Path = typer.Option(None, "--config", help="start from this config (e.g. a SmoothQuant profile YAML "
                                "from `flashrl setup`) instead of round-to-nearest"),
    report: Path = typer.Option(None, "--report", help="report JSON (PNG beside it); default: OUTPUT.report.json"),
    prompts: Path = typer.Option(None, "--prompts", help="prompts (JSONL/text): even lines tune, odd lines verify"),
    n_tune: int = typer.Option(16, "--n-tune", min=1, help="sequences for the layer sensitivities"),
    n_verify: int = typer.Option(64, "-n", "--n-verify", min=1, help="rollouts per engine in each verification"),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1),
    seed: int = typer.Option(0, "--seed"),
    pow2_scales: bool = typer.Option(False, "--pow2-scales", help="FP8: scales rounded up to powers of two"),
    w4a16: bool = typer.Option(False, "--w4a16", help="then move the 8-bit layers least sensitive at 4 bits to W4A16 "
                               "while the budget holds (w4a16_layers)"),
) -> None:
    """Measure each layer's share of the drift, keep the fewest layers in BF16 that meet the budget,
    verify the pick with the engine (`verify drift`, fresh prompts), write the config and a report."""
    from flashrl_tools.quant.quantize import parse_fn
    from flashrl_tools.tune.run import TuneSettings, tune

    fn_ = parse_fn(fn)
    check_writable(output)
    check_writable(report, "--report")
    for name, value in (("--max-kl", max_kl), ("--max-kl-ratio", max_kl_ratio)):
        if value is not None and value <= 0:
            raise FlashRLError(f"{name} must be > 0, got {value}")
    if output.suffix not in (".yaml", ".yml"):
        raise FlashRLError("the output config must be a .yaml file", str(output))
    report = report or output.with_name(output.stem + ".report.json")
    src = model_path(model)
    settings = TuneSettings(max_kl=max_kl, max_kl_ratio=max_kl_ratio, n_tune=n_tune, n_verify=n_verify,
                            max_tokens=max_tokens, seed=seed)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as bar:
        task = bar.add_task("tune", total=None)

        def step(text: str) -> None:
            bar.update(task, description=text, completed=0, total=None)

        result = tune(src, fn_, output, report, settings, config, prompts, progress=step,
                      bar=lambda done, total: bar.update(task, completed=done, total=total), pow2=pow2_scales,
                      four_bit=w4a16)
    show(result, report)
    if not result["met"]:
        raise typer.Exit(1)


def show(r: dict, report: Path) -> None:
    b = r["budget"]
    table = Table(title=f"flashrl tune --fn {r['fn']}: most sensitive layers (token KL with only that layer 8-bit)")
    for col in ("rank", "layer", "KL alone", "MiB"):
        table.add_column(col, justify="right" if col != "layer" else "left")
    for u in sorted((u for u in r["units"] if u["sensitivity"] is not None), key=lambda u: u["rank"])[:10]:
        table.add_row(str(u["rank"]), u["unit"], f"{u['sensitivity']:.2e}", f"{u['bytes_bf16'] / 2**20:.1f}")
    out.print(table)
    if r.get("forced_bf16"):
        out.print(f"{len(r['forced_bf16'])} layers BF16 in every config: {r['fn']} cannot serve them in vLLM "
                  "(input width or fused shards not multiples of 128)")
    curve = Table(title="KL vs fraction of linear-weight bytes in 8 bit (fake-quant, tuning sample)")
    for col in ("layers BF16", "8-bit bytes", "fake-quant KL", "estimated engine KL"):
        curve.add_column(col, justify="right")
    for p in r["curve"]:
        curve.add_row(str(p["kept"]), f"{p['fraction_8bit']:.1%}", f"{p['kl']:.2e}",
                      f"{b['floor'] + b['alpha'] * p['kl']:.2e}")
    out.print(curve)
    out.print(f"budget: token KL <= {b['max_kl']:.4g}" + (f" ({b['ratio']}x the BF16 floor {b['floor']:.4g})"
              if b["ratio"] else f" (BF16 floor {b['floor']:.4g})") + f"; all-8-bit engine: {b['all_8bit_engine_kl']:.4g}")
    for v in r["verifications"]:
        out.print(f"verify drift with {v['kept']} layers BF16 ({v['fraction_8bit']:.1%} of bytes 8-bit): "
                  f"token KL {v['engine_kl']:.4g} (floor {v['floor']:.4g}) -> {'pass' if v['passed'] else 'miss'}")
    four = r.get("four_bit")
    if four and four.get("curve"):
        t = Table(title=f"then m of {four['eligible']} 8-bit layers at 4 bits, least sensitive first (fake-quant)")
        for col in ("layers 4-bit", "bytes vs BF16", "fake-quant KL", "estimated engine KL"):
            t.add_column(col, justify="right")
        for p in four["curve"]:
            t.add_row(str(p["four"]), f"{p['bytes_vs_bf16']:.3f}", f"{p['kl']:.2e}", f"{b['floor'] + b['alpha'] * p['kl']:.2e}")
        out.print(t)
        for v in four["verifications"]:
            out.print(f"verify drift with {v['four']} layers at 4 bits ({v['bytes_vs_bf16']:.3f}x BF16's bytes): token KL "
                      f"{v['engine_kl']:.4g} -> {'pass' if v['passed'] else 'miss'}")
    elif four:
        out.print(f"4-bit step skipped: {four['skipped']}")
    if r["met"]:
        p = r["pick"]
        out.print(f"picked: {len(p['kept_units'])} layers in BF16 ({p['bf16_bytes'] / 2**20:.1f} MiB), "
                  + (f"{len(p['w4a16_units'])} at 4 bits, " if p["w4a16_units"] else "")
                  + f"{p['bytes_vs_bf16']:.3f}x BF16's linear-weight bytes; config written to {p['config']}")
    else:
        err.print("[bold red]tune:[/] no verified config meets the budget (see the curve); nothing written")
    out.print(f"report: {report} (+ {report.with_suffix('.png').name})")
