"""A profile re-quantizes *updated* weights correctly: perturb SmolLM2's BF16 weights (as an
optimizer step would), re-quantize them with the SmoothQuant profile, and serve both in vLLM.

The re-quantized engine must stay close to the perturbed BF16 engine (same bounds and method as
test_vllm_int8: teacher-forced gap on the BF16 engine's greedy tokens), and closer than the
stale calibrated checkpoint, which still holds the unperturbed weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashrl_tools.verify.zygote import run as run_python

from conftest import REPO
from flashrl_tools.profile.apply import requantize_checkpoint
from flashrl_tools.profile.format import load_profile

pytestmark = pytest.mark.vllm
MESSAGES = ["What is the capital of France?", "Write a haiku about the sea.", "What is 12 + 7?"]
MAX_TOKENS = 16


def probe(model: Path, tmp: Path, tag: str, score=None) -> dict:
    req, out = tmp / f"{tag}-req.json", tmp / f"{tag}.json"
    req.write_text(json.dumps({"messages": MESSAGES, "max_tokens": MAX_TOKENS, "score": score}))
    res = run_python([str(REPO / "tests" / "probes" / "vllm_probe.py"), str(model), str(req),
                      str(out)], timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(out.read_text())


def gaps(ref: dict, other: dict) -> list[float]:
    return [abs(a - b) for g, s in zip(ref["greedy"], other["scored"]) for a, b in zip(g["logprobs"], s)]


def test_requantized_perturbed_weights_track_the_perturbed_model(perturbed_default, smoothquant_checkpoint,
                                                                 sq_profile, tmp_path):
    prof = sq_profile[0]
    pert = perturbed_default  # verify.perturb's defaults, built once for the session
    requant = requantize_checkpoint(pert, load_profile(prof), tmp_path / "perturbed-int8")
    ref = probe(pert, tmp_path, "bf16")
    tokens = [g["token_ids"] for g in ref["greedy"]]
    new = probe(requant, tmp_path, "requant", score=tokens)
    stale = probe(smoothquant_checkpoint, tmp_path, "stale", score=tokens)
    g_new, g_stale = gaps(ref, new), gaps(ref, stale)
    mean_new, mean_stale = sum(g_new) / len(g_new), sum(g_stale) / len(g_stale)
    equal = sum(a == b for x, y in zip(ref["greedy"], new["greedy"])
                for a, b in zip(x["token_ids"], y["token_ids"]))
    print(f"\nperturbed BF16 vs re-quantized INT8: {equal}/{3 * MAX_TOKENS} greedy tokens equal, "
          f"gap mean {mean_new:.3f} max {max(g_new):.3f}; stale INT8: gap mean {mean_stale:.3f} "
          f"max {max(g_stale):.3f}")
    assert "Paris" in new["greedy"][0]["text"]
    assert mean_new <= 0.25 and max(g_new) <= 1.5
    assert equal > 3 * MAX_TOKENS / 2
    assert mean_new < mean_stale  # the update reached the 8-bit weights
