"""vLLM's AsyncLLM (verl's async rollout server, `vllm serve`) with an FP8 KV cache, synced by a
trainer: the first requests after a sync must wait for one recalibration of the q/k/v scales.

Starts an AsyncLLM on PERTURBED (FLASHRL_CONFIG / FLASHRL_KV_CACHE_DTYPE from the environment, or
`kv_cache_dtype` in --engine-args), generates, pushes ORIGINAL one tensor per `load_weights` call
(collective_rpc), generates, pushes PERTURBED back, sends two requests at once, then repeats the
first request; then marks the workers' weights discarded (as sleep(level=2) does), expects the
next request refused, pushes PERTURBED and expects the first request's outputs again. Prints one line
`RESULT{json}`: fresh / back outputs (tokens, logprobs), the scales at start, after the first
sync and after syncing back, whether the workers were stale right after a sync, and `checks`
(each must be true). The runtime logs one "FP8 KV scales recalibrated" per calibration (start
and each sync: 3 in all), on stderr.
PERTURBED is made from ORIGINAL (`verify.perturb`) if it does not exist.
Usage: python async_kv_probe.py ORIGINAL PERTURBED [--eager] [--engine-args JSON]
"""

import argparse
import asyncio
import json
import os

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # functions sent to the workers

PROMPT = [1, 504, 3575, 282, 4649, 314]


async def main(original: str, perturbed: str, eager: bool, engine_args: dict, prompt: list[int] = PROMPT) -> dict:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from flashrl_tools.verify.engine_job import push_checkpoint

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=perturbed, enforce_eager=eager, max_model_len=512,
                                                       **engine_args))
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)

    async def gen(tag):
        out = [o async for o in engine.generate({"prompt_token_ids": prompt}, params, tag)]
        c = out[-1].outputs[0]
        return {"tokens": list(c.token_ids), "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]}

    async def scales():
        return (await engine.collective_rpc("flashrl_kv_scales"))[0]

    res = {"fresh": await gen("a"), "fresh_scales": await scales()}
    await engine.collective_rpc(push_checkpoint(original))
    res["stale_after_sync"] = (await engine.collective_rpc("flashrl_kv_stale"))[0]
    await gen("b")
    res["original_scales"] = await scales()
    await engine.collective_rpc(push_checkpoint(perturbed))
    await asyncio.gather(gen("c"), gen("d"))  # two requests at once after a sync: one calibration
    res["back_scales"] = await scales()
    res["back"] = await gen("e")  # the same request as the fresh engine's first
    # weights discarded (what vLLM's sleep(level=2) does on a GPU worker): the front end refuses
    # requests, the engine core survives, and a full push brings the same outputs back
    await engine.collective_rpc("flashrl_discard", args=("sleep(level=2) in the probe",))
    try:
        await gen("f")
        res["refused"] = None
    except Exception as e:
        res["refused"] = f"{type(e).__name__}: {e}"
    await engine.collective_rpc(push_checkpoint(perturbed))
    res["after_discard"] = await gen("g")
    engine.shutdown()
    res["checks"] = {
        "stale right after a sync": res["stale_after_sync"] is True,
        "scales recalibrated for the synced weights": res["original_scales"] != res["fresh_scales"],
        "scales after syncing back = fresh engine's (bit-equal)": res["back_scales"] == res["fresh_scales"],
        "tokens and logprobs after syncing back = fresh engine's": res["back"] == res["fresh"],
        "refused after the weights were discarded": "full weight sync" in (res["refused"] or ""),
        "a full push after the refusal = fresh engine's": res["after_discard"] == res["fresh"],
    }
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("original")
    ap.add_argument("perturbed")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--engine-args", type=json.loads, default={})
    ap.add_argument("--prompt", type=json.loads, default=PROMPT, help="token ids (JSON) within the model's vocabulary")
    a = ap.parse_args()
    if not os.path.exists(a.perturbed):  # in a child: torch CPU work here before AsyncLLM forks its engine
        # core hangs that core on a GPU host (DEVELOPERS.md, "default multiprocess engine")
        import subprocess
        import sys

        subprocess.run([sys.executable, "-c", "import sys; from flashrl_tools.verify.perturb import perturb; "
                        "perturb(sys.argv[1], sys.argv[2])", a.original, a.perturbed], check=True)
    print("RESULT" + json.dumps(asyncio.run(main(a.original, a.perturbed, a.eager, a.engine_args, a.prompt))), flush=True)
    from flashrl_tools.verify.engine_job import exit_engine_process

    exit_engine_process(0)
