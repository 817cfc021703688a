"""`flashrl verify reload|drift`."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import typer
from rich.table import Table

from flashrl_tools.cli.common import MODEL_HELP, err, model_path, out
from flashrl_tools.fsutil import atomic_write_text, check_writable
from flashrl_tools.config.resolve import RuntimeConfig, resolve

app = typer.Typer(help="Check an 8-bit rollout config: weight-sync consistency and logprob drift.",
                  no_args_is_help=True)
CONFIG_HELP = "config.yaml from `flashrl setup`, or int8 | fp8 | bf16 (what FLASHRL_CONFIG would be)"


def _config_and_model(config: str, model: str | None) -> tuple[RuntimeConfig, Path]:
    rc = resolve(config)
    if model is None and rc.entry.profile is not None:  # the BF16 model the profile was made from
        from flashrl_tools.profile.format import load_profile

        ref = load_profile(Path(rc.entry.profile)).meta.bf16_model
        if ref is not None and Path(ref.path).is_dir():
            return rc, Path(ref.path)
    return rc, model_path(model or "default")


@app.command("reload")
def reload(
    config: str = typer.Option(..., "--config", "-c", help=CONFIG_HELP),
    model: str = typer.Option(None, "-m", "--model", help=MODEL_HELP + " (default: the profile's BF16 "
                              "model, else 'default')"),
    json_out: Path = typer.Option(None, "--json", help="write the checks as JSON"),
    tol: float = typer.Option(1e-3, "--tol", help="max |Δ log p| (nats) between a synced and a fresh engine"),
    work_dir: Path = typer.Option(None, "--work-dir", help="keep the perturbed checkpoint and the fresh "
                                  "engines' outputs here; a rerun with the same config and model reuses them"),
    engine: str = typer.Option("vllm", "--engine", help="rollout engine: vllm or sglang (GPU)"),
    inject_fault: str = typer.Option(None, "--inject-fault", hidden=True,
                                     help="self-test: a fault of verify/faults.py (noop, wrong_layer, stale_scales, ...)"),
) -> None:
    """Push BF16 weights into an engine running the config (as a trainer does) and check it equals a
    fresh engine on the offline-quantized weights; then push updated weights, then restore."""
    from flashrl_tools.verify.reload import checks_json, verify_reload

    check_writable(json_out, "--json")
    check_writable(work_dir and work_dir / "x", "--work-dir")
    rc, bf16 = _config_and_model(config, model)
    with tempfile.TemporaryDirectory(prefix="flashrl-verify-") as tmp:
        work = work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        with err.status("verify reload") as status:
            checks, refs = verify_reload(rc, bf16, work, tol=tol, fault=inject_fault,
                                         progress=lambda s: status.update(s), engine=engine)
    table = Table(title=f"verify reload: FLASHRL_CONFIG={config} on {bf16.name}" + (f" ({engine})" if engine != "vllm" else ""))
    for col in ("check", "result", "detail"):
        table.add_column(col)
    for c in checks:
        table.add_row(c.name, "[green]pass[/]" if c.passed else "[bold red]FAIL[/]", c.detail)
    out.print(table)
    passed = all(c.passed for c in checks)
    if json_out:
        atomic_write_text(json_out, json.dumps({"config": config, "model": str(bf16), "passed": passed,
                                                "checks": checks_json(checks), "references": refs}, indent=1))
    failed = [c.name for c in checks if not c.passed]
    if failed:
        err.print(f"[bold red]verify reload failed:[/] {'; '.join(failed)}", highlight=False)
        raise typer.Exit(1)
    out.print("all reload checks passed", highlight=False)


def _fmt(v: float) -> str:
    return f"{v:.4g}"


@app.command("drift")
def drift(
    config: str = typer.Option(..., "--config", "-c", help=CONFIG_HELP),
    model: str = typer.Option(None, "-m", "--model", help=MODEL_HELP),
    prompts: Path = typer.Option(None, "--prompts", help="JSONL ({\"prompt\": ...} per line) or text file; "
                                 "default: the built-in math/code/chat prompts"),
    n: int = typer.Option(64, "-n", min=1, help="rollouts per engine (prompts are cycled)"),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1),
    temperature: float = typer.Option(1.0, "--temperature", min=1e-3),
    top_p: float = typer.Option(1.0, "--top-p", min=1e-3, max=1.0,
                                help="< 1 renormalises the rollout distribution, which the trainer does not"),
    cap: float = typer.Option(2.0, "--cap", min=1.0, help="TIS cap C"),
    seed: int = typer.Option(0, "--seed"),
    json_out: Path = typer.Option(None, "--json", help="write the report as JSON"),
    plot: Path = typer.Option(None, "--plot", help="write the log-ratio histogram as PNG"),
    max_kl: float = typer.Option(None, "--max-kl", help="limit on token KL (k3) [default 0.05]"),
    max_mean_abs: float = typer.Option(None, "--max-mean-abs", help="limit on mean |Δ log p| [default 0.25]"),
    max_truncated: float = typer.Option(None, "--max-truncated", help="limit on the TIS truncated "
                                        "fraction [default 0.03]"),
    min_ess: float = typer.Option(None, "--min-ess", help="lower limit on token ESS [default 0.8]"),
    engine: str = typer.Option("vllm", "--engine", help="rollout engine: vllm or sglang (GPU)"),
) -> None:
    """Sample rollouts with the 8-bit engine and a BF16 engine, score their tokens with the BF16
    policy (as the trainer does) and report the rollout-vs-trainer mismatch of each."""
    from dataclasses import replace

    from flashrl_tools.verify.drift import Settings, Thresholds, plot_histogram, run_drift

    check_writable(json_out, "--json")
    check_writable(plot, "--plot")
    rc, bf16 = _config_and_model(config, model)
    limits = {k: v for k, v in (("max_kl_k3", max_kl), ("max_mean_abs_log_ratio", max_mean_abs),
                                ("max_tis_truncated_frac", max_truncated), ("min_ess_token", min_ess)) if v is not None}
    thresholds = replace(Thresholds(), **limits)
    settings = Settings(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p, cap=cap, seed=seed)
    with err.status("verify drift") as status:
        report = run_drift(rc, bf16, settings, prompts, thresholds, progress=lambda s: status.update(s),
                           engine=engine)
    rows = [("mean |Δ log p|", "mean_abs_log_ratio"), ("p99 |Δ log p|", "p99_abs_log_ratio"),
            ("token KL (k3)", "kl_k3"), ("seq log-ratio mean", "seq_log_ratio_mean"),
            ("seq log-ratio std", "seq_log_ratio_std"), ("seq log-ratio min", "seq_log_ratio_min"),
            ("seq log-ratio max", "seq_log_ratio_max"), ("ppl ratio (trainer / rollout)", "ppl_ratio"),
            (f"TIS truncated fraction (C={cap:g})", "tis_truncated_frac"), ("token ESS", "ess_token"),
            ("sequence ESS", "ess_seq"), ("tokens", "tokens")]
    engines = report["engines"]
    table = Table(title=f"verify drift vs the BF16 trainer: {bf16.name}, n={n}, T={temperature:g}, top_p={top_p:g}")
    table.add_column("metric")
    cols = ["bf16"] + (["weights_only"] if "weights_only" in engines else []) + ["quantized"]
    table.add_column("BF16 engine", justify="right")
    if "weights_only" in engines:  # FP8 KV cache: its share of the drift
        table.add_column(f"{config} engine, BF16 KV cache", justify="right")
    table.add_column(f"{config} engine" + (f" + {report['kv_cache_dtype']} KV cache" if report.get("kv_cache_dtype")
                                           else ""), justify="right")
    for label, key in rows:
        table.add_row(label, *(_fmt(engines[c]["metrics"][key]) for c in cols))
    table.add_row("mean response length", *(_fmt(engines[c]["mean_response_length"]) for c in cols))
    table.add_row("length diff vs BF16 engine", "0",
                  *(_fmt(engines[c]["response_length_diff_vs_bf16"]) for c in cols[1:]))
    if report.get("kv_cache_dtype"):  # which decode attention read the FP8 cache (FLASHRL_DECODE_ATTN)
        table.add_row("FP8 KV decode attention", *("" if c != "quantized" else
                                                   " + ".join(engines[c].get("decode_attn") or ["the engine's"])
                                                   for c in cols))
    out.print(table)
    for c in report["checks"]:
        mark = "[green]pass[/]" if c["passed"] else "[bold red]FAIL[/]"
        out.print(f"{mark} {c['name']} = {_fmt(c['value'])} ({c['op']} {c['limit']:g})", highlight=False)
    if json_out:
        atomic_write_text(json_out, json.dumps(report, indent=1))
    if plot:
        plot_histogram(report, plot)
    if not report["passed"]:
        err.print("[bold red]verify drift failed:[/] " + "; ".join(c["name"] for c in report["checks"]
                                                                  if not c["passed"]), highlight=False)
        raise typer.Exit(1)
