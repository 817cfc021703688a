"""The architecture matrix on a GPU (issue 72; the table: tests/arch_matrix.py): every family x config on vLLM,
eager engines, one process per engine (tests/probes/sync_probe.py). Each cell: an engine started on the original
weights under FLASHRL_CONFIG (and FLASHRL_KV_CACHE_DTYPE=fp8 for `+kv`) takes the perturbed copy one tensor per
`load_weights` call (GPU tensors), then the original back; a fresh engine with the same settings starts on the
perturbed copy. The sync must equal the fresh engine (0.0, greedy tokens, FP8 KV scales bit-equal) and the push
back the start -- or both engines refuse at start with one `flashrl:` line naming the model feature and the config
(never a crash). With the FP8 KV cache, flashrl's decode kernel serves exactly the shapes `core.supports` takes
(head sizes 80 / 96: the engine's own attention, logged at start); `@attn0`: FLASHRL_DECODE_ATTN=0, vLLM's FA3.

`sgl-` cells: the same on SGLang (verify/sglang_job.py engines, fa3 attention over 16-token pages, so an FP8 KV
cache decodes through flashrl's kernel where `core.supports` takes the shape): the synced engine under
FLASHRL_CONFIG takes the perturbed copy per tensor and the original back as a bucket; the fresh engines serve the
offline quantization of each (with an FP8 KV cache they run the runtime too: FLASHRL_CONFIG=bf16)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

import gpu_harness as h
from arch_matrix import ARCHS, CPU_ARCHS, feature, model_pair

from flashrl_tools.runtime.core.decode_attn import kernels_in, supports

_ALL = list(ARCHS)
_GPU_ONLY = [a for a in ARCHS if a not in CPU_ARCHS]
CASES = ([f"{a}-int8+kv" for a in _ALL] + [f"{a}-fp8+kv" for a in _ALL]
         + [f"{a}-{c}" for a in _GPU_ONLY for c in ("bf16", "int8")]
         + ["llama_h96-bf16+kv", "llama_h80-bf16+kv", "llama-int8+kv@attn0", "llama_h96-int8+kv@attn0"])
# the runtime's refusal: a FlashRLError from the start-up plan, or a worker's RuntimeError("flashrl: ...")
SGLANG = importlib.util.find_spec("sglang") is not None
SGL_ARCHS = [a for a in ARCHS if a not in ("deepseek_v2", "gpt_oss")]
SGL_CASES = [f"sgl-{a}-{c}" for a in SGL_ARCHS for c in ("bf16", "int8+kv")] + ["sgl-llama_h96-fp8+kv",
                                                                                "sgl-llama_h80-fp8+kv"]
SGL_FORMAT = {"bf16": None, "int8": "int8", "fp8": "fp8_channel"}  # what the SGLang adapter serves
REFUSAL = re.compile(r"(?:FlashRLError|RuntimeError): ((?:flashrl: )?FLASHRL_\w+=.*|flashrl: .*)")


def _shape(arch: str) -> tuple[int, int, int]:
    fields = ARCHS[arch][1]
    heads = fields["num_attention_heads"]
    return fields.get("head_dim", fields["hidden_size"] // heads), heads, fields["num_key_value_heads"]


def refusal(log: str) -> str | None:
    """The engine's one-line refusal at start (the runtime's `flashrl:` message), or None."""
    found = REFUSAL.findall(log)
    return found[-1] if found else None


def run_sglang_case(case: str, work) -> dict:
    arch, config = case.removeprefix("sgl-").split("-", 1)
    config, kv = config.removesuffix("+kv"), "fp8" if config.endswith("+kv") else None
    orig, pert = model_pair(work, arch)
    extra = {"attention_backend": "fa3", "page_size": 16}
    observe = {"op": "observe", "sequences": h.SEQS, "max_tokens": 8}
    steps = [observe, {"op": "push", "path": str(pert), "cuda": True}, observe,
             {"op": "push", "path": str(orig), "cuda": True, "bucket": True}, observe]
    row: dict = {"feature": feature(arch)}
    synced = h.run_sglang(orig, steps, config, f"synced {case}", kv, extra, log=work / f"arch-{case}-synced.log")
    if isinstance(synced, str):  # a refusal at start is the engine job's one-line error
        return {**row, "refused": [synced.splitlines()[-1] if synced else synced]}
    fresh = h.fresh_sglang(orig, pert, SGL_FORMAT[config], kv, work, extra, logs=f"arch-{case}")
    if "error" in fresh:
        return {**row, "error": fresh["error"]}
    row.update(start_vs_fresh=h.same(synced[0], fresh["original"]), push_vs_fresh=h.same(synced[2], fresh["perturbed"]),
               push_restore_vs_start=h.same(synced[4], synced[0]), changed_by_sync=h.max_diff(synced[0], synced[2]))
    if kv:
        seen = ["flashrl" in kernels_in((work / f"arch-{case}-{t}.log").read_text(errors="replace"))
                for t in ("synced", "original", "perturbed")]
        row["flashrl_decode_attn"] = seen
        want = h.decode_attn_expected() and not supports(*_shape(arch)) and not _windowed_only(arch)
        if want and not all(seen) or not want and any(seen) and supports(*_shape(arch)):
            row.setdefault("failures", []).append(f"flashrl's decode kernel {seen}, expected {want}")
    return row


def run_case(case: str, work) -> dict:
    if case.startswith("sgl-"):
        return run_sglang_case(case, work)
    cell, _, option = case.partition("@")
    arch, config = cell.split("-", 1)
    config, kv = config.removesuffix("+kv"), config.endswith("+kv")
    orig, pert = model_pair(work, arch)
    env = {"FLASHRL_CONFIG": config, **({"FLASHRL_KV_CACHE_DTYPE": "fp8"} if kv else {}),
           **({"FLASHRL_DECODE_ATTN": "0"} if option == "attn0" else {})}
    fresh = h.run_probe("sync_probe", work, f"arch-{case}-fresh", env,
                        {"model": str(pert), "engine_kwargs": h.VLLM_ENGINE})
    synced = h.run_probe("sync_probe", work, f"arch-{case}-synced", env,
                         {"model": str(orig), "push": [str(pert), str(orig)], "push_device": "cuda",
                          "engine_kwargs": h.VLLM_ENGINE})
    row: dict = {"feature": feature(arch)}
    if "error" in fresh or "error" in synced:
        lines = [refusal(Path(work / f"arch-{case}-{tag}.log").read_text(errors="replace")) for tag in ("fresh", "synced")]
        row["refused"] = lines
        if not all(lines):  # (each names its own model directory)
            row["error"] = fresh.get("error") or synced.get("error")
            row["log_tail"] = (fresh.get("log_tail") or synced.get("log_tail") or "")[-1500:]
        return row
    f = fresh["stages"][0]
    start, pushed, back = synced["stages"]
    row.update(push_vs_fresh=h.same(pushed, f), push_restore_vs_start=h.same(back, start),
               changed_by_sync=h.max_diff(start, pushed), inplace_layers=synced.get("inplace_layers"))
    if kv:
        texts = [Path(r["log"]).read_text(errors="replace") for r in (fresh, synced)]
        expected = h.decode_attn_expected() and option != "attn0" and not supports(*_shape(arch))
        row["flashrl_decode_attn"] = [r.get("flashrl_decode_attn") for r in (fresh, synced)]
        if not expected and any(row["flashrl_decode_attn"]):
            row.setdefault("failures", []).append("flashrl's decode kernel ran on a shape it does not serve")
        if expected and not all(row["flashrl_decode_attn"]) and not _windowed_only(arch):
            row.setdefault("failures", []).append(f"flashrl's decode kernel did not run {row['flashrl_decode_attn']}")
        if supports(*_shape(arch)) and option != "attn0":
            row["own_attention_logged"] = ["own attention serves this model" in t for t in texts]
            if not all(row["own_attention_logged"]):
                row.setdefault("failures", []).append("the start did not log the engine's own attention")
    return row


def _windowed_only(arch: str) -> bool:
    """Every layer of these tiny models is windowed or soft-capped: FA3 keeps every batch (decode_attn.served)."""
    return arch in ("mistral", "gemma2", "gpt_oss")


@pytest.fixture(scope="module")
def rows(request, gpu_work, gpu_jobs) -> dict:
    return h.module_rows(request, CASES + (SGL_CASES if SGLANG else []), run_case, gpu_work, gpu_jobs, "engine_arch_matrix",
                         engines="vLLM eager; SGLang fa3 over 16-token pages, CUDA graphs")


@pytest.mark.parametrize("case", CASES + [pytest.param(c, marks=pytest.mark.skipif(not SGLANG, reason="no SGLang"))
                                          for c in SGL_CASES])
def test_every_cell_is_exact_or_refused_in_one_line(rows, case):
    row = rows[case]
    if "refused" in row:
        assert "error" not in row, row  # both engines refused, each with one flashrl line
        arch, config = case.removeprefix("sgl-").partition("@")[0].split("-", 1)
        line = row["refused"][0]
        assert "\n" not in line and (config.removesuffix("+kv") in line or "FP8 KV" in line), row
        return
    h.assert_exact(row)
