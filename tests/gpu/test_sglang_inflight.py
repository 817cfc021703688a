"""In-flight weight updates on SGLang 0.5.17 (issue 42; tests/probes/sglang_inflight_probe.py): 8 greedy
requests streaming, `pause_generation(mode)`, the perturbed weights pushed per tensor through
`update_weights_from_tensor` (flush_cache=True, SGLang's default; `@dist`: one flattened bucket through
`update_weights_from_distributed`), `continue_generation`. Radix cache on.
Cases: mode x config (`+kv`: FP8 KV cache; `moe-`: Qwen3-MoE; `@fa3`: fa3 attention with its own decode
(FLASHRL_DECODE_ATTN=0), `@fa3attn`: its decode attention through flashrl's kernel (=1; asserted in both engines),
`@fa3attn16`: the same over SGLang's pool by 16-token pages (`page_size=16`, both engines); `@xqa16`: 40 requests
(decode graphs up to 48) under FLASHRL_DECODE_ATTN=xqa over 16-token pages: the kept requests and the fresh engine's
continuation of them decode through XQA's Hopper kernel, asserted in both engines).
Asserted per case: the push succeeds, a request sent during the pause waits, kept (in_place) and retracted requests
finish, aborted ones say so; a request after the drain equals a fresh engine on the new weights (same
FLASHRL_CONFIG and KV setting) bit for bit, as do the FP8 KV scales; abort: every resubmission (prompt + partial
tokens) equals the fresh engine's continuation; retract: the retracted requests' tokens after the pause (recomputed
by the engine on the new weights) equal the fresh engine's continuation of the same batch. In place: a continue
before the sync completed aborts the held requests with the reason and refuses a new one; the sync completed, a
request equals the fresh engine again. FP8 KV in place: no drain (the first token of a request sent after the
continue comes while kept requests are in flight; their entries rescaled). Reported: requests admitted beside kept
ones vs the fresh engine, the kept requests' stale-KV effect (in place), the first token after the continue. FP8 KV
in place also: the kept tokens no further from a recompute than in_place-int8's stale-KV effect plus the FP8
cache's own effect (a fresh FP8-KV engine decoding on from each pause point, its tokens recomputed by a fresh
engine with a BF16 KV cache: `fp8_floor`). `@tp2` (issue 76; two GPUs): both engines at TP = 2."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

import gpu_harness as h
from flashrl_tools.runtime.core.decode_attn import LOG_LINE as DECODE_ATTN_LINE
from flashrl_tools.runtime.sglang import kv_store

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed")
CASES = ["in_place-bf16", "in_place-int8", "in_place-int8+kv", "in_place-moe-fp8", "retract-int8", "retract-fp8",
         "retract-int8+kv", "retract-moe-fp8", "abort-int8", "abort-int8+kv", "in_place-int8+kv@fa3",
         "in_place-int8+kv@dist", "in_place-int8+kv@fa3attn", "in_place-int8+kv@fa3attn16",
         "in_place-int8+kv@xqa16", "in_place-w4a16+kv", "retract-w4a16"]  # w4a16: SGLang's Marlin layers (issue 75)
# issue 76 (two GPUs): both engines at TP = 2 -- no drain in place, kept entries rescaled on both ranks, every rank's
# scales = the fresh TP = 2 engine's
TP2 = ["in_place-int8+kv@tp2", "retract-int8+kv@tp2", "abort-int8+kv@tp2"]
PROBE = h.PROBES / "sglang_inflight_probe.py"
TOKENS = 96


def _probe(args: list[str], env: dict, tag: str, work, *options: str, backend: str = "", page: int = 0,
           wide: bool = False, tp: int = 1) -> dict | str:
    out = work / f"sgl-inflight-{tag}.json"  # `wide`: 40 requests of 74 + 96 tokens (graphs and pool to fit)
    engine = {"cuda_graph_max_bs_decode": 16, **({"cuda_graph_max_bs_decode": 48, "max_total_tokens": 16384}
                                                 if wide else {}),
              **({"attention_backend": backend} if backend else {}),
              **({"page_size": page} if page else {}), **({"tp_size": tp} if tp > 1 else {})}
    res = subprocess.run([sys.executable, str(PROBE), *args, str(out), *options, "--engine-args", json.dumps(engine)],
                         capture_output=True, text=True, env=env, timeout=900)
    if res.returncode != 0 or not out.is_file():
        return f"exit {res.returncode}: {(res.stdout + res.stderr)[-4000:]}"
    text = res.stdout + res.stderr
    return {**json.loads(out.read_text()), "fused_kv_store": kv_store.LOG_LINE in text,
            "flashrl_decode_attn": DECODE_ATTN_LINE in text, "log": text}


def run_case(case: str, work) -> dict:
    # `@fa3`: SGLang's fa3 attention (reads the KV scales from tensors), its own decode (FLASHRL_DECODE_ATTN=0);
    # `@fa3attn`: its decode attention through flashrl's kernel (=1; both engines); `@dist`: the push as a
    # flattened bucket through `update_weights_from_distributed` (a gloo group with the probe); `@fa3attn16`: the
    # kernel over 16-token pages; `@xqa16`: 40 requests under FLASHRL_DECODE_ATTN=xqa over 16-token pages
    case, _, option = case.partition("@")
    xqa = option == "xqa16"
    backend, how = ("fa3" if option.startswith("fa3") or xqa else ""), ("distributed" if option == "dist" else "tensor")
    page = 16 if option in ("fa3attn16", "xqa16") else 0
    sizes = {"wide": xqa, "backend": backend, "page": page, "tp": 2 if option == "tp2" else 1}
    mode, rest = case.split("-", 1)
    moe = rest.startswith("moe-")
    config = rest.removeprefix("moe-").removesuffix("+kv")
    kv = rest.endswith("+kv")
    orig, pert = h.model_pair(work, "qwen3_moe" if moe else "qwen3")
    env = {k: v for k, v in os.environ.items() if k not in ("FLASHRL_CONFIG", "FLASHRL_KV_CACHE_DTYPE")}
    env.update(FLASHRL_CONFIG=config, **({"FLASHRL_KV_CACHE_DTYPE": "fp8"} if kv else {}))
    if backend == "fa3":  # both decode paths, whatever the environment and the GPU
        env["FLASHRL_DECODE_ATTN"] = "xqa" if xqa else "1" if option.startswith("fa3attn") else "0"
    tag = f"{case}@{option}" if option else case
    got = _probe(["run", str(orig), str(pert)], env, tag, work, "--mode", mode, "--tokens", str(TOKENS),
                 "--push", how, "--requests", "40" if xqa else "8", **sizes)
    if isinstance(got, str):
        return {"error": got}
    probe = __import__("sglang_inflight_probe")
    prompt, key = probe.prompt, probe.key
    # the compared single requests in namespaces of their own (as in the probe); the retracted requests'
    # recompute, one batch in the default namespace (the synced engine's old blocks of the same prompts are
    # there, under the old weights' version)
    batches = [[[r, prompt(i), 8, key(r)]] for r, i in (("during", 50), ("after", 60), ("repeat0", 0)) if
               r in got["admitted"]]
    if mode == "abort":
        batches += [[[f"re-{r}", prompt(int(r[1:])) + o["tokens"], TOKENS - len(o["tokens"]), key(f"re-{r}")]]
                    for r, o in got["kept"].items()]
    if mode == "retract":
        batches.append([[f"cont-{r}", prompt(int(r[1:])) + o["tokens"][:got["at_pause"][r]],
                         TOKENS - got["at_pause"][r], None] for r, o in got["kept"].items()])
    if mode == "in_place":
        batches.append([["mid-repeat0", prompt(0), 8, key("mid-repeat0")]])
    if mode == "in_place" and kv:  # the FP8 cache's floor: the fresh engine decodes on from each pause point
        batches.append([[f"dec-{r}", prompt(int(r[1:])) + o["tokens"][:got["at_pause"][r]], TOKENS - got["at_pause"][r],
                         key(f"dec-{r}")] for r, o in got["kept"].items()])
    score = [[f"tf-{r}", prompt(int(r[1:])) + o["tokens"], len(prompt(0)) + got["at_pause"][r]]
             for r, o in got["kept"].items()] if mode == "in_place" else []
    req = work / f"sgl-inflight-{tag}-fresh-req.json"
    req.write_text(json.dumps({"batches": batches, "score": score}))
    fresh = _probe(["serve", str(pert), str(req)], env, f"{tag}-fresh", work, **sizes)
    if isinstance(fresh, str):
        return {"error": f"fresh engine: {fresh}"}
    row = verdict(mode, got, fresh)
    if kv and backend == "fa3":  # both engines' decode stored K / V as FLASHRL_FUSED_KV_STORE says
        from flashrl_tools.config.settings import settings

        row["fused_kv_store"] = [got["fused_kv_store"], fresh["fused_kv_store"]]
        if row["fused_kv_store"] != [settings().fused_kv_store] * 2:
            row["failures"].append(f"fused FP8 KV store {row['fused_kv_store']}, FLASHRL_FUSED_KV_STORE "
                                   f"{settings().fused_kv_store}")
        # and attended as FLASHRL_DECODE_ATTN says (under xqa: the 40 kept requests through XQA in both engines)
        want = option.startswith("fa3attn")
        row["flashrl_decode_attn"] = [got["flashrl_decode_attn"], fresh["flashrl_decode_attn"]]
        if xqa:
            h.expect_xqa(row, [got["log"], fresh["log"]])
        elif row["flashrl_decode_attn"] != [want] * 2:
            row["failures"].append(f"flashrl's FP8 decode attention {row['flashrl_decode_attn']}, expected {want}")
    if mode == "in_place" and kv:  # the FP8 cache's own effect: its decoded tokens recomputed with a BF16 KV cache
        decoded = [[f"tf-dec-{r}", prompt(int(r[1:])) + o["tokens"][:got["at_pause"][r]] + fresh["outputs"][f"dec-{r}"]["tokens"],
                    len(prompt(0)) + got["at_pause"][r]] for r, o in got["kept"].items()]
        floor_req = work / f"sgl-inflight-{tag}-floor-req.json"
        floor_req.write_text(json.dumps({"batches": [], "score": score + decoded}))
        plain = _probe(["serve", str(pert), str(floor_req)], {k: v for k, v in env.items()
                                                              if k != "FLASHRL_KV_CACHE_DTYPE"},
                       f"{tag}-floor", work, **sizes)
        if isinstance(plain, str):
            return {"error": f"BF16-KV engine: {plain}"}
        row["fp8_kv_floor_mean"] = fp8_floor({r: o["logprobs"] for r, o in fresh["outputs"].items()
                                              if r.startswith("dec-")}, plain["scored"], "tf-")
        row["fp8_kv_prefill_gap_mean"] = fp8_floor(fresh["scored"], plain["scored"])  # reported: 0 under triton
    return row


def fp8_floor(fp8: dict, bf16_kv: dict, prefix: str = "") -> float:
    """Mean |d log p| between the same tokens' logprobs with the FP8 KV cache (`fp8`) and recomputed with a BF16
    one (`bf16_kv[prefix + rid]`, teacher-forced), both fresh engines on the new weights. The floor takes the
    FP8 engine's own decoded tokens: a decode step reads every earlier entry from the FP8 cache on every
    backend, while a one-prefill score under triton attends to the chunk's BF16 keys and values and never
    reads the cache (its gap is 0: the 2026-11-26 run), so only decoding shows what the FP8 cache moves."""
    gaps = [abs(x - y) for rid, row in fp8.items() for x, y in zip(row, bf16_kv[prefix + rid])
            if x is not None and y is not None]
    return sum(gaps) / max(1, len(gaps))


def _equal(a: dict, b: dict) -> bool:
    return a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]


def verdict(mode: str, got: dict, fresh: dict) -> dict:
    f = fresh["outputs"]
    row = {k: got[k] for k in ("mode", "push", "at_pause", "continue_s", "first_token_after_continue_s",
                               "tokens_in_flight_at_first_token") if k in got}
    reasons = sorted({o["finish_reason"] for o in got["kept"].values()})
    row["finish_reasons"] = reasons
    row["repeat0_equal_fresh"] = _equal(got["admitted"]["repeat0"], f["repeat0"])
    checks = {"the push while paused succeeds": got["push"][0],
              "kept requests finish" if mode != "abort" else "aborted requests say so":
                  reasons == (["abort"] if mode == "abort" else ["length"]),
              "a request after the drain = fresh engine": row["repeat0_equal_fresh"]}
    if "during" in got["admitted"]:
        checks["a request sent during the pause waits for the continue"] = got["during_waited"]
        row["beside_kept_equal_fresh"] = {r: _equal(got["admitted"][r], f[r]) for r in ("during", "after")}
    if mode == "abort":
        row["resubmitted_equal_fresh"] = {r: _equal(o, f[f"re-{r}"]) for r, o in got["resubmitted"].items()}
        checks["resubmitted requests = fresh engine's continuation"] = all(row["resubmitted_equal_fresh"].values())
    if mode == "retract":
        eq, worst, lengths = {}, 0.0, {}
        for r, o in got["kept"].items():  # the last tokens' logprobs (a retract may report the recompute's
            k, c = got["at_pause"][r], f[f"cont-{r}"]  # first token again: the lengths are recorded)
            tail = o["logprobs"][len(o["logprobs"]) - len(c["logprobs"]):]
            eq[r] = o["tokens"][k:] == c["tokens"] and tail == c["logprobs"]
            lengths[r] = [len(o["tokens"]), len(o["logprobs"])]
            if o["tokens"][k:] == c["tokens"]:
                worst = max([worst] + [abs(x - y) for x, y in zip(tail, c["logprobs"])])
        row.update(retracted_equal_fresh=eq, retracted_max_dlogp=worst, retracted_tokens_logprobs=lengths)
        checks["retracted requests = fresh engine's continuation"] = all(eq.values())
    if mode == "in_place":
        deltas = [abs(x - y) for r, o in got["kept"].items()
                  for x, y in zip(o["logprobs"][got["at_pause"][r]:], fresh["scored"][f"tf-{r}"]) if y is not None]
        row["kept_logprob_delta_mean"] = sum(deltas) / max(1, len(deltas))
        mid = got["mid_sync"]
        row["mid_sync"] = {"continue_refused": (mid["continue_refused"] or "")[:200], "new_waited": mid["new_waited"],
                           "held": sorted({o["finish_reason"] for o in mid["held"].values()}),
                           "new": mid["new"]["finish_reason"]}
        checks["a continue mid-sync is refused with the reason (core/inflight.resume_refusal)"] = (
            "before the weight sync completed" in (mid["continue_refused"] or ""))
        checks["the requests it kept stay paused, then finish after the full push (none aborted)"] = all(
            o["finish_reason"] != "abort" and len(o["tokens"]) > mid["held_at_refusal"][r]
            for r, o in mid["held"].items())
        checks["a request sent after the refused continue waits, then is served"] = (
            mid["new_waited"] and mid["new"]["finish_reason"] != "abort")
        checks["after the sync completed a request = fresh engine"] = mid["full_push"][0] and _equal(
            mid["repeat0"], f["mid-repeat0"])
    if got.get("kv_scales") is not None:
        checks["FP8 KV scales = fresh engine's"] = got["kv_scales"] == fresh["kv_scales"]
        if mode == "in_place":  # the kept requests were set aside for the calibration, not drained
            checks["no drain: the first token after the continue came with kept requests in flight"] = (
                got.get("tokens_in_flight_at_first_token", 0) > 0)
    row["checks"] = checks
    row["failures"] = [k for k, ok in checks.items() if not ok]
    return row


@pytest.fixture(scope="module")
def rows(request, gpu_work, gpu_jobs) -> dict:
    sys.path.insert(0, str(h.PROBES))
    return h.module_rows(request, CASES + (TP2 if h.TWO_GPUS else []), run_case, gpu_work, min(gpu_jobs, 4),
                         "sglang_inflight",
                         engines="CUDA graphs, triton attention (fa3 in the @fa3 cases), radix cache on")


@pytest.mark.parametrize("case", CASES)
def test_sglang_inflight_update(rows, case):
    h.assert_exact(rows[case])


@pytest.mark.skipif(not h.TWO_GPUS, reason="TP = 2 needs two GPUs")
@pytest.mark.parametrize("case", TP2)
def test_sglang_inflight_update_at_tp2(rows, case):
    row = rows[case]
    h.assert_exact(row)
    assert "FP8 KV scales = fresh engine's" in row["checks"]  # every rank's (sglang_job.kv_scales)


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("in_place-int8+kv")])
def test_kept_fp8_entries_are_no_further_from_a_recompute_than_stale_kv_plus_the_fp8_floor(rows, case):
    """Issue 42's bound, in place with the FP8 KV cache: the kept requests' tokens after the update (their entries
    rescaled to the new scales) are no further from a recompute on the new weights than the BF16-KV engine's
    stale-KV effect (in_place-int8, the same run) plus the FP8 cache's own effect on the same tokens."""
    if "in_place-int8" not in rows:
        pytest.skip("needs the in_place-int8 case in the same run (its stale-KV effect is the bound)")
    row, base = rows[case], rows["in_place-int8"]
    h.assert_exact(row)
    h.assert_exact(base)
    bound = base["kept_logprob_delta_mean"] + row["fp8_kv_floor_mean"]
    assert row["kept_logprob_delta_mean"] <= bound, (row["kept_logprob_delta_mean"], bound)
