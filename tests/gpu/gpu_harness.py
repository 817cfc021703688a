"""What the GPU tests share: HF-initialised random models (real structure, not vLLM's near-uniform dummy
weights) and their perturbed copies (every tensor x (1 + 0.05 N(0, 1)), `verify.perturb`: a stand-in for
an optimizer step), engines in processes of their own (tests/probes/*: vLLM; verify's engine job:
SGLang), the teacher-forced comparison, cases run side by side on one GPU, and the results JSON.

Every check compares a synced engine with a fresh engine started on the same weights with the same
FLASHRL_CONFIG (and KV setting): max |Δ log p| over teacher-forced positions must be 0.0, greedy tokens
equal, FP8 KV scales bit-equal. A case's `failures` lists what did not hold; the tests assert it is empty.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch

from flashrl_tools.runtime.core.decode_attn import LOG_LINE as DECODE_ATTN_LINE  # the kernel's line in a log
from flashrl_tools.runtime.core.decode_attn import kernels_in

REPO = Path(__file__).resolve().parents[2]
PROBES = REPO / "tests" / "probes"
SEQS = [[5, 70, 75, 82, 3, 40, 50, 60, 70, 80, 90, 100], [7, 8, 9, 10, 11, 200, 201, 202, 203, 204]]
# FLASHRL_DECODE_ATTN=xqa's cases: XQA takes decode batches of xqa_decode.MIN_SEQS (32) sequences up, so they
# observe 40 distinct sequences of 6-14 tokens (and their engines capture decode graphs that large)
WIDE = [[(7 * i + 3 * j) % 380 + 2 for j in range(6 + i % 9)] for i in range(40)]
XQA = {"FLASHRL_DECODE_ATTN": "xqa"}
FP8_QK = {"FLASHRL_DECODE_ATTN": "fp8qk"}  # flashrl's kernel with FP8 score products (opt-in; any batch size)
LPT = {"FLASHRL_DECODE_ATTN": "lpt"}  # flashrl's kernel taking the sequences longest first (opt-in)
COMMON = dict(vocab_size=384, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
              max_position_embeddings=2048, tie_word_embeddings=False, torch_dtype="bfloat16")
ARCHS = {  # HF config class, its extra fields
    "qwen2": ("Qwen2Config", dict(intermediate_size=2816, num_hidden_layers=4)),
    "qwen3": ("Qwen3Config", dict(intermediate_size=2048, head_dim=64, num_hidden_layers=4)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512,
                                         decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, head_dim=64,
                                         num_hidden_layers=4)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=512,
                                      num_hidden_layers=4)),
}
YAMLS = {  # configs that are YAML files (written into the work dir)
    "fp8_channel": "- fn: fp8_channel\n  logprobs_mode: processed_logprobs\n",
    "fp8_block": "- fn: fp8_block\n  logprobs_mode: processed_logprobs\n",
    "int8_keep": "- fn: int8\n  logprobs_mode: processed_logprobs\n  first_layers_bf16: 1\n  keep_bf16: ['*.down_proj']\n",
    # 4-bit layers in an 8-bit config: a fused unit (qkv) and a plain one (down) W4A16, the rest W8A8
    "w4a16_mix": "- fn: int8\n  logprobs_mode: processed_logprobs\n  w4a16_layers: ['*.mlp.down_proj', "
                 "'model.layers.1.self_attn.qkv_proj']\n",
}
# small vLLM engines side by side: a fixed KV cache skips vLLM's memory profiling (whose "free memory grew"
# assertion other processes on the GPU trip)
VLLM_ENGINE = {"gpu_memory_utilization": 0.05, "kv_cache_memory_bytes": 1 << 30}
# SGLang sizes its KV pool as free memory at start - (1 - mem_fraction_static) of the GPU and refuses to start where
# that is <= 0: a token cap keeps each pool small, and 0.6 lets the GPU's other 40 % hold a vLLM job beside it
SGLANG_ENGINE = {"mem_fraction_static": 0.6, "max_total_tokens": 8192, "cuda_graph_max_bs_decode": 8,
                 "context_length": 512}


# the cases of a module run side by side in threads (run_cases): the checkpoints they share are built under one
# lock (two cases writing the same directory: FileExistsError, GPU run of 2026-11-26)
_BUILD = threading.Lock()


def model_pair(work: Path, arch: str) -> tuple[Path, Path]:
    """(original, perturbed) BF16 checkpoints of `arch`, built once per work dir."""
    with _BUILD:
        return _model_pair(work, arch)


def _model_pair(work: Path, arch: str) -> tuple[Path, Path]:
    from flashrl_tools.models.tiny import byte_tokenizer
    from flashrl_tools.verify.perturb import perturb

    orig, pert = work / arch, work / f"{arch}-perturbed"
    if not (pert / "config.json").is_file():
        import transformers

        cls, extra = ARCHS[arch]
        cfg = getattr(transformers, cls)(**{**COMMON, **extra})
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(orig)
        byte_tokenizer().save_pretrained(orig)
        perturb(orig, pert, seed=1, match=("",))
    return orig, pert


def config_value(work: Path, config: str) -> str:
    """FLASHRL_CONFIG for a config name: a shortcut, or a YAML written into the work dir."""
    if config not in YAMLS:
        return config
    path = work / f"{config}.yaml"
    path.write_text("version: 1\nconfigs:\n" + YAMLS[config])
    return str(path)


def quantized(src: Path, fmt: str | None, work: Path) -> Path:
    """`flashrl quantize` of `src` (the offline checkpoint a fresh engine serves); `src` for BF16; a YAML config of
    YAMLS: its fn with its kept and 4-bit layers (`w4a16_mix`: what `quantize --w4a16-layers` writes)."""
    import yaml

    from flashrl_tools.config.schema import parse_config
    from flashrl_tools.quant.mixed import KeepSpec
    from flashrl_tools.quant.quantize import quantize

    if fmt is None:
        return src
    dst = work / f"{src.name}-{fmt}"
    with _BUILD:
        if not (dst / "config.json").is_file():
            if fmt in YAMLS:
                entry = parse_config({"configs": yaml.safe_load(YAMLS[fmt])}, fmt).configs[0]
                quantize(src, dst, entry.fn.value, force=True, keep=KeepSpec.of(entry))
            else:
                quantize(src, dst, fmt, force=True)
    return dst


TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


def tp_engine(tp: int, moe: bool = False) -> dict:
    """vLLM engine kwargs for a tensor-parallel engine (issue 76): its workers as processes (`mp`; the probes keep
    the engine core in process), MoE experts parallel too (as verl's `expert_parallel_size` > 1 runs them)."""
    return {"tensor_parallel_size": tp, "distributed_executor_backend": "mp", **({"enable_expert_parallel": True}
                                                                                if moe else {})}


def decode_attn_expected() -> bool:
    """Whether engines with an FP8 KV cache started here take flashrl's decode attention (FLASHRL_DECODE_ATTN: 1, or
    unset / auto on Hopper; vLLM's FA3 and SGLang's fa3 alike). Under `xqa` too: the tests' batches of fewer than
    32 sequences keep flashrl's kernel."""
    from flashrl_tools.config.settings import settings
    from flashrl_tools.runtime.core.decode_attn import resolve

    return bool(resolve(settings().decode_attn, torch.cuda.get_device_capability()))


def expect_xqa(row: dict, logs: list[str], kernel: str = "xqa") -> dict:
    """An `xqa` case's engines (`logs`: each one's output): recorded, and a failure where one of them did not
    decode through XQA (FLASHRL_DECODE_ATTN=xqa on a Hopper GPU, a batch of 32+ sequences); the row. `kernel="fp8qk"`:
    the same for flashrl's FP8 score MMA (FLASHRL_DECODE_ATTN=fp8qk, FP8_QK); `kernel="lpt"` for its longest-first
    order (LPT)."""
    row[f"{kernel}_decode_attn"] = seen = [kernel in kernels_in(text) for text in logs]
    if not all(seen):
        row.setdefault("failures", []).append(f"{kernel}'s decode attention {seen}, expected in every engine "
                                              f"(FLASHRL_DECODE_ATTN={kernel})")
    return row


def expect_decode_attn(row: dict, seen: list[bool]) -> None:
    """An FP8 KV case's engines (`seen`: per probe process, whether its log says it decoded through flashrl's
    kernel): recorded, and a failure where that is not what FLASHRL_DECODE_ATTN resolves to here."""
    row["flashrl_decode_attn"] = seen
    if seen != [decode_attn_expected()] * len(seen):
        row.setdefault("failures", []).append(f"flashrl's FP8 decode attention {seen}, expected "
                                              f"{decode_attn_expected()} in every engine (FLASHRL_DECODE_ATTN)")


def async_scheduling(log: str) -> bool | None:
    """Whether the vLLM engines of a probe's log scheduled asynchronously (vLLM logs its config at start; issue 45:
    the exactness tests run with vLLM's default, on, and say so); None: no vLLM engine config in the log."""
    if "async_scheduling=True" in log or "Asynchronous scheduling is enabled" in log:
        return True
    return False if "async_scheduling=False" in log else None


def engine_log(label: str) -> Path | None:
    """Where a probe's or an engine's output goes when the run keeps results (FLASHRL_GPU_RESULTS): engine-logs/
    beside the results JSON, so a failure's whole log comes back with them; else None."""
    if not os.environ.get("FLASHRL_GPU_RESULTS"):
        return None
    name = re.sub(r"[^A-Za-z0-9_.+-]+", "_", label)
    log = Path(os.environ["FLASHRL_GPU_RESULTS"]).parent / "engine-logs" / f"{name}-{os.getpid()}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    return log


def run_probe(probe: str, work: Path, tag: str, env: dict, req: dict, timeout: float = 900) -> dict:
    """tests/probes/<probe>.py REQUEST RESULT in a process of its own (FLASHRL_* from `env` only);
    {"error", "log_tail"} when it failed."""
    rq, out = work / f"{tag}-req.json", work / f"{tag}.json"
    log = engine_log(tag) or work / f"{tag}.log"
    rq.write_text(json.dumps({"sequences": SEQS, "max_tokens": 8, **req}))
    base = {k: v for k, v in os.environ.items() if k not in ("FLASHRL_CONFIG", "FLASHRL_KV_CACHE_DTYPE")}
    base.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engines (the probes' weight-transfer path)
    with open(log, "w") as f:
        try:
            res = subprocess.run([sys.executable, str(PROBES / f"{probe}.py"), str(rq), str(out)], stdout=f,
                                 stderr=subprocess.STDOUT, env={**base, **env}, timeout=timeout)
            code = res.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    if code != 0 or not out.is_file():
        return {"error": f"{probe} {tag}: exit {code}", "log_tail": log.read_text()[-4000:]}
    result = json.loads(out.read_text())
    if isinstance(result, dict):
        text = log.read_text(errors="replace")
        result.setdefault("async_scheduling", async_scheduling(text))
        result.setdefault("flashrl_decode_attn", DECODE_ATTN_LINE in text)
        result.setdefault("log", str(log))
    return result


def run_sglang(model: Path, steps: list[dict], config: str | None, label: str, kv: str | None = None,
               engine_kwargs: dict | None = None, env: dict | None = None, log: Path | None = None) -> list[dict] | str:
    """An SGLang engine job (verify/sglang_job.py): the steps' results, or its error (a refusal is a result);
    `env`: more variables for it, `log`: where its output goes (default: engine-logs/ beside the results JSON, so
    a failure's whole log comes back with them; the error keeps only its last line)."""
    from flashrl_tools.errors import FlashRLError
    from flashrl_tools.verify.engines import run_engine

    if log is None:
        tp = (engine_kwargs or {}).get("tp_size", 1)
        log = engine_log(label + (f"-tp{tp}" if tp > 1 else ""))
    try:
        return run_engine(model, steps, config, label, engine_kwargs={**SGLANG_ENGINE, **(engine_kwargs or {})},
                          engine="sglang", timeout=900, kv_cache_dtype=kv, env=env, log=log)
    except FlashRLError as e:
        return str(e)


def max_diff(a: dict, b: dict) -> float:
    return max(abs(x - y) for la, lb in zip(a["logprobs"], b["logprobs"]) for x, y in zip(la, lb))


def same(a: dict, b: dict) -> dict:
    """How an observation compares with a reference: max |Δ log p|, greedy tokens, FP8 KV scales."""
    out = {"max_dlogp": max_diff(a, b), "tokens_equal": a["tokens"] == b["tokens"]}
    if "kv_scales" in a and "kv_scales" in b:  # (verl's HTTP path cannot be asked for them: logprobs only)
        out["kv_scales_equal"] = a["kv_scales"] == b["kv_scales"] and bool(a["kv_scales"])
    return out


def failures(row: dict, changed_min: float = 0.01) -> list[str]:
    """Every comparison in `row` (dicts with max_dlogp) that is not exact, and a sync that changed nothing."""
    bad = [f"{k}: {v}" for k, v in row.items() if isinstance(v, dict) and "max_dlogp" in v
           and not (v["max_dlogp"] == 0.0 and v["tokens_equal"] and v.get("kv_scales_equal", True))]
    if "changed_by_sync" in row and not row["changed_by_sync"] > changed_min:
        bad.append(f"the sync changed nothing (max |Δ log p| {row['changed_by_sync']})")
    return bad


def run_cases(fn, cases: list, jobs: int, results: str, **meta) -> dict:
    """fn(case) for every case, `jobs` side by side on the GPU: {case: row}; an exception is the row. The
    results JSON `results` is rewritten as each case finishes (a run cut short keeps what finished); each row
    records its wall seconds (`case_wall_s`: what a lease must budget for it, its neighbours running beside it)."""
    rows = {}

    def timed(case):
        t0 = time.monotonic()
        try:
            row = fn(case)
        except Exception as e:  # noqa: BLE001 -- the case fails with its reason
            row = {"error": f"{type(e).__name__}: {e}"}
        return {**row, "case_wall_s": round(time.monotonic() - t0, 1)}

    with ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(timed, c): c for c in cases}
        for future in as_completed(futures):
            case = futures[future]
            rows[case] = future.result()
            rows[case]["passed"] = "error" not in rows[case] and not failures(rows[case]) \
                and not rows[case].get("failures")
            write_results(results, {**meta, "cases": {c: rows[c] for c in cases if c in rows}})
    return rows


def module_rows(request, cases: list, run_case, work: Path, jobs: int, results: str, needs=None, **meta) -> dict:
    """For a module-scoped fixture: run the module's selected cases (`run_case(case, work)`) side by side, and
    the case each of them is compared with (`needs(case)`: a case name or None), selected by -k or not."""
    chosen = selected(request, "case", cases)
    extra = [b for b in (needs(c) for c in chosen) if b] if needs else []
    chosen = [c for c in cases if c in chosen or c in extra]
    return run_cases(lambda c: run_case(c, work), chosen, jobs, results, **meta)


def assert_exact(row: dict) -> None:
    assert "error" not in row, row
    assert failures(row) == [] and not row.get("failures"), row


def fresh_sglang(orig: Path, pert: Path, fmt: str | None, kv: str | None, work: Path,
                 engine_kwargs: dict | None = None, env: dict | None = None, sequences: list = SEQS,
                 logs: str | None = None, one_per_call: bool = False) -> dict:
    """Fresh SGLang engines on the offline quantization of the original and the perturbed weights, running the
    runtime as the synced engine does (FLASHRL_CONFIG=bf16: the checkpoint served as it is, with the runtime's hooks;
    with an FP8 KV cache it calibrates the scales once at start): {tag: observation} or an error. A plain SGLang
    engine is no reference: 0.5.17's Marlin W4A16 GEMM adds split-K partials atomically, in a run-dependent order
    (the runtime's `marlin_reduce` hook keeps a fixed order). `logs`: a stem for their outputs (work / f"{logs}-{tag}.log");
    `one_per_call`: observed one sequence a request, as a probe that does so (Marlin tiles by the batch's rows)."""
    step = {"op": "observe", "sequences": sequences, "max_tokens": 8, "one_per_call": one_per_call}
    out = {tag: run_sglang(quantized(src, fmt, work), [step], "bf16", f"fresh {tag}", kv,
                           engine_kwargs, env, work / f"{logs}-{tag}.log" if logs else None)
           for tag, src in (("original", orig), ("perturbed", pert))}
    errors = [v for v in out.values() if isinstance(v, str)]
    return {"error": errors[0]} if errors else {tag: v[0] for tag, v in out.items()}


def sglang_probe_case(probe: str, case: str, work: Path, formats: dict,
                      one_per_call: bool = False) -> tuple[dict, dict]:
    """A probe driving SGLang in a process of its own (FLASHRL_CONFIG = the case, `+kv`: FP8 KV cache; `@tp2`: both
    engines at TP = 2) on the dense model, and the fresh engines to compare with: (the probe's result, fresh
    observations); an error is returned as the first."""
    case, _, option = case.partition("@")
    config, kv = case.removesuffix("+kv"), "fp8" if case.endswith("+kv") else None
    orig, pert = model_pair(work, "qwen3")
    env = {"FLASHRL_CONFIG": config, **({"FLASHRL_KV_CACHE_DTYPE": kv} if kv else {})}
    extra = {"tp_size": 2} if option == "tp2" else {}
    got = run_probe(probe, work, f"{probe}-{case}{'-' + option if option else ''}", env,
                    {"original": str(orig), "perturbed": str(pert), "engine_kwargs": {**SGLANG_ENGINE, **extra}})
    if "error" in got:
        return got, {}
    fresh = fresh_sglang(orig, pert, formats[config], kv, work, extra, one_per_call=one_per_call)
    return (fresh, {}) if "error" in fresh else (got, fresh)


def selected(request, name: str, params: list) -> list:
    """The parameter values of test `name` in this module that pytest will run (-k, node ids)."""
    ids = {item.callspec.params[name] for item in request.session.items
           if item.module is request.module and hasattr(item, "callspec") and name in item.callspec.params}
    return [p for p in params if p in ids]


def write_results(name: str, data: dict) -> Path:
    """The results JSON: $FLASHRL_GPU_RESULTS/<name>.json (default benchmarks/results/gpu/)."""
    out = Path(os.environ.get("FLASHRL_GPU_RESULTS", REPO / "benchmarks" / "results" / "gpu")) / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "written": time.strftime("%F %T"),
            "command": "python -m pytest " + " ".join(sys.argv[1:]), "commit": _commit(),
            "versions": {m: _version(m) for m in ("vllm", "sglang", "verl", "transformers")}}
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({**meta, **data}, indent=2, default=str))
    tmp.replace(out)
    return out


def _commit() -> str | None:
    """The tree's commit (FLASHRL_COMMIT where the copy has no .git)."""
    res = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return os.environ.get("FLASHRL_COMMIT") or (res.stdout.strip() if res.returncode == 0 else None)


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return None
