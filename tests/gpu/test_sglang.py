"""The SGLang adapter on a GPU (SGLang 0.5.17, CUDA graphs, triton attention; one engine per process:
verify/sglang_job.py). HF-initialised random Qwen3 (dense) and Qwen3-MoE and a perturbed copy of each. Per case:
SGLang engines on the offline quantization of the original and of the perturbed weights (the format the SGLang
runtime serves: int8, per-channel FP8 for `fp8`), running the runtime with FLASHRL_CONFIG=bf16, are the fresh
references; the synced engine runs FLASHRL_CONFIG on the original BF16 weights and takes the perturbed weights one
tensor per `update_weights_from_tensor` call, the originals back as one flattened bucket, the perturbed weights again
as a bucket (GPU tensors, as verl's SGLang path sends), then the originals from disk (`update_weights_from_disk`:
SGLang processes every layer again after that load; the runtime leaves synced layers as written). All exact (0.0).
The sampled tokens' logprobs equal a hand computation from the engine's own distributions (tempered; with top-k /
top-p and `return_sampling_mask`, renormalised). `@fa3`: SGLang's fa3 attention instead of triton (its decode kernels
read the KV scales from the tensors the runtime writes in place: the decode graphs are not captured again after a
recalibration, so equality with the fresh engines checks that too; `@fa3p16` with SGLang's pool by 16-token pages;
`@xqa16` the same under FLASHRL_DECODE_ATTN=xqa, every engine observing 40 sequences, so their decode batches (CUDA
graphs up to 48) go through XQA's Hopper kernel: asserted from each engine's log; `@fp8qk16` under
FLASHRL_DECODE_ATTN=fp8qk, flashrl's FP8-score kernel, asserted the same way). `+kv`: FLASHRL_KV_CACHE_DTYPE=fp8 (the
fresh engines calibrate once at start); the scales must be bit-equal to theirs, and the greedy tokens' logprobs
(decode: they read the FP8 cache) are compared too. `moe-int8` must be refused at start (SGLang's compressed-tensors
INT8 MoE is NPU-only). `w4a16`: SGLang's Marlin W4A16 layers, their kernel layout recomputed in place after each sync
(runtime/sglang/marlin.py); `w4a16_mix` the 4/8-bit YAML (each layer by its scheme)."""

from __future__ import annotations

import importlib.util

import pytest

import gpu_harness as h

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed")
CASES = ["dense-bf16", "dense-int8", "dense-fp8", "moe-bf16", "moe-fp8", "moe-int8",
         "dense-bf16+kv", "dense-int8+kv", "dense-fp8+kv", "moe-fp8+kv", "dense-int8+kv@fa3", "dense-int8+kv@fa3p16",
         "dense-int8+kv@xqa16", "dense-int8+kv@fp8qk16", "dense-w4a16", "dense-w4a16+kv", "dense-w4a16_mix"]
TP2 = ["dense-int8+kv@tp2", "dense-fp8@tp2", "moe-fp8@tp2"]  # issue 76: TP = 2 (two GPUs), every rank's scales
OPTIONS = {"": {}, "tp2": {"tp_size": 2}, "fa3": {"attention_backend": "fa3"},
           "fa3p16": {"attention_backend": "fa3", "page_size": 16},
           "xqa16": {"attention_backend": "fa3", "page_size": 16, "cuda_graph_max_bs_decode": 48},
           "fp8qk16": {"attention_backend": "fa3", "page_size": 16}}
ARCH = {"dense": "qwen3", "moe": "qwen3_moe"}
FORMAT = {"bf16": None, "int8": "int8", "fp8": "fp8_channel", "w4a16": "w4a16",  # what the SGLang adapter serves
          "w4a16_mix": "w4a16_mix"}  # a YAML (gpu_harness.YAMLS): the fresh engines' checkpoint has its 4-bit layers
PROMPTS = [[5, 70, 75, 82, 3], [7, 8, 9, 10, 11, 200], [30, 31, 32], [100, 120, 140, 160]]
TEMP, TOP_K, TOP_P = 0.8, 50, 0.9


def observe(sequences: list = h.SEQS) -> dict:
    return {"op": "observe", "sequences": sequences, "max_tokens": 8}


def sample_steps(first: int) -> list[dict]:
    """Steps `first`..: a sample at T, a teacher-forced score of its prompts + responses, a sample with
    top-k / top-p and the whole distribution of each step."""
    plain = {"op": "sample", "prompts": PROMPTS, "temperature": TEMP, "max_tokens": 8, "seed": 3}
    return [plain, {"op": "score", "rollouts_of": first},
            {**plain, "top_k": TOP_K, "top_p": TOP_P, "top": True, "seed": 5}]


def hand_checks(plain: dict, scored: dict, trunc: dict) -> dict:
    """Sampled-token logprobs vs hand computations from the engine's own distributions."""
    from flashrl_tools.verify.handcheck import tempered, truncated

    temp_d = [abs(tempered(dists[len(p) + j], tok, TEMP) - lp)
              for p, r, dists in zip(PROMPTS, plain["rollouts"], scored["dists"])
              for j, (tok, lp) in enumerate(zip(r["token_ids"], r["logprobs"]))]
    trunc_d, outside, missing = [], 0, 0
    for r in trunc["rollouts"]:
        for tok, dist, got in zip(r["token_ids"], r["top"], r.get("sampling_logprobs") or []):
            if got is None:
                missing += 1
                continue
            want, inside = truncated(dist, tok, TOP_K, TOP_P)
            trunc_d.append(abs(want - got))
            outside += not inside
    return {"tempered_vs_prefill_max": max(temp_d), "truncated_vs_hand_max": max(trunc_d) if trunc_d else None,
            "truncated_tokens": len(trunc_d), "truncated_missing": missing, "sampled_outside_support": outside}


def run_case(case: str, work) -> dict:
    case, _, option = case.partition("@")  # `@fa3`: SGLang's fa3 attention (it reads the KV scales from tensors:
    extra = OPTIONS[option]  # new scales, no decode-graph capture); `@fa3p16`: over 16-token pages
    arch, rest = case.split("-", 1)
    config, kv = rest.removesuffix("+kv"), "fp8" if rest.endswith("+kv") else None
    orig, pert = h.model_pair(work, ARCH[arch])
    fmt = FORMAT[config]
    kernel = "xqa" if option.startswith("xqa") else "fp8qk" if option.startswith("fp8qk") else ""
    xqa = bool(kernel)  # a decode kernel asserted from the engines' logs (xqa: batches of 40)
    env = {"xqa": h.XQA, "fp8qk": h.FP8_QK}.get(kernel)
    seqs, tag = (h.WIDE if kernel == "xqa" else h.SEQS), (f"sgl-{case}@{option}" if xqa else None)
    steps = [observe(seqs), {"op": "push", "path": str(pert), "cuda": True}, observe(seqs),
             {"op": "push", "path": str(orig), "cuda": True, "bucket": True}, observe(seqs),
             {"op": "push", "path": str(pert), "cuda": True, "bucket": True}, observe(seqs),
             {"op": "push", "path": str(orig), "disk": True}, observe(seqs)]
    base = len(steps)
    synced = h.run_sglang(orig, steps + sample_steps(base), h.config_value(work, config), f"synced {case}", kv,
                          extra, env, work / f"{tag}-synced.log" if xqa else None)
    if isinstance(synced, str):
        return {"error": synced}
    fresh = h.fresh_sglang(orig, pert, fmt, kv, work, extra, env, seqs, tag)
    if "error" in fresh:
        return fresh
    start, per_tensor, restore, bucket = synced[0], synced[2], synced[4], synced[6]
    row = {} if not xqa else h.expect_xqa({}, [(work / f"{tag}-{t}.log").read_text(errors="replace")
                                               for t in ("synced", "original", "perturbed")], kernel)
    return {**row, "start_vs_fresh": h.same(start, fresh["original"]),
            "per_tensor_sync_vs_fresh": h.same(per_tensor, fresh["perturbed"]),
            "bucket_restore_vs_start": h.same(restore, start), "bucket_sync_vs_fresh": h.same(bucket, fresh["perturbed"]),
            "disk_sync_vs_fresh": h.same(synced[8], fresh["original"]),
            "changed_by_sync": h.max_diff(start, per_tensor), "push_seconds": [synced[i]["seconds"] for i in (1, 3, 5, 7)],
            "hand": hand_checks(*synced[base:base + 3]), "kv": kv,
            "kv_scales_changed_by_sync": start.get("kv_scales") != per_tensor.get("kv_scales") if kv else None}


@pytest.fixture(scope="module")
def rows(request, gpu_work, gpu_jobs) -> dict:
    return h.module_rows(request, CASES + (TP2 if h.TWO_GPUS else []), run_case, gpu_work, min(gpu_jobs, 3), "sglang",
                         engines=f"CUDA graphs, triton attention, {h.SGLANG_ENGINE}")


@pytest.mark.parametrize("case", CASES)
def test_sglang_sync_equals_a_fresh_engine(rows, case):
    row = rows[case]
    if case == "moe-int8":
        assert "INT8 MoE experts on NPU only" in row.get("error", ""), row  # refused at start, one line
        return
    h.assert_exact(row)
    hand = row["hand"]
    assert hand["truncated_vs_hand_max"] is not None and hand["truncated_vs_hand_max"] < 1e-4, hand
    assert not hand["truncated_missing"], hand  # (`sampled_outside_support`: near-ties at the top-p edge, recorded)
    if row["kv"]:  # the prefill (bf16 k / v) and the decode (FP8 cache) differ by more than noise there
        assert row["kv_scales_changed_by_sync"]
    else:
        assert hand["tempered_vs_prefill_max"] < 0.05, hand


@pytest.mark.skipif(not h.TWO_GPUS, reason="TP = 2 needs two GPUs")
@pytest.mark.parametrize("case", TP2)
def test_sglang_sync_equals_a_fresh_engine_at_tp2(rows, case):
    """Per tensor, buckets and from disk at TP = 2: both ranks load their shards; every rank's FP8 KV scales = the
    fresh TP = 2 engine's (sglang_job.kv_scales reads each rank's)."""
    row = rows[case]
    h.assert_exact(row)
    if row["kv"]:
        assert row["kv_scales_changed_by_sync"]
