"""`flashrl verify drift`: how far the 8-bit rollout policy sits from the BF16 trainer.

N rollouts are sampled by the engine under test (FLASHRL_CONFIG=config; its sampling logprobs)
and by a BF16 engine (FLASHRL_CONFIG=bf16: the mismatch that exists without quantization);
the BF16 policy scores exactly those tokens as a trainer would (score.py). Metrics per engine
against the trainer come from flashrl_tools.correction.
"""

from __future__ import annotations

import json

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from flashrl_tools.correction import log_ratio, mismatch_metrics
from flashrl_tools.config.resolve import RuntimeConfig
from flashrl_tools.runtime.core import decode_attn
from flashrl_tools.verify.engines import engine_job, run_engine
from flashrl_tools.prompts import load_prompts, tokenize
from flashrl_tools.verify.score import score_rollouts


@dataclass(frozen=True)
class Thresholds:
    """Pass/fail limits for the engine under test (defaults: README, `verify drift`)."""
    max_kl_k3: float = 0.05
    max_mean_abs_log_ratio: float = 0.25
    max_tis_truncated_frac: float = 0.03
    min_ess_token: float = 0.8

    def checks(self, m: dict) -> list[dict]:
        rows = [("token KL (k3)", m["kl_k3"], "<=", self.max_kl_k3),
                ("mean |Δ log p|", m["mean_abs_log_ratio"], "<=", self.max_mean_abs_log_ratio),
                ("TIS truncated fraction", m["tis_truncated_frac"], "<=", self.max_tis_truncated_frac),
                ("token ESS", m["ess_token"], ">=", self.min_ess_token)]
        return [{"name": n, "value": v, "op": op, "limit": lim,
                 "passed": bool(v <= lim if op == "<=" else v >= lim)} for n, v, op, lim in rows]


@dataclass(frozen=True)
class Settings:
    n: int = 64
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    cap: float = 2.0  # TIS cap C
    seed: int = 0


def padded(rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(r) for r in rows), default=0)
    values = torch.zeros(len(rows), max(width, 1), dtype=torch.float64)
    mask = torch.zeros_like(values)
    for i, r in enumerate(rows):
        values[i, :len(r)] = torch.tensor(r, dtype=torch.float64)
        mask[i, :len(r)] = 1
    return values, mask


def engine_report(train: list[list[float]], rollouts: list[dict], cap: float) -> dict:
    lp_train, mask = padded(train)
    lp_rollout, _ = padded([r["logprobs"] for r in rollouts])
    metrics = mismatch_metrics(lp_train, lp_rollout, mask, tis_cap=cap).to_dict()
    lengths = [len(r["token_ids"]) for r in rollouts]
    deltas = log_ratio(lp_train, lp_rollout)[mask.bool()].tolist()
    return {"metrics": metrics, "mean_response_length": sum(lengths) / len(lengths), "log_ratios": deltas}


def run_drift(rc: RuntimeConfig, bf16: Path, settings: Settings, prompts_file: Path | None = None,
              thresholds: Thresholds = Thresholds(), progress=lambda s: None, engine: str = "vllm",
              bf16_runs: dict | None = None) -> dict:
    """`bf16_runs`: a dict a caller keeps across calls (tune's verifications): the BF16 engine's rollouts of the
    same prompts and sampling (a deterministic engine, the same inputs) are sampled once and reused."""
    engine_job(engine)  # an unknown or missing engine fails before any work
    prompt_ids = tokenize(load_prompts(prompts_file), bf16)
    prompts = [prompt_ids[i % len(prompt_ids)] for i in range(settings.n)]
    step = {"op": "sample", "prompts": prompts, "temperature": settings.temperature, "top_p": settings.top_p,
            "max_tokens": settings.max_tokens, "seed": settings.seed}
    # (FLASHRL_CONFIG, FLASHRL_KV_CACHE_DTYPE) per engine; with an FP8 KV cache a third engine
    # serves the same 8-bit weights with vLLM's default KV cache: the KV cache's share of the drift
    kv = rc.entry.kv_cache_dtype if rc.entry.fp8_kv_cache else None
    engines = {"bf16": ("bf16", "auto" if kv else None)}
    if kv:
        engines["weights_only"] = (rc.source, "auto")
    engines["quantized"] = (rc.source, kv)
    rollouts, kernels = {}, {}
    for key, (config, kv_dtype) in engines.items():
        reuse = json.dumps([str(bf16), engine, config, kv_dtype, step]) if config == "bf16" and bf16_runs is not None \
            else None
        if reuse in (bf16_runs or {}):
            rollouts[key], kernels[key] = bf16_runs[reuse]
            continue
        progress(f"sampling {settings.n} rollouts with FLASHRL_CONFIG={config}"
                 + (f", FLASHRL_KV_CACHE_DTYPE={kv_dtype}" if kv_dtype else ""))
        with tempfile.TemporaryDirectory(prefix="flashrl-drift-") as tmp:
            log = Path(tmp) / "engine.log"
            rollouts[key] = run_engine(bf16, [step], config, f"{key} rollout", kv_cache_dtype=kv_dtype,
                                       engine=engine, log=log)[0]["rollouts"]
            kernels[key] = decode_attn.kernels_in(log.read_text(errors="replace"))
        if reuse is not None:
            bf16_runs[reuse] = (rollouts[key], kernels[key])
    progress("scoring the rollouts with the BF16 policy (HF transformers)")
    responses = [r["token_ids"] for key in engines for r in rollouts[key]]
    scores = score_rollouts(bf16, prompts * len(engines), responses, settings.temperature)
    report = {"config": rc.source, "kv_cache_dtype": kv, "model": str(bf16), "settings": asdict(settings),
              "engines": {}}
    for i, key in enumerate(engines):
        report["engines"][key] = engine_report(scores[i * settings.n:(i + 1) * settings.n], rollouts[key], settings.cap)
        report["engines"][key]["decode_attn"] = kernels[key]  # FLASHRL_DECODE_ATTN's kernels its FP8 KV decode took
    base = report["engines"]["bf16"]["mean_response_length"]
    for entry in report["engines"].values():
        entry["response_length_diff_vs_bf16"] = entry["mean_response_length"] - base
    report["thresholds"] = asdict(thresholds)
    report["checks"] = thresholds.checks(report["engines"]["quantized"]["metrics"])
    report["passed"] = all(c["passed"] for c in report["checks"])
    return report


def plot_histogram(report: dict, path: Path) -> None:
    """Per-token log-ratio histograms, BF16 engine vs the engine under test, to a PNG."""
    import io
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flashrl_tools.fsutil import atomic_write_bytes

    engines = report["engines"]
    values = engines["bf16"]["log_ratios"] + engines["quantized"]["log_ratios"]
    lim = max(0.05, max(abs(v) for v in values)) if values else 1.0
    bins = [-lim + 2 * lim * i / 80 for i in range(81)]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for key, label, color in (("bf16", "BF16 engine", "tab:blue"),
                              ("quantized", f"{report['config']} engine", "tab:orange")):
        m = engines[key]["metrics"]
        ax.hist(engines[key]["log_ratios"], bins=bins, alpha=0.55, color=color,
                label=f"{label}: mean |Δ| {m['mean_abs_log_ratio']:.3f}, KL(k3) {m['kl_k3']:.4f}")
    ax.axvline(math.log(report["settings"]["cap"]), color="gray", linestyle="--", linewidth=1,
               label=f"log C (TIS cap {report['settings']['cap']:g})")
    ax.set_yscale("log")
    ax.set_xlabel("per-token log π_train − log π_rollout")
    ax.set_ylabel("tokens")
    ax.set_title(f"rollout vs BF16 trainer, per token ({Path(report['model']).name}, "
                 f"T={report['settings']['temperature']:g}, n={report['settings']['n']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
